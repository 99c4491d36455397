"""`cliffguard simulate`: the real schedulers on a modelled device, to plan pools without the device.

What runs is our own scheduling code, not a model of it: each device of a pool file gets the
schedulers and block managers that `engine.scheduler.build_scheduler` makes for the engine, the same
`StepComposer` decides every step across the device's pools, the engine's `commit_step` does each
step's bookkeeping, and the gateway's `CreditLedger` holds requests until their KV credits fit (as
`serve` does by default). A device with `replicas: R` runs as R such replicas on one virtual clock
behind one credit queue per pool, placed by the gateway's own `Placement` (`devicesim.ReplicaGroup`). What is
modelled is only what a step costs: tokens are made up (no tensors, no model), and each step
advances a virtual clock by the time a step-cost model (`engine.step_cost`: the GPU presets'
roofline, or the linear model measured on a real device) gives for the work the schedulers chose,
plus the swap copies they asked for.

Requests come from a workload (`pools.workload`, the classes `cliffguard bench serve` sends), are
routed by prompt length exactly as the gateway routes them (the first local pool of the config whose
route admits the count), and generate exactly their `output_len` tokens (ignore_eos). Per class the
result has TTFT, ITL and e2e percentiles and throughput; per pool preemptions, swap traffic and KV
usage over time.

Not modelled: the chat template's tokens (prompt_len is the count the engine sees), prefix sharing
between requests (prompts are random ids: a workload's `shared_prefix` only adds its document's
tokens to each prompt, so placement spreads replicas' work by token load, never by prefix affinity),
tenants and batch lines (one tenant, interactive), the gateway's own latency, a replica that dies or
restarts, and a step's variance (the model is deterministic).

Modules: `devicesim` (one replica of a device on a virtual clock, and a device's replicas on one
clock behind the gateway's credit queues and placement), `runner` (a whole configuration:
routing, devices, the shared layout), `summary` (percentiles and the report), `knee` (a sweep over
request rates and its plot), `recommend` (the KV split and token budget that meet an SLO).
"""
