"""Frozen, validated configuration for the engine: the KV cache, the scheduler, the pools, the engine (the
model's shape is `engine.model_config`'s).

Each class is validated on construction and never written back; derived values are properties.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field

import torch

from engine.capacity import DEFAULT_BLOCK_SIZE, DEFAULT_MEMORY_UTILIZATION
from kernels.metadata import BLOCK_SIZES

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
BF16_MIN_CAPABILITY = (8, 0)   # the GPUs with bfloat16 tensor cores (Triton's tl.dot in bf16): Ampere and later


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type, or out of range. The message names it."""


def cpu_computes_bfloat16() -> bool:
    """Whether this machine's CPU multiplies bfloat16 natively, as torch reports it (AMX tiles or AVX-512 BF16:
    Intel Xeon from Cooper Lake, AMD from Zen 4): oneDNN's bfloat16 matmuls then take half float32's bytes at
    a higher rate. Elsewhere each bfloat16 operand is widened to float32 in software before it is multiplied."""
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in ("_is_amx_tile_supported",
                                                                        "_is_avx512_bf16_supported"))


def auto_dtype(device_type: str, capability: tuple[int, int] | None = None) -> torch.dtype:
    """What `dtype: auto` is. On a CPU bfloat16 where it computes bfloat16 natively (`cpu_computes_bfloat16`;
    the builtin SmolLM2 on two such cores of a Xeon: 1.97x the output tokens/s of float32, prefill 3.0-3.2x),
    float32 elsewhere. On CUDA bfloat16, or float16 on a GPU of `capability` under BF16_MIN_CAPABILITY (None:
    not known, a plan for another machine's GPUs: bfloat16, of float16's size). Greedy answers in bfloat16
    can differ from float32's (`bench kvcache`'s yardstick); `dtype: float32` keeps them exact."""
    if device_type != "cuda":
        return torch.bfloat16 if cpu_computes_bfloat16() else torch.float32
    return torch.float16 if capability is not None and capability < BF16_MIN_CAPABILITY else torch.bfloat16


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """'float32' / 'bf16' / torch.float16 ... -> torch.dtype; anything else is a ConfigError naming it."""
    if isinstance(value, torch.dtype):
        if value in _DTYPES.values():
            return value
        raise ConfigError(f"dtype: unsupported dtype {value}; use one of float32, float16, bfloat16")
    key = str(value).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ConfigError(f"dtype: unsupported dtype {value!r}; use one of float32, float16, bfloat16")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache of one device. Its size is the sum of its pools' `num_blocks`, which the
    capacity plan (`pools.capacity_plan`) computes; the engine never derives a size of its own."""

    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError(f"block_size: must be one of {', '.join(map(str, BLOCK_SIZES))}; "
                              f"got {self.block_size!r}")


# The one definition of each choice; the scheduler implements them and the YAML spec imports them.
QUANTIZATIONS = ("auto", "fp8", "mxfp4", "int4", "int8", "none")   # the weights (`EngineConfig.quantization`)
SLIDING_KV = ("auto", "window", "full")   # engine.sliding_kv: a sliding layer's K/V, a ring a sequence or all
KV_CACHE_DTYPES = ("auto", "fp8")   # auto: the model's dtype; fp8: float8_e4m3fn with per-layer scales
DEFAULT_MIN_SHARE = 0.2   # of the device's step time, for a throughput pool with work (engine.composer)
PREEMPTION_MODES = ("recompute", "swap", "auto")   # auto: swap or recompute per victim, by measured cost
VICTIM_POLICIES = ("reverse_fifo", "longest_first", "least_progress", "lru", "priority")
_DEVICE_NAME = re.compile(r"auto|cpu|cuda|cuda:[0-9]+")   # matched whole (`$` lets a final newline by)

FP8_MIN_CAPABILITY = (8, 9)   # the GPUs with e4m3 conversions (Triton's fp8e4nv): Ada, Hopper and later


def kv_cache_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """What `kv_cache_dtype` (auto | fp8) stores K and V as, beside a model in `model_dtype`: the one rule
    for the engine and the capacity plan."""
    return torch.float8_e4m3fn if setting == "fp8" else model_dtype


def quantizes_kv_cache_only(quant: object) -> bool:
    """Whether a config.json's `quantization_config` quantizes the KV cache alone, to 8-bit floats (the weights
    stay in their float dtype; the checkpoint carries the cache's per-layer scales): llm-compressor's
    compressed-tensors with a float 8-bit `kv_cache_scheme` and no weight groups, or ModelOpt's with
    `kv_cache_quant_algo: FP8` and no `quant_algo`; neither with sparsity or a transform of the weights."""
    if not isinstance(quant, dict) or any(quant.get(key) for key in ("config_groups", "sparsity_config",
                                                                     "transform_config")):
        return False
    if quant.get("quant_method") == "compressed-tensors":
        scheme = quant.get("kv_cache_scheme")
        return isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8
    return quant.get("quant_method") == "modelopt" and quant.get("kv_cache_quant_algo") == "FP8" \
        and quant.get("quant_algo") is None


def check_int(name: str, value: object, low: int) -> None:
    """ConfigError naming `name` unless `value` is an integer >= `low` (a bool is none: `True` is no count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name}: must be an integer >= {low}, got {value!r}")


