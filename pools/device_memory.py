"""What a device offers the capacity plan: its type (`auto` resolved), its memory, and whether the headroom
`memory_utilization` leaves beside the weights and the KV cache holds what the engine needs there.

The plan gives a device's KV cache `memory_utilization x memory` less the weights, the rope and the decode graphs;
the rest, the headroom, holds what the engine allocates as it runs: the CUDA context and cuBLAS's handles (about
CUDA_CONTEXT_BYTES), a step's activations, and sampling: a step's logits and the sampler's working set
(`engine.sampler.sampling_memory_bytes`) and the penalties' token counts of every running sequence that uses one
(`engine.penalties.table_bytes`; `generation_config: auto` gives some models' every request a repetition penalty).
Those grow with the pools' max_num_seqs, which grow with the memory, so a small model with a large vocabulary on a
large GPU can need more than the headroom: `headroom_warning` says so before anything loads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

import engine.capacity as formula
from engine.cuda_graphs import MAX_GRAPH_BATCH, graph_memory_bytes
from engine.gemma4_config import rank_kv_heads
from engine.model_config import ModelConfig
from engine.parallel import ShardShape
from engine.penalties import table_bytes
from engine.sampler import sampling_memory_bytes
from pools.config.checks import fmt_bytes
from pools.config.spec import DEFAULT_CPU_MEMORY, DeviceSpec, SpecError

CUDA_CONTEXT_BYTES = 512 << 20   # an allowance: torch's CUDA context and cuBLAS's workspaces take about this


def resolve_device_type(device: DeviceSpec, vram_bytes: int | None, warnings: list[str]) -> str:
    """auto -> cuda when CUDA is present or --vram plans a GPU (cpu_threads unused: said in `warnings`); else
    cpu (which a Ray device's replicas, placed elsewhere, may not want: said there too)."""
    if device.device != "auto":
        return "cuda" if device.device.startswith("cuda") else "cpu"
    if vram_bytes is not None or torch.cuda.is_available():
        if device.cpu_threads is not None:   # device: cuda refuses it; auto only knows here
            warnings.append(f"devices.{device.name}.cpu_threads: {device.cpu_threads} is ignored: device auto "
                            "resolves to a GPU here, and its ranks run there")
        return "cuda"
    if device.placement == "ray":
        warnings.append(f"devices.{device.name}.device: auto on a Ray device resolves on this machine, which has "
                        "no GPU: its replicas are planned for and placed on CPUs; write device: cuda (and memory: "
                        "the GPU's size, or --vram) to place them on the cluster's GPUs")
    return "cpu"


def device_memory(device: DeviceSpec, device_type: str, vram_bytes: int | None,
            cuda_memory: Callable[[str], int] | None) -> tuple[int, str]:
    if vram_bytes is not None:
        return vram_bytes, "--vram"
    if device.memory_bytes is not None:
        return device.memory_bytes, "config"
    if device_type == "cpu":
        return DEFAULT_CPU_MEMORY, "cpu default"
    if device.placement == "ray":   # its replicas run on the cluster's GPUs: a GPU here says nothing of them
        raise SpecError(f"devices.{device.name}.memory: a Ray device on CUDA needs the size of one of the "
                        "cluster's GPUs (e.g. memory: 80GiB, or --vram); this machine's is not theirs")
    # every GPU its replicas take (`gpus`, or from the device's index on): the smallest is what each may plan
    gpus = sorted({g for r in range(device.replicas) for g in device.replica_gpus(r, "cuda")})
    if cuda_memory is not None:
        return min(cuda_memory(f"cuda:{g}") for g in gpus), "cuda"
    if gpus[-1] >= (count := torch.cuda.device_count() if torch.cuda.is_available() else 0):
        key, what = ("gpus", list(device.gpus)) if device.gpus is not None else ("device", repr(device.device))
        raise SpecError(f"devices.{device.name}.{key}: {what} needs CUDA device {gpus[-1]} and this machine has "
                        f"{f'{count} GPU(s)' if count else 'none'}; use a device it has (or cpu, auto), or "
                        "plan a GPU elsewhere with `cliffguard capacity --vram 80GiB` (or a memory: size)")
    return min(torch.cuda.get_device_properties(g).total_memory for g in gpus), "cuda"


def headroom_warning(device: DeviceSpec, memory: int, vocab_size: int, dtype_bytes: int,
                     pools: list[tuple[int, int]]) -> str | None:
    """Why a CUDA device's headroom (`memory` - usable, per GPU) may not hold what its engine allocates beside the
    weights and the KV cache, or None. `pools`: each of its pools' (max_num_seqs, max_num_batched_tokens): a step
    samples a row for each sequence it schedules, at most the lesser of the two a pool, on the rank that samples."""
    headroom = memory - formula.usable_bytes(memory, device.memory_utilization)
    rows = sum(min(seqs, tokens) for seqs, tokens in pools)
    running = sum(seqs for seqs, _ in pools)
    sampling, penalties = sampling_memory_bytes(rows, vocab_size, dtype_bytes), table_bytes(running, vocab_size)
    if CUDA_CONTEXT_BYTES + sampling + penalties <= headroom:
        return None
    return (f"devices.{device.name}.memory_utilization: {device.memory_utilization:g} leaves {fmt_bytes(headroom)} per "
            f"GPU beside the weights and the KV cache, for the CUDA context (~{fmt_bytes(CUDA_CONTEXT_BYTES)}), a "
            f"step's activations, {fmt_bytes(sampling)} to sample a step of {rows} rows of {vocab_size} logits, and "
            f"{fmt_bytes(penalties)} of token counts while its {running} sequences use penalties: expect the GPU to "
            f"run out of memory under load; lower memory_utilization, or its pools' max_num_seqs or "
            f"max_num_batched_tokens")


def no_room_for_kv(dkey: str, dev: DeviceSpec, memory: int, source: str, model: str, weights_dev: int,
                   held: tuple[str, bool, str, int, int], graphs_dev: int, kv_dev: int,
                   as_stored: int = 0) -> SpecError:
    """The SpecError of a device whose weights (held as `held` says: their dtype, whether projections are in FP8, what
    packs the experts: MXFP4, INT4 or "", how many projections are held as an integer checkpoint stores them, its
    codes' bits) and decode graphs leave no KV space,
    naming `dkey`.memory and what took
    it; where `quantization: auto` would hold the checkpoint's quantized weights as stored in fewer bytes (`as_stored`
    per GPU, the device being set to `none`), it says so."""
    usable = formula.usable_bytes(memory, dev.memory_utilization)
    dtype, fp8, packed, int4, bits = held
    held = dtype + (", its projections in FP8" if fp8 else "") + (f", its experts in {packed}" if packed else "") \
        + (f", {int4} projections in INT{bits}" if int4 else "")
    where = f" ({source})" if source != "config" else ""
    graphs = f" and {fmt_bytes(graphs_dev)} for decode graphs (enforce_eager: true frees it)" if graphs_dev else ""
    hint = (f"; quantization: auto holds the checkpoint's quantized weights as stored, {fmt_bytes(as_stored)} per GPU"
            if 0 < as_stored < weights_dev else "")
    return SpecError(f"{dkey}.memory: {dev.memory_utilization} x {fmt_bytes(memory)}{where} = {fmt_bytes(usable)} "
                     f"per GPU cannot hold the weights of {model!r}: {fmt_bytes(weights_dev)} per GPU in "
                     f"{held} (TP={dev.tensor_parallel_size}){graphs}, leaving {fmt_bytes(kv_dev)} for "
                     f"KV{hint}")


def graph_reserve(model: ModelConfig, dev: DeviceSpec, device_type: str, tp: int, dtype: torch.dtype,
                  max_model_lens: Iterable[int | None]) -> int:
    """Bytes per GPU for the decode graphs where the engine captures them (CUDA, not `enforce_eager`, not DeepSeek
    V4's attention): the largest batch it captures (`MAX_GRAPH_BATCH`: the pools' sizes come from what is left); a
    sparse attention's graphs past its dense regime (DeepSeek V3.2's, MiniMax M3's) hold its indexer's scores of
    sequences up to the longest of the device's pools' `max_model_lens` (None: the model's context)."""
    if device_type != "cuda" or dev.enforce_eager or model.deepseek_v4 is not None:
        return 0
    max_model_len = max((n or model.context_length for n in max_model_lens), default=model.context_length)
    shard = ShardShape.of(model, 0, tp)
    shapes = [(rank_kv_heads(heads, tp), dim) for heads, dim in map(model.layer_kv_shape, range(model.num_layers))]
    dim, kv_size = max(d for _, d in shapes), max(h * d for h, d in shapes)   # the widest layer's (Gemma 4's full)
    sparse = model.mla.graph_scores_bytes(max_model_len) if model.mla is not None else 0
    if model.block_indexer is not None:
        sparse += model.block_indexer.graph_scores_bytes(max_model_len, rank_kv_heads(model.num_kv_heads, tp))
    return graph_memory_bytes(model.hidden_size, shard.num_heads * dim, kv_size,
                              shard.intermediate_size, shard.num_heads, dim, MAX_GRAPH_BATCH,
                              dtype.itemsize, num_experts=model.num_experts, top_k=model.num_experts_per_tok,
                              moe_intermediate_size=shard.moe_intermediate_size, sparse_bytes=sparse)
