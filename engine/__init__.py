"""The paged-KV LLM engine of one device: model, weights, KV cache, block manager, scheduler, step
composer, sampler and the device worker process. Import the modules themselves (`engine.llm_engine`,
`engine.config`, ...): this package's import loads nothing, so `import engine.capacity` stays light."""
