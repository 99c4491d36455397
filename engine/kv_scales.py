"""The per-layer scales of an FP8 KV cache, measured when the checkpoint brings none.

An FP8 (e4m3) cache stores K / k_scale and V / v_scale. e4m3 keeps about two significant digits from
2^-6 up to 448: below 2^-6 a value loses precision (subnormals), above 448 it saturates. With a scale of 1.0
a small model's values fall on both sides (the builtin SmolLM2's first layer keeps 41% of its V below 2^-6,
while K reaches 20 in the middle layers), so a checkpoint without `k_scale` / `v_scale` gets them measured
here: one prefill of a fixed text (`CALIBRATION_TEXT`, chat-templated as a user turn where the model has a
template) with an observer on every layer's K and V, and each layer's scale set so its largest |K| (|V|)
lands at `SCALE_RANGE`, leaving headroom under 448 for values larger than the text's. vLLM's
`calculate_kv_scales` measures the same way, on the first batch it serves. The device key of the same name
(`EngineConfig.calculate_kv_scales`, default true) turns the measuring off: every scale then stays 1.0
unless the checkpoint brings its own, as in vLLM by default.

The blocks are borrowed from the largest pool and given back (nothing is cached); the prefill's own K/V
(stored with the scales of 1.0 they replace) are overwritten by the next use of those blocks. In a
tensor-parallel group the prefill's plan says to measure (`StepPlan.measure_kv_scales`): every rank
observes its own KV heads, and one MAX all-reduce gives every rank the whole layer's largest |K| and |V|,
so the group sets the scales one rank would (`measure_kv_scales`). The engine measures before it captures
CUDA graphs, which freeze the scales a launch was given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from engine.sampling import SamplingParams
from engine.scheduler_output import ScheduledSeq
from engine.sequence import Sequence
from engine.step_commit import commit_step
from kernels.reference import FP8_KV_DTYPE

log = logging.getLogger("cliffguard.engine")

SCALE_RANGE = 200.0   # where a layer's largest measured |K| (|V|) lands: 2.24x headroom under e4m3's 448
MIN_SCALE = 1e-6      # a layer whose values are all zero keeps a usable scale
CALIBRATION_TEXT = (
    "Read the following notes and answer the questions at the end. The river rises in the northern hills, "
    "runs past three mill towns and reaches the sea after 212 kilometres; its delta floods every spring. "
    "In 1887 the town council voted 7 to 4 to build a stone bridge, which opened in 1891 and still carries "
    "about 18,000 vehicles a day. The recipe calls for 250 g of flour, two eggs, 300 ml of milk and a pinch "
    "of salt; whisk, rest for thirty minutes, then cook on a hot pan. def mean(xs): return sum(xs) / len(xs) "
    "# returns 0.0 for [0, 0]? No: it raises ZeroDivisionError on an empty list. Questions: How long is the "
    "river? When did the bridge open? What goes into the batter, and why rest it? Fix the function.")


def calibrate_kv_scales(engine: Any) -> dict[str, tuple[float, float]] | None:
    """Measure and set every layer's k_scale / v_scale for `engine`'s FP8 cache (see the module
    docstring). Returns {"k": (min, max), "v": (min, max)} of the scales set, or None when nothing was
    measured: not an FP8 cache, `calculate_kv_scales` false, scales from the checkpoint, or too few free
    blocks. Rank 0 of a tensor-parallel group measures with its other ranks (the module docstring)."""
    attns = attentions(engine.model)
    if engine.kv_dtype != FP8_KV_DTYPE or not attns:   # a model without attention (Mamba's) stores no K/V
        return None
    if engine.model.kv_scales_from_checkpoint:   # its 1.0s too: they were chosen
        unscaled = [f"{i}.{attr}" for i in attns for attr in ("k_scale", "v_scale")
                    if (i, attr) not in engine.model.kv_scales_read]
        if unscaled:   # none is measured once the checkpoint brings any: those it lacks stay 1.0, as in vLLM
            log.warning("the checkpoint's FP8 KV scales leave %d of %d at 1.0 (layers %s): the cache stores those "
                        "unscaled", len(unscaled), 2 * len(attns), ", ".join(unscaled[:8]))
        return None
    if not engine.config.calculate_kv_scales:
        return None
    lender = max(engine.schedulers.values(), key=lambda s: s.block_manager.num_blocks)   # lends blocks
    bm, ids = lender.block_manager, _calibration_ids(engine, max(s.max_model_len for s in engine.schedulers.values()))
    if getattr(engine, "ring", None) is not None:   # one step, which its row's rings hold (`engine.sliding_kv`)
        ids = ids[:lender.config.max_step_tokens]
    if bm.num_blocks_for(len(ids)) > bm.num_free_blocks:
        log.warning("FP8 KV cache: the scales were not measured (the largest pool has %d free blocks, the %d-token "
                    "calibration text needs %d): every layer's stay 1.0, which loses precision on small values",
                    bm.num_free_blocks, len(ids), bm.num_blocks_for(len(ids)))
        return None
    seq = Sequence(seq_id=-100, request_id="kv-scales", index=0, token_ids=ids, num_prompt_tokens=len(ids),
                   params=SamplingParams(), max_tokens=1, priority=0, arrival_order=-1, generator=None,
                   pool=lender.name)
    batch = [ScheduledSeq(seq, len(ids))]
    try:
        bm.allocate(seq.block_table, len(ids))
        measure_kv_scales(engine.model, lambda: engine.runner.execute(batch, measure_scales=True))
        commit_step({}, batch)   # no pool's: the blocks are borrowed, nothing is cached
    finally:
        bm.free(seq.block_table)
        engine.runner.release(seq)
    ranges = {name: (min(getattr(a, f"{name}_scale") for a in attns.values()),
                     max(getattr(a, f"{name}_scale") for a in attns.values())) for name in ("k", "v")}
    log.info("FP8 KV cache: scales measured on a %d-token text: k %.3g..%.3g, v %.3g..%.3g", len(ids),
             *ranges["k"], *ranges["v"])
    return ranges


def attentions(model: Any) -> dict[int, Any]:
    """Each attention module that stores K/V, by the index of its layer (Qwen3.5's linear-attention layers have none);
    a model whose layers share attention modules names each once itself (`kv_attentions`: Zamba2's blocks)."""
    own = getattr(model, "kv_attentions", None)
    if own is not None:
        return own()
    return {i: layer.self_attn for i, layer in enumerate(model.layers) if hasattr(layer, "self_attn")}


def measure_kv_scales(model: Any, run: Callable[[], object]) -> None:
    """Set every layer's k_scale / v_scale from what `run()` (a forward pass of this rank's) stores: its
    largest |K| and |V| per layer, the MAX over the model's tensor-parallel group (every rank calls this
    for the same plan), put at `SCALE_RANGE`."""
    attns = list(attentions(model).values())
    device = model.embed_tokens.weight.device
    amax = torch.zeros(len(attns), 2, dtype=torch.float32, device=device)   # on the device: no read per layer

    def observer(index: int):
        def observe(key: torch.Tensor, value: torch.Tensor) -> None:
            amax[index, 0] = torch.maximum(amax[index, 0], key.abs().max().float())
            amax[index, 1] = torch.maximum(amax[index, 1], value.abs().max().float())
        return observe

    try:
        for i, attn in enumerate(attns):
            attn.kv_observer = observer(i)
        run()
    finally:
        for attn in attns:
            attn.kv_observer = None
    for attn, (k_max, v_max) in zip(attns, model.comm.all_reduce_max(amax).tolist()):
        attn.k_scale, attn.v_scale = max(k_max / SCALE_RANGE, MIN_SCALE), max(v_max / SCALE_RANGE, MIN_SCALE)


def _calibration_ids(engine: Any, max_model_len: int) -> list[int]:
    """The text as a chat user turn where the tokenizer has a template, else plain; within the longest pool's
    max_model_len (a pool with a shorter one does not change the scales; only a device whose every pool is
    shorter than the text, a few hundred tokens, measures on less of it)."""
    tokenizer = engine.tokenizer
    try:
        ids = tokenizer.encode_chat([{"role": "user", "content": CALIBRATION_TEXT}])
    except ValueError:   # no chat template
        ids = tokenizer.encode(CALIBRATION_TEXT)
    limit = max_model_len - 1
    vocab = engine.model_config.vocab_size
    return [i for i in ids if i < vocab][:limit]