def check_device_name(value: object) -> str:
    """`auto`, `cpu`, `cuda` or `cuda:N`, else ConfigError naming `device`."""
    if not isinstance(value, str) or not _DEVICE_NAME.fullmatch(value):
        raise ConfigError(f"device: must be auto, cpu, cuda or cuda:N, got {value!r}")
    return value


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one pool's scheduler."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0        # 0: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0   # the most prompt tokens one sequence computes in a step (0: the budget)
    preemption_mode: str = "recompute"   # recompute | swap | auto (per victim, by measured cost)
    victim_policy: str = "reverse_fifo"  # see VICTIM_POLICIES
    swap_space_bytes: int = 0            # CPU block pool for swapped-out blocks (swap and auto)
    stability_floor_tokens: int = 4      # a sequence that produced fewer tokens since its (re)admission
                                         # is preempted only when no other victim exists
    enable_prefix_caching: bool = True
    state_snapshots: int | None = None   # a state model's prefix cache: its kept states (None: max_num_seqs; 0: off)

    def __post_init__(self) -> None:
        for name, low in (("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("max_model_len", 0),
                          ("swap_space_bytes", 0), ("stability_floor_tokens", 0),
                          ("long_prefill_token_threshold", 0)):
            check_int(name, getattr(self, name), low)
        if self.state_snapshots is not None:
            check_int("state_snapshots", self.state_snapshots, 0)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"preemption_mode: must be one of {', '.join(PREEMPTION_MODES)}, "
                              f"got {self.preemption_mode!r}")
        if self.victim_policy not in VICTIM_POLICIES:
            raise ConfigError(f"victim_policy: must be one of {', '.join(VICTIM_POLICIES)}, "
                              f"got {self.victim_policy!r}")
        if self.uses_swap and self.swap_space_bytes <= 0:
            raise ConfigError(f"swap_space_bytes: preemption_mode {self.preemption_mode!r} needs a CPU swap "
                              "space > 0")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ConfigError("long_prefill_token_threshold: cuts prompts into chunks, which needs chunked prefill")
        if (not self.enable_chunked_prefill and self.max_model_len
                and self.max_num_batched_tokens < self.max_model_len):
            raise ConfigError(
                "max_num_batched_tokens: without chunked prefill it must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len})")

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one sequence computes in a step: the step's budget, or `long_prefill_token_threshold` below
        it (a long prompt's chunks then leave the rest of a step to others, and a sliding layer's ring is shorter:
        `engine.sliding_kv`)."""
        threshold = self.long_prefill_token_threshold
        return min(threshold, self.max_num_batched_tokens) if threshold else self.max_num_batched_tokens

    @property
    def uses_swap(self) -> bool:
        """The pool may copy victims' blocks to a CPU swap space (modes swap and auto)."""
        return self.preemption_mode in ("swap", "auto")

    @property
    def snapshot_slots(self) -> int:
        """The states of cached prefixes a state model's pool keeps (`engine.state_cache`): `state_snapshots`, one
        per sequence it runs by default, none without prefix caching."""
        if not self.enable_prefix_caching:
            return 0
        return self.max_num_seqs if self.state_snapshots is None else self.state_snapshots


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


MAX_SLO_MS = 3_600_000   # an hour: a latency target this long targets nothing


@dataclass(frozen=True)
class LatencySLO:
    """The latency targets of an interactive pool (YAML `slo: {ttft_ms, itl_ms}`).

    The step composer (`engine.composer`) keeps every step that carries this pool's work within
    `itl_ms`, by sizing the throughput pools' prefill chunks, and keeps steps that carry only
    throughput work within `itl_ms` and half of `ttft_ms`, whichever is shorter: an interactive
    request that arrives mid-step waits at most that long before its prefill runs. While the pool
    has requests waiting or a prefill due, throughput pools drop to their floor; and the targets
    shrink while the pool's measured p99 TTFT or ITL is over its aim. A pool without an SLO is a
    throughput pool.
    """

    ttft_ms: float = 1000.0
    itl_ms: float = 100.0

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "itl_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < MAX_SLO_MS:
                raise ConfigError(f"slo.{name}: must be a number of milliseconds > 0 and < {MAX_SLO_MS} "
                                  f"(an hour), got {value!r}")

    @property
    def step_seconds(self) -> float:
        """The longest step that may carry this pool's running work."""
        return self.itl_ms / 1000

    @property
    def idle_step_seconds(self) -> float:
        """The longest throughput-only step while this pool is idle."""
        return min(self.itl_ms, self.ttft_ms / 2) / 1000


