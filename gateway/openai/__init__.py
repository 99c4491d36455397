"""The OpenAI protocol: requests read and checked (`protocol`), the objects answers are made of (`objects`), tool
calls (`tools`, `tool_grammar`), and the Responses API (`responses`: read as a chat, written as a Response or
its events; `stored_responses`: its endpoints and the responses the gateway keeps)."""
