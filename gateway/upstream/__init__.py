"""Forwarding to `upstream:` pools: the relay and our HTTP/1.1 client."""
