"""`cliffguard bench kernels`: the paged-KV kernels beside the device's measured ceilings, in one run.

- decode paged attention (query length 1) over a batch x context grid: time per call and achieved
  bandwidth = (K/V read + Q read + O written) / time, beside a large `dst.copy_(src)` measured in the
  same run. Goal: >= 80% of the copy bandwidth on the large cases (>= 64 MiB moved per call).
- prefill paged attention (chunk = the whole prompt, causal, K/V already in the paged cache): TFLOP/s
  beside torch SDPA (`is_causal=True`, contiguous K/V, the faster of `enable_gqa=True` and K/V expanded
  to every query head) on the same shapes, and beside the measured matmul rate. With the Triton backend
  a prompt of at least `PREFILL_MIN_QUERY_LEN` tokens runs the tensor-core prefill kernel
  (`kernels.triton_prefill`); the `kernel` column says which ran. Goal: >= 0.7x SDPA on the prompts of
  at least 2,048 tokens (1 x 4096 and 4 x 2048 by default); shorter ones are reported, not judged.
- store_kv: achieved bandwidth (K/V read + written + slots read) beside the copy.

`--kv-dtype fp8` runs the same on an FP8 cache (float8_e4m3fn: half a bfloat16 cache's bytes), its K/V read
and written as the engine's `kv_cache_dtype: fp8` does (scales 1.0); the bandwidth counts its bytes.
`--latent` runs DeepSeek's latent attention as the engine does (`engine.models.deepseek`): one cache plane whose
rows are both K and V, one KV head of the latent and rotated key (head_dim 576) under 16 query heads (DeepSeek-V3's
128 over 8 ranks); decode's bytes count that plane once, store_kv's its two writes (K and V: the same rows).

One layer's K/V lives in a `KVCache` (the engine's `[L, 2, num_blocks, block_size, kv_heads, head_dim]`
tensor) big enough for the largest shape; every case gets block tables shuffled over all of its blocks.
Before timing, every shape is checked against `kernels.reference` (the torch path; dense attention when
the backend under test is the reference itself) and marked ✓ or ✗; any ✗ makes the exit code 1.
Times are medians of `--iters` calls after `--warmup` ones, with CUDA events and the L2 cache flushed
before each call.

Meant for a GPU. `--dry-run` runs tiny shapes on the CPU through Triton's interpreter (TRITON_INTERPRET=1):
the checks count, the numbers do not. Without a GPU and without `--dry-run` it exits with code 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.engine import measure_copy_bandwidth, measure_matmul_rate, time_call
from kernels.metadata import BLOCK_SIZES
from pools.cli_types import non_negative_int, positive_int, seed

TRITON_MODULES = ("kernels.triton_attention", "kernels.triton_prefill", "kernels.triton_kv_store")
LARGE_BYTES = 64 << 20           # decode rows moving at least this much count for the bandwidth goal
DECODE_GOAL = 0.80               # of copy bandwidth
PREFILL_GOAL = 0.70              # of SDPA's TFLOP/s
PREFILL_GOAL_MIN_LEN = 2048      # prompts at least this long count for the prefill goal
# Max |ours - reference| allowed, relative to max |reference| (fp32 allows for TF32 dots on GPU).
TOLERANCE = {torch.float32: 5e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}

# (full run, --dry-run) defaults
DEFAULTS = {
    "decode_shapes": ("1x32768,8x8192,64x4096,256x1024", "1x70,3x33,4x16"),
    "prefill_shapes": ("1x4096,4x2048,16x512", "1x80,3x17"),
    "store_shapes": ("256x1,4x2048", "5x1,2x21"),
    "num_heads": (32, 4),
    "num_kv_heads": (8, 2),
    "head_dim": (128, 32),
    "latent": ((16, 1, 576), (4, 1, 40)),   # --latent's heads, KV heads and head_dim
    "iters": (20, 1),
    "warmup": (3, 0),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("auto", "triton", "torch"), default="auto",
                   help="kernels under test: triton (kernels.triton_attention, kernels.triton_kv_store) or torch "
                   "(kernels.reference); auto: triton when those modules exist, else torch")
    p.add_argument("--device", default="auto", help="auto | cuda | cuda:N | cpu (auto: cuda; cpu with --dry-run)")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU) | bfloat16 | float16 "
                   "| float32")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes on the CPU through Triton's interpreter: checks results, timings meaningless")
    p.add_argument("--decode-shapes", default=None, metavar="BxCTX,...",
                   help=f"decode batch x context length (default {DEFAULTS['decode_shapes'][0]}; dry run "
                   f"{DEFAULTS['decode_shapes'][1]})")
    p.add_argument("--prefill-shapes", default=None, metavar="BxLEN,...",
                   help=f"prefill batch x prompt length (default {DEFAULTS['prefill_shapes'][0]}; dry run "
                   f"{DEFAULTS['prefill_shapes'][1]})")
    p.add_argument("--store-shapes", default=None, metavar="BxNEW,...",
                   help=f"store_kv sequences x new tokens each (default {DEFAULTS['store_shapes'][0]}; dry run "
                   f"{DEFAULTS['store_shapes'][1]})")
    p.add_argument("--num-heads", type=positive_int, default=None, help="query heads (default 32; dry run 4)")
    p.add_argument("--num-kv-heads", type=positive_int, default=None, help="KV heads (default 8; dry run 2)")
    p.add_argument("--head-dim", type=positive_int, default=None, help="(default 128; dry run 32)")
    p.add_argument("--block-size", type=int, choices=BLOCK_SIZES, default=16, help="tokens per KV block (16)")
    p.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto",
                   help="the KV cache's: auto (--dtype's, default) | fp8 (float8_e4m3fn: its bytes counted)")
    p.add_argument("--latent", action="store_true",
                   help="DeepSeek's latent attention: one cache plane read as K and V, one KV head; default heads "
                   "16, head_dim 576 (dry run 4, 40)")
    p.add_argument("--num-splits", type=positive_int, default=None,
                   help="passed to the Triton paged_attention (default: its own choice)")
    p.add_argument("--iters", type=positive_int, default=None, help="timed calls per case, the median counts (20)")
    p.add_argument("--warmup", type=non_negative_int, default=None, help="untimed calls per case first (3)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


@dataclass(frozen=True)
class Backend:
    """The two kernels under test and where they come from."""

    name: str                       # triton | torch
    source: str                     # module names, for the report
    paged_attention: Callable
    store_kv: Callable
    # Chunks of at least this many tokens run the Triton prefill kernel (None: no such kernel).
    prefill_min_query_len: int | None = None

    def prefill_kernel(self, query_len: int) -> str:
        """Which kernel a chunk of `query_len` tokens runs: prefill | paged | reference."""
        if self.name == "torch":
            return "reference"
        if self.prefill_min_query_len is not None and query_len >= self.prefill_min_query_len:
            return "prefill"
        return "paged"


@dataclass(frozen=True)
class Setup:
    """What every case of one run shares."""

    device: torch.device
    dtype: torch.dtype
    backend: Backend
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_splits: int | None
    iters: int
    warmup: int
    kv_dtype: torch.dtype | None = None   # the cache's, where it is not `dtype` (FP8)
    latent: bool = False                  # one plane, its rows both K and V (DeepSeek's latent attention)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def plane_bytes_per_token(self) -> int:
        """One token's K (or V) in one layer, in the cache's dtype."""
        return self.num_kv_heads * self.head_dim * (self.kv_dtype or self.dtype).itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        """What the cache holds of one token in one layer: K and V, or the latent plane alone."""
        return (1 if self.latent else 2) * self.plane_bytes_per_token


def triton_available() -> bool:
    """Whether the Triton kernel modules exist (found, not imported) and triton is installed."""
    return importlib.util.find_spec("triton") is not None and all(
        importlib.util.find_spec(name) is not None for name in TRITON_MODULES)


def load_backend(name: str, device: torch.device) -> Backend:
    """The kernels for `name` (auto | triton | torch). On the CPU, Triton runs through its interpreter."""
    from kernels import reference

    if name == "auto":
        name = "triton" if triton_available() else "torch"
    if name == "torch":
        return Backend("torch", "kernels.reference", reference.paged_attention, reference.store_kv)
    if not triton_available():
        raise ValueError(f"--backend triton: {' and '.join(TRITON_MODULES)} (and the triton package) are needed")
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at their import
    attention, _, kv_store = (importlib.import_module(m) for m in TRITON_MODULES)
    if device.type == "cpu" and not getattr(attention, "INTERPRETED", True):
        raise RuntimeError("--backend triton on the CPU: the kernels were imported without Triton's interpreter; "
                           "set TRITON_INTERPRET=1 in the environment before anything imports them")
    return Backend("triton", ", ".join(TRITON_MODULES), attention.paged_attention, kv_store.store_kv,
                   attention.PREFILL_MIN_QUERY_LEN)


def parse_shapes(text: str, option: str) -> list[tuple[int, int]]:
    """'1x4096,4x2048' -> [(1, 4096), (4, 2048)]."""
    shapes = []
    for item in text.split(","):
        if not item.strip():
            continue
        try:
            a, b = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"{option}: expected BxN items separated by commas, got {item!r}") from None
        if a < 1 or b < 1:
            raise ValueError(f"{option}: sizes must be >= 1, got {item!r}")
        shapes.append((a, b))
    return shapes


# --- cases -----------------------------------------------------------------------------------------


def _make_cache(setup: Setup, num_blocks: int):
    """One layer's K/V as the engine holds them, filled with N(0, 1)."""
    from engine.kv_cache import KVCache
    from engine.model_config import ModelConfig
    from engine.mla_config import MlaShape

    # a latent cache: one plane (only the cache's dimension counts of the attention's shape)
    mla = MlaShape(0, setup.head_dim - 8, 8, 8, 8) if setup.latent else None
    model = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1, hidden_size=setup.num_heads * setup.head_dim,
                        intermediate_size=1, num_layers=1, num_heads=setup.num_heads,
                        num_kv_heads=setup.num_kv_heads, head_dim=setup.head_dim, mla=mla)
    cache = KVCache(model, num_blocks, setup.block_size, setup.kv_dtype or setup.dtype, setup.device)
    for part in cache.data.view(-1).split(1 << 26):   # N(0, 1) drawn in float32 (FP8 has no normal_), in parts
        part.copy_(torch.randn(part.shape, device=part.device))
    return cache


