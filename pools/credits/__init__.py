"""KV credits: the ledger, the queue requests await, fair flows, placement on replicas."""
