"""Pools: the YAML specification, the capacity plan, exact token counting, routing, KV credits and
the simulator. Import the modules themselves (`pools.config.spec`, `pools.capacity_plan`, ...): this package's
import loads nothing, so `import pools.credits.ledger` needs neither torch nor the engine."""
