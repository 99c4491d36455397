"""The OpenAI protocol: request bodies checked against msgspec models (`chat`, `completions`, `sampling_fields`,
`errors`), the objects answers are made of (`objects`), tool calls (`tool_specs`, `tools`, `tool_grammar`), and the
Responses API (`responses`: read as a chat, written as a Response or its events; `response_endpoints`: its
endpoints; `stored_responses`: the responses the gateway keeps)."""