@dataclass(frozen=True)
class PoolConfig:
    """One partition of a device's KV blocks, with its own scheduler limits and service class.

    `num_blocks` comes from the capacity plan (`pools.capacity_plan.engine_configs`); pools take their
    block ranges in order. `slo` makes the pool interactive (see `LatencySLO`); None makes it a
    throughput pool, which gets at least `min_share` of the device's step time whenever it has work,
    even while an interactive pool is pressed (`engine.composer`; 0: no guarantee).
    """

    name: str = "default"
    num_blocks: int = 1024
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    slo: LatencySLO | None = None
    min_share: float = DEFAULT_MIN_SHARE
    derive_slo: bool = False        # isolation by default: the engine replaces `slo` by one from its measured step

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ConfigError(f"pools.name: must be a non-empty string, got {self.name!r}")
        if not isinstance(self.num_blocks, int) or isinstance(self.num_blocks, bool) or self.num_blocks <= 0:
            raise ConfigError(f"pools.{self.name}.num_blocks: must be a positive integer, got {self.num_blocks!r}")
        if self.slo is not None and not isinstance(self.slo, LatencySLO):
            raise ConfigError(f"pools.{self.name}.slo: must be a LatencySLO or None, got {self.slo!r}")
        if isinstance(self.min_share, bool) or not isinstance(self.min_share, (int, float)) \
                or not 0 <= self.min_share < 1:
            raise ConfigError(f"pools.{self.name}.min_share: must be a number in [0, 1), got {self.min_share!r}")
        if self.derive_slo and self.slo is None:
            raise ConfigError(f"pools.{self.name}.derive_slo: needs an slo to start from (the pool is interactive)")


DEFAULT_COLLECTIVE_TIMEOUT_SECONDS = 120.0   # tensor parallelism: a collective one rank waits on this long fails