def _make_meta(setup: Setup, num_blocks: int, query_lens: list[int], seq_lens: list[int], rng: random.Random):
    """Metadata for the sequences, their blocks drawn at random from all `num_blocks`."""
    from kernels import AttentionMetadata

    need = [math.ceil(s / setup.block_size) for s in seq_lens]
    ids = rng.sample(range(num_blocks), sum(need))
    tables, pos = [], 0
    for n in need:
        tables.append(ids[pos:pos + n])
        pos += n
    return AttentionMetadata.build(tables, query_lens, seq_lens, setup.block_size, setup.device)


def _attention(setup: Setup, query, k_cache, v_cache, meta):
    kwargs = {"num_splits": setup.num_splits} if setup.num_splits is not None and setup.backend.name == "triton" \
        else {}
    return setup.backend.paged_attention(query, k_cache, v_cache, meta, setup.scale, **kwargs)


def _expected_attention(setup: Setup, query, k_cache, v_cache, meta):
    """The reference's output; dense attention per sequence when the reference itself is under test."""
    from kernels import reference

    if setup.backend.name != "torch":
        return reference.paged_attention(query, k_cache, v_cache, meta, setup.scale)
    k_flat = reference.dequantize_kv(k_cache, query.dtype).reshape(-1, setup.num_kv_heads, setup.head_dim)
    v_flat = reference.dequantize_kv(v_cache, query.dtype).reshape(-1, setup.num_kv_heads, setup.head_dim)
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        pos = torch.arange(s_len, device=query.device)
        slots = meta.block_tables[i].long()[pos // setup.block_size] * setup.block_size + pos % setup.block_size
        out[start:start + q_len] = reference.dense_causal_attention(
            query[start:start + q_len], k_flat[slots], v_flat[slots], setup.scale)
        start += q_len
    return out


def _check(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> dict:
    """ok when finite and max |out - want| <= TOLERANCE x max |want|."""
    err = (out.float() - want.float()).abs().max().item()
    ref = want.float().abs().max().item()
    ok = bool(torch.isfinite(out).all().item()) and err <= TOLERANCE[dtype] * max(ref, 1e-6)
    return {"ok": ok, "max_abs_err": err, "max_abs_ref": ref}


def _median_time(setup: Setup, fn: Callable, flush: Callable | None) -> float:
    return statistics.median(time_call(fn, setup.device, warmup=setup.warmup, iters=setup.iters, before=flush))


def bench_decode(setup: Setup, cache, batch: int, context: int, rng: random.Random, copy_bw: float,
                 flush) -> dict:
    meta = _make_meta(setup, cache.num_blocks, [1] * batch, [context] * batch, rng)
    k_cache, v_cache = cache.layers[0]
    query = torch.randn(batch, setup.num_heads, setup.head_dim, device=setup.device).to(setup.dtype)
    check = _check(_attention(setup, query, k_cache, v_cache, meta),
                   _expected_attention(setup, query, k_cache, v_cache, meta), setup.dtype)
    seconds = _median_time(setup, lambda: _attention(setup, query, k_cache, v_cache, meta), flush)
    nbytes = batch * context * setup.kv_bytes_per_token + 2 * query.numel() * query.element_size()
    return {"batch": batch, "context": context, **check, "ms": seconds * 1e3, "bytes": nbytes,
            "gbps": nbytes / seconds / 1e9, "of_copy": nbytes / seconds / copy_bw, "large": nbytes >= LARGE_BYTES}


def _sdpa_seconds(setup: Setup, batch: int, seq_len: int, flush) -> tuple[float, str]:
    """Best of SDPA with enable_gqa=True and with K/V expanded to every query head."""
    import torch.nn.functional as F

    shape = (batch, setup.num_heads, seq_len, setup.head_dim)
    q = torch.randn(shape, device=setup.device).to(setup.dtype)
    k = torch.randn(batch, setup.num_kv_heads, seq_len, setup.head_dim, device=setup.device).to(setup.dtype)
    v = k if setup.latent else torch.randn_like(k)
    group = setup.num_heads // setup.num_kv_heads
    k_exp, v_exp = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    variants = {
        "enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=setup.scale,
                                                             enable_gqa=True),
        "expanded": lambda: F.scaled_dot_product_attention(q, k_exp, v_exp, is_causal=True, scale=setup.scale),
    }
    best = (float("inf"), "")
    for name, fn in variants.items():
        try:
            best = min(best, (_median_time(setup, fn, flush), name))
        except (RuntimeError, TypeError):  # a torch without enable_gqa, or no kernel for it
            continue
    return best


def bench_prefill(setup: Setup, cache, batch: int, seq_len: int, rng: random.Random, matmul_rate: float,
                  flush) -> dict:
    meta = _make_meta(setup, cache.num_blocks, [seq_len] * batch, [seq_len] * batch, rng)
    k_cache, v_cache = cache.layers[0]
    query = torch.randn(batch * seq_len, setup.num_heads, setup.head_dim, device=setup.device).to(setup.dtype)
    check = _check(_attention(setup, query, k_cache, v_cache, meta),
                   _expected_attention(setup, query, k_cache, v_cache, meta), setup.dtype)
    seconds = _median_time(setup, lambda: _attention(setup, query, k_cache, v_cache, meta), flush)
    sdpa_seconds, sdpa_variant = _sdpa_seconds(setup, batch, seq_len, flush)
    # QK^T and PV, 2 FLOPs per multiply-add, over the causal pairs only
    flops = 4 * batch * setup.num_heads * setup.head_dim * seq_len * (seq_len + 1) // 2
    return {"batch": batch, "seq_len": seq_len, "kernel": setup.backend.prefill_kernel(seq_len), **check,
            "ms": seconds * 1e3, "tflops": flops / seconds / 1e12, "sdpa_ms": sdpa_seconds * 1e3,
            "sdpa_tflops": flops / sdpa_seconds / 1e12, "sdpa_variant": sdpa_variant,
            "ratio": sdpa_seconds / seconds, "of_matmul": flops / seconds / matmul_rate, "flops": flops,
            "goal": seq_len >= PREFILL_GOAL_MIN_LEN}


def bench_store(setup: Setup, num_seqs: int, new_tokens: int, rng: random.Random, copy_bw: float, flush) -> dict:
    """Each sequence writes `new_tokens` after a random prefix shorter than a block (mid-block starts)."""
    from engine.kv_cache import raw
    from kernels import reference

    prefixes = [rng.randrange(setup.block_size) for _ in range(num_seqs)]
    seq_lens = [p + new_tokens for p in prefixes]
    num_blocks = sum(math.ceil(s / setup.block_size) for s in seq_lens) * 5 // 4 + 1
    cache = _make_cache(setup, num_blocks)
    meta = _make_meta(setup, num_blocks, [new_tokens] * num_seqs, seq_lens, rng)
    num_tokens = num_seqs * new_tokens
    key = torch.randn(num_tokens, setup.num_kv_heads, setup.head_dim, device=setup.device).to(setup.dtype)
    value = key if setup.latent else torch.randn_like(key)   # a latent cache: the engine stores the rows as both
    want = cache.data.clone()
    reference.store_kv(key, value, want[0, 0], want[0, -1], meta)
    k_cache, v_cache = cache.layers[0]
    setup.backend.store_kv(key, value, k_cache, v_cache, meta)
    ok = torch.equal(cache.raw, raw(want))   # as bytes: FP8 has no equal on every device
    seconds = _median_time(setup, lambda: setup.backend.store_kv(key, value, k_cache, v_cache, meta), flush)
    # K/V read in their dtype, written in the cache's (an FP8 cache: a byte a value; a latent one twice), the slots
    nbytes = 2 * key.numel() * key.element_size() + num_tokens * 2 * setup.plane_bytes_per_token \
        + meta.slot_mapping.numel() * 8
    return {"num_seqs": num_seqs, "new_tokens": new_tokens, "ok": ok, "ms": seconds * 1e3, "bytes": nbytes,
            "gbps": nbytes / seconds / 1e9, "of_copy": nbytes / seconds / copy_bw}


# --- the run ---------------------------------------------------------------------------------------


def _resolve_device(args: argparse.Namespace) -> torch.device | None:
    """The device to run on, or None when a GPU is needed and there is none."""
    if args.device == "auto":
        if args.dry_run:
            return torch.device("cpu")
        return torch.device("cuda") if torch.cuda.is_available() else None
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return None
    if device.type == "cpu" and not args.dry_run:
        return None
    return device


def _setting(args: argparse.Namespace, name: str):
    value = getattr(args, name)
    return value if value is not None else DEFAULTS[name][1 if args.dry_run else 0]


def _heads(args: argparse.Namespace) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) the options give, `--latent`'s defaults where it is on and they say nothing;
    ValueError naming the option they break."""
    num_heads, num_kv_heads, head_dim = (_setting(args, name) for name in ("num_heads", "num_kv_heads", "head_dim"))
    if args.latent:
        num_heads, num_kv_heads, head_dim = (given if given is not None else default for given, default in zip(
            (args.num_heads, args.num_kv_heads, args.head_dim), DEFAULTS["latent"][1 if args.dry_run else 0]))
        if num_kv_heads != 1 or head_dim <= 8:
            raise ValueError(f"--latent: one KV head of more than 8 dimensions, got {num_kv_heads} of {head_dim}")
    if num_heads % num_kv_heads:   # (each >= 1: the options' type)
        raise ValueError(f"--num-kv-heads: {num_kv_heads} does not divide --num-heads {num_heads}")
    return num_heads, num_kv_heads, head_dim


def run(args: argparse.Namespace) -> int:
    from engine.config import kv_cache_dtype, parse_dtype

    decode_shapes = parse_shapes(_setting(args, "decode_shapes"), "--decode-shapes")
    prefill_shapes = parse_shapes(_setting(args, "prefill_shapes"), "--prefill-shapes")
    store_shapes = parse_shapes(_setting(args, "store_shapes"), "--store-shapes")
    num_heads, num_kv_heads, head_dim = _heads(args)
    iters, warmup = _setting(args, "iters"), _setting(args, "warmup")
    device = _resolve_device(args)
    if device is None:
        print("cliffguard bench kernels: needs a CUDA GPU (none is available here); "
              "run with --dry-run to check the kernels on tiny shapes on the CPU", file=sys.stderr)
        return 2
    dtype = parse_dtype(args.dtype) if args.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    backend = load_backend(args.backend, device)
    kv_dtype = None if args.kv_dtype == "auto" else kv_cache_dtype(args.kv_dtype, dtype)
    setup = Setup(device, dtype, backend, num_heads, num_kv_heads, head_dim, args.block_size,
                  args.num_splits, iters, warmup, kv_dtype, args.latent)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    note = ""
    if args.dry_run:
        path = "Triton's interpreter" if backend.name == "triton" and device.type == "cpu" else backend.source
        note = f"DRY RUN: tiny shapes on {device} through {path}; the checks count, the timings and rates do not"
    if args.backend == "auto" and backend.name == "torch":
        print(f"cliffguard bench kernels: {' / '.join(TRITON_MODULES)} not found; measuring the torch "
              "reference (kernels.reference) instead", file=sys.stderr)
    small = args.dry_run and device.type == "cpu"
    copy_bw = measure_copy_bandwidth(device, (32 << 20) if small else None)
    matmul_rate = measure_matmul_rate(device, dtype, 256 if small else None)
    flush = _l2_flush(device)

    result = {"dry_run": args.dry_run, "device": _device_name(device), "backend": backend.name,
              "source": backend.source, "dtype": str(dtype).removeprefix("torch."),
              "kv_dtype": str(kv_dtype or dtype).removeprefix("torch."), "num_heads": num_heads,
              "num_kv_heads": num_kv_heads, "head_dim": setup.head_dim, "block_size": setup.block_size,
              "latent": setup.latent, "tolerance": TOLERANCE[dtype],
              "iters": iters, "copy_gbps": copy_bw / 1e9, "matmul_tflops": matmul_rate / 1e12}
    need = [math.ceil(c / setup.block_size) * b for b, c in decode_shapes + prefill_shapes]
    num_blocks = max(need, default=1) * 5 // 4 + 1
    result["cache_blocks"] = num_blocks
    cache = _make_cache(setup, num_blocks)
    result["decode"] = [bench_decode(setup, cache, b, c, rng, copy_bw, flush) for b, c in decode_shapes]
    result["prefill"] = [bench_prefill(setup, cache, b, n, rng, matmul_rate, flush) for b, n in prefill_shapes]
    del cache
    result["store_kv"] = [bench_store(setup, b, n, rng, copy_bw, flush) for b, n in store_shapes]
    result["goals"] = _goals(result, judged=not args.dry_run)
    result["all_ok"] = all(r["ok"] for r in result["decode"] + result["prefill"] + result["store_kv"])
    if args.json:
        if note:
            print(note, file=sys.stderr)
        print(json.dumps(result, indent=2))
    else:
        from bench.kernels_report import print_report

        print_report(result, note)
    return 0 if result["all_ok"] else 1


def _goals(result: dict, *, judged: bool) -> dict:
    """Decode at DECODE_GOAL of copy bandwidth (large shapes), prefill at PREFILL_GOAL of SDPA's speed
    (prompts of at least PREFILL_GOAL_MIN_LEN tokens)."""
    large = [r["of_copy"] for r in result["decode"] if r["large"]]
    ratios = [r["ratio"] for r in result["prefill"] if r["goal"]]
    return {"judged": judged, "decode_goal": DECODE_GOAL, "large_bytes": LARGE_BYTES, "prefill_goal": PREFILL_GOAL,
            "prefill_goal_min_len": PREFILL_GOAL_MIN_LEN, "decode_min_of_copy": min(large) if large else None,
            "decode_met": bool(large) and min(large) >= DECODE_GOAL,
            "prefill_min_ratio": min(ratios) if ratios else None,
            "prefill_met": bool(ratios) and min(ratios) >= PREFILL_GOAL}


def _l2_flush(device: torch.device) -> Callable[[], object] | None:
    """Overwrites a buffer larger than any L2 cache before each timed call (CUDA only)."""
    if device.type != "cuda":
        return None
    buf = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    return buf.zero_


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"
