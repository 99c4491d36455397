"""The roofline of one forward step on a GPU preset (`RooflineStepTime`, `PRESETS`: H100, H200, A100), for planning
without the device (`engine.step_cost`'s module docstring says what it models), and the counts it is made of
(`step_flops`, `expert_params`, `experts_read`, `routed_per_token`). DeepSeek V3.2's and GLM-5's sparse attention
(`MlaShape.index_topk`): each query attends to its `index_topk` best tokens alone (the latent rows of at most that
many, as a window of that size counts them), after its indexer scored every earlier token (2 x index heads x
index_head_dim FLOPs a query-key pair, each token's indexer key read). A model with state layers reads and writes
each running sequence's state once a step (`state_bytes_per_seq`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.model_config import ModelConfig
from engine.step_cost import MiB, StepFeatures

if TYPE_CHECKING:
    from engine.scheduler_output import ScheduledSeq

@dataclass(frozen=True)
class DevicePreset:
    """One GPU as the roofline model sees it. Peaks are the vendor's dense bf16 figures; the
    efficiencies and the per-step overhead are assumptions about what a serving engine reaches."""

    name: str
    peak_flops: float                 # FLOP/s, dense bf16, per GPU
    memory_bandwidth: float           # B/s, HBM, per GPU
    swap_bandwidth: float             # B/s, device <-> host memory (PCIe)
    interconnect_bandwidth: float     # B/s per GPU and direction (NVLink), for tensor-parallel all-reduce
    memory_bytes: int                 # per GPU
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    step_overhead_s: float = 0.003    # scheduling, sampling, launches: per step, whatever its size
    allreduce_latency_s: float = 10e-6
    capability: tuple[int, int] = (9, 0)   # CUDA compute capability (an FP8 KV cache needs 8.9: engine.config)


# Vendor datasheets: H100 SXM5 989 TFLOP/s bf16 dense, 3.35 TB/s, NVLink 900 GB/s (both directions),
# PCIe Gen5; H200 SXM the same compute, 4.8 TB/s, 141 GB; A100 SXM4 80GB 312 TFLOP/s, 2.04 TB/s,
# NVLink 600 GB/s, PCIe Gen4. Host copies at about 55 GB/s (Gen5) and 25 GB/s (Gen4) pinned. Memory: the
# total the driver reports for the card (nvidia-smi's memory.total: H100 80GB HBM3 81,559 MiB, an H200 143,771
# MiB as measured for docs/PERF.md, A100 80GB 81,920 MiB), not the datasheet's "141 GB" (141e9 B, 9 GiB short);
# torch's total, which the engine checks a plan against at start, is somewhat less (the driver's reserve).
PRESETS = {
    "h100": DevicePreset("h100", 989e12, 3.35e12, 55e9, 450e9, 81_559 * MiB),
    "h200": DevicePreset("h200", 989e12, 4.8e12, 55e9, 450e9, 143_771 * MiB),
    "a100": DevicePreset("a100", 312e12, 2.04e12, 25e9, 300e9, 81_920 * MiB, capability=(8, 0)),
}


def expert_params(model: ModelConfig) -> int:
    """The weights of every expert of the sparse layers (their routers not included); 0 for a dense model. An expert
    is gate, up and down over the hidden state; Nemotron-H's up and down alone, over its latent space where it has
    one (Nemotron 3 Super's)."""
    sparse = sum(model.is_sparse_layer(layer) for layer in range(model.num_layers))
    matrices = 2 if model.architecture == "NemotronHForCausalLM" else 3
    return sparse * model.num_experts * matrices * (model.moe_latent_size or model.hidden_size) * \
        model.moe_intermediate_size


def routed_per_token(model: ModelConfig) -> float:
    """How many experts a token computes with: `num_experts_per_tok`, less its picks that fall, uniformly, on
    LongCat-Flash's zero experts (which compute nothing)."""
    return model.num_experts_per_tok * model.num_experts / (model.num_experts + model.zero_experts)


def experts_read(model: ModelConfig, num_tokens: int) -> float:
    """The fraction of the experts a step of `num_tokens` tokens reads, each token routed to
    `routed_per_token` of them uniformly (1 for a dense model: nothing to leave out)."""
    if not model.num_experts:
        return 1.0
    return 1.0 - (1.0 - routed_per_token(model) / model.num_experts) ** num_tokens


def step_flops(model: ModelConfig, num_tokens: int, num_attended: int, num_sampled: int) -> float:
    """FLOPs of one step: 2 per matmul weight per token (the embedding lookup is no matmul, the LM
    head counts only for sampled tokens, a token computes with its own experts only), 4 per query-key
    pair per head dimension of every attention layer (a hybrid's state layers attend to no keys; Gemma 4's layers
    that read an earlier layer's K/V keep none, yet attend)."""
    head = model.vocab_size * model.hidden_size
    experts = expert_params(model)
    idle = experts - round(experts * routed_per_token(model) / model.num_experts) if model.num_experts else 0
    matmul_params = model.num_params() - head * (1 if model.tie_word_embeddings else 2) - idle
    attending = model.kv_layers if model.gemma4 is None else range(model.num_layers)
    attention = 4 * model.num_heads * sum(model.layer_kv_shape(i)[1] for i in attending) * num_attended
    return 2 * matmul_params * num_tokens + attention + 2 * head * num_sampled


class RooflineStepTime:
    """A GPU preset's roofline for one model on a tensor-parallel group of `tp` GPUs (module docstring)."""

    def __init__(self, preset: DevicePreset, model: ModelConfig, dtype_bytes: int, tp: int = 1,
                 kv_dtype_bytes: int | None = None, held_bytes: tuple[int, int] | None = None) -> None:
        self.preset = preset
        self.model = model
        self.dtype_bytes = dtype_bytes
        self.tp = tp
        self.swap_bandwidth = preset.swap_bandwidth
        self.swap_latency = 0.0   # a preset's copies cost their bytes only
        # held_bytes: (the weights, their routed experts) as held where that is not num_params x dtype_bytes (FP8)
        weights, experts = held_bytes or (model.num_params() * dtype_bytes, expert_params(model) * dtype_bytes)
        self.expert_bytes = experts                                    # read as far as the tokens hit them
        self.weights_bytes = weights - experts                         # read whole every step
        kv_bytes = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes   # an FP8 cache: 1
        # the group's: a head each GPU where TP > KV heads (replicated); each layer's heads and head size
        self.kv_bytes_per_token = model.kv_planes * kv_bytes * sum(
            -(-heads // tp) * tp * dim for heads, dim in map(model.layer_kv_shape, model.kv_layers))
        # a state layer's sequence reads its state and writes it back every step it runs (its conv inputs in the
        # model's dtype, the float32 recurrent state): a Mamba-2 model's are megabytes a sequence
        shape = model.state_shape
        self.state_bytes_per_seq = 0 if shape is None else len(model.stateful_layers) * shape.state_bytes(dtype_bytes)
        windows = [w for layer in range(model.num_layers) if (w := model.layer_window(layer))]
        self.window, self.num_windowed = (windows[0] if windows else None), len(windows)   # Gemma 3's, Mistral's
        mla = model.mla
        self.index_topk = mla.index_topk if mla is not None else 0   # DeepSeek V3.2's, GLM-5's sparse attention
        if self.index_topk:   # a row's indexer key, read for every earlier token; its latent, for the chosen ones
            self.index_bytes_per_token = self.kv_bytes_per_token * mla.index_head_dim // mla.cache_dim
            self.index_flops = 2 * mla.index_heads * mla.index_head_dim * (model.num_layers - len(mla.index_shared))

    def seconds(self, batch: Sequence[ScheduledSeq], features: StepFeatures, num_sampled: int) -> float:
        m, p = self.model, self.preset
        tokens = features.num_prefill_tokens + features.num_decode_tokens
        # the K/V each sequence reads before its new tokens: its keys read less those new tokens (the
        # features carry it, so a step described without its batch, as pools.demand asks, costs the same);
        # a sliding-window layer attends and reads its window only (the kernel starts there)
        attended, keys = features.num_attended, features.num_keys_read - tokens
        if self.num_windowed and features.spans:   # less what the windowed layers skip (a step without spans: none)
            w, share = self.window, self.num_windowed / m.num_kv_layers
            attended -= share * sum(q * c + q * (q + 1) // 2 - _attended_in_window(c, q, w) for c, q in features.spans)
            keys -= share * sum(c - min(c, w) for c, _ in features.spans)
        flops = step_flops(m, tokens, attended, num_sampled)
        kv_read = keys * self.kv_bytes_per_token
        if self.index_topk and features.spans:   # each query's best index_topk tokens alone, after its indexer's scan
            chosen = sum(_attended_in_window(c, q, self.index_topk) for c, q in features.spans)
            flops += self.index_flops * attended - step_flops(m, 0, attended - chosen, 0)
            latent = sum(min(c, self.index_topk) for c, _ in features.spans)
            latent_bytes = self.kv_bytes_per_token - self.index_bytes_per_token
            kv_read = keys * self.index_bytes_per_token + latent * latent_bytes
        weights = self.weights_bytes + self.expert_bytes * experts_read(m, tokens)
        states = 2 * self.state_bytes_per_seq * (len(features.spans) if features.spans else len(batch))
        traffic = weights + kv_read + tokens * self.kv_bytes_per_token + states
        compute_s = flops / self.tp / (p.peak_flops * p.flops_efficiency)
        memory_s = traffic / self.tp / (p.memory_bandwidth * p.bandwidth_efficiency)
        allreduce_s = 0.0
        if self.tp > 1:
            size = tokens * m.hidden_size * self.dtype_bytes
            per = 2 * (self.tp - 1) / self.tp * size / p.interconnect_bandwidth + p.allreduce_latency_s
            allreduce_s = 2 * m.num_layers * per
        return p.step_overhead_s + max(compute_s, memory_s) + allreduce_s


def _attended_in_window(num_cached: int, num_new: int, window: int) -> int:
    """Query-key pairs of `num_new` tokens after `num_cached` on a layer that attends the last `window` keys."""
    whole = max(0, min(num_new, window - num_cached))   # tokens whose whole context is within the window
    return whole * num_cached + whole * (whole + 1) // 2 + (num_new - whole) * window