@dataclass(frozen=True)
class EngineConfig:
    """Everything a device worker needs to start: the model, the device, the cache, the pools."""

    model: str = "builtin:smollm2-135m-instruct"
    device: str = "auto"            # auto | cpu | cuda | cuda:N
    dtype: str = "auto"             # auto: `auto_dtype` (bfloat16 on CUDA and on a CPU that has it, else float32)
    cache: CacheConfig = field(default_factory=CacheConfig)
    pools: tuple[PoolConfig, ...] = (PoolConfig(),)
    seed: int = 0                   # random weights' (`random_weights`: every rank alike)
    sampling_seed: int | None = None   # the draws of requests without a seed; None: one drawn at start, so that
                                       # two replicas (or one restarted) never repeat each other's "random" answers
    cache_dir: str | None = None    # where converted GGUF models go (default: weights.default_cache_dir())
    random_weights: bool = False    # benchmarks of model shapes we cannot download: config.json only
    memory_utilization: float = DEFAULT_MEMORY_UTILIZATION   # the plan's; the engine re-checks it on CUDA
    tensor_parallel_size: int = 1   # ranks of the device (engine.parallel); rank 0 is the worker process
    gpu_ids: tuple[int, ...] = ()   # CUDA: each rank's GPU index (empty: the device's index + rank)
    cpu_threads: int = 0            # torch threads of each rank (0: torch's default)
    enforce_eager: bool = False     # CUDA: no decode graphs (engine.cuda_graphs); every step launched eagerly
    async_scheduling: bool | None = None   # overlapped steps (engine.overlap); None: on CUDA
    kv_cache_dtype: str = "auto"    # auto: the model's dtype | fp8 (e4m3, per-layer K and V scales)
    sliding_kv: str = "auto"        # sliding layers' K/V: auto | window (a ring a sequence) | full (engine.sliding_kv)
    quantization: str = "auto"      # the weights: auto (FP8 or MXFP4 checkpoints kept as stored on GPUs that read it)
                                    # | fp8 (FP8 everywhere, a float checkpoint quantized) | none (engine.fp8_weights)
    calculate_kv_scales: bool = True   # fp8 without the checkpoint's scales: measure them at start
                                       # (engine.kv_scales); false: every scale 1.0, as vLLM's default
    collective_timeout_seconds: float = DEFAULT_COLLECTIVE_TIMEOUT_SECONDS   # TP: a collective waited on this long fails

    def __post_init__(self) -> None:
        if not self.pools:
            raise ConfigError("pools: at least one pool is required")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ConfigError(f"tensor_parallel_size: must be an integer >= 1, got {tp!r}")
        if self.gpu_ids and (len(self.gpu_ids) != tp or len(set(self.gpu_ids)) != tp
                             or any(not isinstance(i, int) or i < 0 for i in self.gpu_ids)):
            raise ConfigError(f"gpu_ids: must be {tp} distinct GPU indices (one per rank), got {list(self.gpu_ids)}")
        if not isinstance(self.enforce_eager, bool):
            raise ConfigError(f"enforce_eager: must be true or false, got {self.enforce_eager!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.sliding_kv not in SLIDING_KV:
            raise ConfigError(f"sliding_kv: must be one of {', '.join(SLIDING_KV)}, got {self.sliding_kv!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization: must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if not isinstance(self.calculate_kv_scales, bool):
            raise ConfigError(f"calculate_kv_scales: must be true or false, got {self.calculate_kv_scales!r}")
        if self.async_scheduling not in (None, True, False):
            raise ConfigError(f"async_scheduling: must be true, false or unset, got {self.async_scheduling!r}")
        timeout = self.collective_timeout_seconds
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"collective_timeout_seconds: must be a number of seconds > 0, got {timeout!r}")
        check_int("cpu_threads", self.cpu_threads, 0)
        seed = self.sampling_seed   # (torch's generators take 0 .. 2^64 - 1; ours stay within a signed 64 bits)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise ConfigError(f"sampling_seed: must be an integer in 0..2^63-1 or unset, got {seed!r}")
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ConfigError(f"pools: duplicate pool names in {names}")
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        check_device_name(self.device)
        share = self.memory_utilization
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ConfigError(f"memory_utilization: must be a number in (0, 1], got {share!r}")

    @property
    def num_blocks(self) -> int:
        """Blocks of the device's KV tensor: its pools' blocks together."""
        return sum(p.num_blocks for p in self.pools)

    @property
    def max_num_seqs(self) -> int:
        """The sequences the device runs at once at most: its pools' max_num_seqs together."""
        return sum(p.scheduler.max_num_seqs for p in self.pools)

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device: {self.device!r} requested but no CUDA device is available")
        return device

    @property
    def max_model_lens(self) -> tuple[int, ...]:
        """Each pool's longest sequence (0: the model's context), for `ModelConfig.serving`."""
        return tuple(pool.scheduler.max_model_len for pool in self.pools)

    def rank_devices(self) -> list[torch.device]:
        """The torch device of each rank: rank r on GPU `gpu_ids[r]`, or the device's index + r; every
        rank of a CPU device on the CPU."""
        device = self.resolved_device()
        if device.type != "cuda":
            return [device] * self.tensor_parallel_size
        first = device.index or 0
        ids = self.gpu_ids or tuple(range(first, first + self.tensor_parallel_size))
        if max(ids) >= torch.cuda.device_count():
            raise ConfigError(f"gpu_ids: GPU {max(ids)} requested; this machine has {torch.cuda.device_count()}")
        return [torch.device("cuda", i) for i in ids]

    def draw_sampling_seed(self) -> int:
        """`sampling_seed`, or where it is None a fresh one (every engine's own)."""
        return secrets.randbits(63) if self.sampling_seed is None else self.sampling_seed

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        """The weights' and activations' type: `dtype`, or with `auto` `auto_dtype`'s: on a CPU bfloat16 where it
        computes it natively, else float32; bfloat16 on a GPU that has it (compute capability 8.0 and up: Ampere,
        Ada, Hopper, Blackwell), float16 on one before (V100, T4), where bfloat16 is refused by name."""
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        if self.dtype == "auto":
            return auto_dtype(device.type, capability)
        dtype = parse_dtype(self.dtype)
        if dtype == torch.bfloat16 and capability is not None and capability < BF16_MIN_CAPABILITY:
            raise ConfigError(f"dtype: bfloat16 needs a GPU of compute capability "
                              f"{'.'.join(map(str, BF16_MIN_CAPABILITY))} or newer; {device} is "
                              f"{'.'.join(map(str, capability))}: use dtype: float16 (or auto)")
        return dtype

    def resolved_kv_dtype(self, device: torch.device) -> torch.dtype:
        """The KV cache's element type: the model's, or float8_e4m3fn with `kv_cache_dtype: fp8`, which a GPU
        stores and reads with its own FP8 conversions (Triton's e4m3 type: compute capability 8.9 and up)."""
        dtype = kv_cache_dtype(self.kv_cache_dtype, self.resolved_dtype(device))
        if dtype == torch.float8_e4m3fn and device.type == "cuda":
            capability = torch.cuda.get_device_capability(device)
            if capability < FP8_MIN_CAPABILITY:
                raise ConfigError(f"kv_cache_dtype: fp8 needs a GPU of compute capability "
                                  f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} or newer (Ada, Hopper, Blackwell); "
                                  f"{device} is {'.'.join(map(str, capability))}: use kv_cache_dtype: auto")
        return dtype
