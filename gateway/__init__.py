"""The gateway: the aiohttp server speaking the OpenAI API in front of the pools (endpoints, a request's path,
admission by KV credits, the device workers' supervision, the Batch and Responses APIs, metrics). Import the
modules themselves (`gateway.app`, `gateway.cli`, ...): this package's import loads nothing."""
