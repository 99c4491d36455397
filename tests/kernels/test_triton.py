"""The Triton kernels against the torch reference: on the CPU through Triton's interpreter, on CUDA
at realistic sizes (`gpu` mark).

Inputs are fresh random every run; the seed is in every assertion message (rerun one case with
`CLIFFGUARD_TEST_SEED=<seed>`). Caches are poisoned with NaN outside the written slots and outputs
with NaN before the call, so a kernel that reads a slot it should not, or leaves a row unwritten, fails.
Where head_dim is not a power of two, the cases that name a `head_pad` lay query, caches and output out
as views into rows padded with NaN up to the power of two the kernels pad to: a kernel that reads a
padded lane unmasked gets NaN, one that writes one spoils the padding.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (the gpu test's
# child process sets it to 0)

import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import kernels  # noqa: E402
import triton  # noqa: E402
from kernels import AttentionMetadata, reference  # noqa: E402
from kernels import cpu_attention, triton_attention, triton_kv_store, triton_prefill  # noqa: E402

# Explicit tolerances per dtype (atol, rtol), against the reference computed in float32. fp16/bf16
# round P to the input dtype before the PV product, and the output once more.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1.5e-3, 1.5e-3),
    torch.bfloat16: (1.5e-2, 1.5e-2),
}


def _make_seed() -> int:
    forced = os.environ.get("CLIFFGUARD_TEST_SEED")
    return int(forced) if forced else random.SystemRandom().randrange(2**31)


def _make_tables(seq_lens, block_size, rng, spare=3):
    """Block tables over shuffled block ids, with `spare` blocks no sequence owns."""
    counts = [-(-s // block_size) for s in seq_lens]
    ids = list(range(sum(counts) + spare))
    rng.shuffle(ids)
    tables, pos = [], 0
    for n in counts:
        tables.append(ids[pos:pos + n])
        pos += n
    return tables, len(ids)


def _make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, num_layers=2, head_pad=0):
    """NaN-poisoned [L, 2, blocks, block_size, kv_heads, head_dim + head_pad] and the strided views of its
    last layer, [blocks, block_size, kv_heads, head_dim] each."""
    data = torch.full((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim + head_pad), float("nan"),
                      dtype=dtype, device=device)
    return data, data[-1, 0, ..., :head_dim], data[-1, 1, ..., :head_dim]


def _head_pad(head_dim: int) -> int:
    """How far the kernels pad head_dim (0 for a power of two >= 16): the NaN lanes a case lays beside each
    head to catch a padded lane read or written unmasked."""
    return triton_prefill.padded_head_dim(head_dim) - head_dim


def _make_attention_case(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                         seed, device="cpu", head_pad=0):
    """A step: every sequence's K/V stored (prefix and new tokens), queries for the new tokens. With
    `head_pad`, query and caches are views into rows of head_dim + head_pad, the rest NaN."""
    rng = random.Random(seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tables, num_blocks = _make_tables(seq_lens, block_size, rng)
    data, k_cache, v_cache = _make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                                         head_pad=head_pad)
    total = sum(seq_lens)
    keys = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    values = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    everything = AttentionMetadata.build(tables, seq_lens, seq_lens, block_size, device)
    reference.store_kv(keys, values, k_cache, v_cache, everything)
    meta = AttentionMetadata.build(tables, query_lens, seq_lens, block_size, device)
    query = torch.full((sum(query_lens), num_heads, head_dim + head_pad), float("nan"), dtype=dtype,
                       device=device)[..., :head_dim]
    query.copy_(torch.randn(sum(query_lens), num_heads, head_dim, generator=gen))
    return query, k_cache, v_cache, meta


def _reference_attention(query, k_cache, v_cache, meta, scale, sliding_window):
    """The torch reference in float32, on a fresh copy of the metadata (its plan cache is its own)."""
    fresh = AttentionMetadata(meta.slot_mapping, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                              meta.block_size, meta.query_lens_list, meta.seq_lens_list)
    return reference.paged_attention(query.float(), k_cache.float().contiguous(), v_cache.float().contiguous(),
                                     fresh, scale, sliding_window)


def _assert_attention_matches(backend, case, seed, sliding_window=None, num_splits=None, label=""):
    query, k_cache, v_cache, meta = case
    head_dim = query.shape[-1]
    scale = head_dim ** -0.5
    # out: laid out as query is, in rows of query.stride(1) >= head_dim (the rest NaN, and left so)
    out_rows = torch.full((*query.shape[:2], query.stride(1)), float("nan"), dtype=query.dtype, device=query.device)
    out = out_rows[..., :head_dim]
    got = backend.paged_attention(query, k_cache, v_cache, meta, scale, sliding_window,
                                  num_splits=num_splits, out=out)
    assert got is out
    want = _reference_attention(query, k_cache, v_cache, meta, scale, sliding_window)
    where = f"seed={seed} {label} window={sliding_window} splits={num_splits}"
    assert not out.isnan().any(), f"{where}: output rows left unwritten (NaN) at " \
                                  f"{out.isnan().nonzero()[:4].tolist()}"
    assert out_rows[..., head_dim:].isnan().all(), f"{where}: written past head_dim {head_dim}"
    atol, rtol = TOLERANCES[query.dtype]
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol, msg=lambda m: f"{where}\n{m}")


def _mixed_batch(block_size):
    """(seq_lens, query_lens) mixing decode rows (short and long contexts), a prefill chunk that starts
    mid-block over a cached prefix, a whole prompt, a length-1 prompt, a sequence with no new token,
    and partial last blocks."""
    b = block_size
    seq_lens = [3 * b + 5, 1, 2 * b + 9, 5, 2 * b, 7 * b + 3, 1, 9]
    query_lens = [1, 1, b + 2, 5, 3, 1, 1, 0]
    return seq_lens, query_lens


# --- store_kv ---------------------------------------------------------------------------------

def _assert_store_kv_matches(store_kv, seq_lens, query_lens, dtype, src_dtype, block_size, num_kv_heads, head_dim,
                             num_skipped, seed, device="cpu"):
    """`store_kv` against the reference: strided key/value (a fused projection's slices) into strided,
    NaN-poisoned caches, `num_skipped` random tokens (the first among them) with slot -1."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = _make_tables(seq_lens, block_size, rng)
    meta = AttentionMetadata.build(tables, query_lens, seq_lens, block_size, device)
    num_tokens = meta.num_tokens
    skip = [0] + rng.sample(range(1, num_tokens), num_skipped - 1)
    meta.slot_mapping[skip] = -1
    meta.has_invalid_slots = True
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to(device, src_dtype)
    key, value = fused[:, 1], fused[:, 2]
    got_data, got_k, got_v = _make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    want_data, want_k, want_v = _make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    store_kv(key, value, got_k, got_v, meta)
    reference.store_kv(key, value, want_k, want_v, meta)
    # every written slot matches, and nothing else in the tensor (other layer, skipped slots) changed
    assert torch.equal(got_data.isnan(), want_data.isnan()), f"seed={seed}: wrong set of slots written"
    assert torch.equal(got_data.nan_to_num(), want_data.nan_to_num()), f"seed={seed}: stored values differ"
    assert int((~got_data.isnan()).sum()) == 2 * (num_tokens - num_skipped) * num_kv_heads * head_dim, \
        f"seed={seed}: wrong number of values written"


# fp32 -> fp16 is converted in the kernel; fp32 -> bf16 is not tested on the CPU: the interpreter
# truncates where the GPU (and torch) round to nearest even. head_dim 40 and 96: not powers of two,
# padded in the kernel (the lanes past head_dim must not be written: the next head's values are there).
@pytest.mark.parametrize("dtype,src_dtype,block_size,num_kv_heads,head_dim", [
    (torch.float32, torch.float32, 8, 1, 64),
    (torch.float16, torch.float32, 16, 3, 128),
    (torch.bfloat16, torch.bfloat16, 32, 2, 64),
    (torch.float16, torch.float32, 8, 3, 40),
    (torch.bfloat16, torch.bfloat16, 16, 2, 96),
])
def test_store_kv_matches_reference(dtype, src_dtype, block_size, num_kv_heads, head_dim):
    seed = _make_seed()
    _assert_store_kv_matches(triton_kv_store.store_kv, [block_size + 3, 2, 2 * block_size], [block_size + 3, 1, 5],
                             dtype, src_dtype, block_size, num_kv_heads, head_dim, 4, seed)


def test_store_kv_with_no_tokens_is_a_no_op():
    _, k_cache, v_cache = _make_cache(2, 8, 2, 64, torch.float16, "cpu")
    meta = AttentionMetadata.build([], [], [], 8)
    empty = torch.empty(0, 2, 64, dtype=torch.float16)
    triton_kv_store.store_kv(empty, empty, k_cache, v_cache, meta)
    assert k_cache.isnan().all() and v_cache.isnan().all()


def test_store_kv_rejects_mismatched_shapes():
    _, k_cache, v_cache = _make_cache(2, 8, 2, 64, torch.float32, "cpu")
    meta = AttentionMetadata.build([[0]], [1], [1], 8)
    with pytest.raises(AssertionError, match="do not fit"):
        triton_kv_store.store_kv(torch.zeros(1, 3, 64), torch.zeros(1, 3, 64), k_cache, v_cache, meta)


# --- paged_attention --------------------------------------------------------------------------

# Every GQA ratio (1, 3, 8), head dim (64, 128; 40, 96 and 8, padded in the kernels to 64, 128 and 16),
# block size (8, 16, 32) and dtype at least once, with and without a sliding window, single pass and
# forced split-K, each on a mixed prefill + decode batch.
@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size,sliding_window,num_splits", [
    (torch.float32, 2, 2, 64, 8, None, None),
    (torch.float16, 6, 2, 128, 16, None, 3),
    (torch.bfloat16, 8, 1, 64, 32, 7, None),
    (torch.float32, 6, 2, 64, 32, 70, 4),
    (torch.float16, 8, 1, 128, 8, None, None),
    (torch.bfloat16, 2, 2, 128, 16, 20, 2),
    (torch.float16, 6, 2, 40, 16, None, None),
    (torch.float32, 3, 1, 96, 8, 30, 3),
    (torch.bfloat16, 2, 1, 96, 32, None, 2),
    (torch.float32, 2, 2, 8, 8, None, 2),
])
def test_paged_attention_mixed_batch_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size,
                                                       sliding_window, num_splits):
    seed = _make_seed()
    seq_lens, query_lens = _mixed_batch(block_size)
    case = _make_attention_case(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed,
                                head_pad=_head_pad(head_dim))
    _assert_attention_matches(triton_attention, case, seed, sliding_window, num_splits,
                              label=f"{dtype} heads={num_heads}/{num_kv_heads} d={head_dim} bs={block_size}")


@pytest.mark.parametrize("num_splits,head_dim", [(1, 64), (3, 64), (8, 64), (1, 80), (3, 80)])
def test_paged_attention_decode_split_k_matches_reference(num_splits, head_dim):
    """Decode only (the flash-decoding path: small query tiles), long contexts split into segments,
    some of which are empty for the short sequences; head_dim 80 pads to 128 in the paged kernel and
    in the reduce of the split partials."""
    seed = _make_seed()
    rng = random.Random(seed)
    seq_lens = [rng.randint(150, 300), rng.randint(1, 20), rng.randint(60, 140)]
    case = _make_attention_case(seq_lens, [1, 1, 1], 6, 2, head_dim, 16, torch.float16, seed,
                                head_pad=_head_pad(head_dim))
    _assert_attention_matches(triton_attention, case, seed, num_splits=num_splits,
                              label=f"d={head_dim} lens={seq_lens}")


def test_paged_attention_random_steps_match_reference():
    """A few random steps (shapes, dtype, batch, window, splits all drawn from the seed): each run
    covers other corners."""
    seed = _make_seed()
    rng = random.Random(seed)
    for _ in range(3):
        dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
        num_kv_heads, group = rng.choice([1, 2]), rng.choice([1, 2, 3, 5, 8])
        head_dim, block_size = rng.choice([16, 64, 128, 40, 72, 96]), rng.choice([8, 16, 32])
        seq_lens = [rng.randint(1, 130) for _ in range(rng.randint(1, 5))]
        query_lens = [rng.choice([1, 1, rng.randint(0, s)]) for s in seq_lens]
        window = rng.choice([None, rng.randint(1, 80)])
        splits = rng.choice([None, rng.randint(2, 6)])
        case = _make_attention_case(seq_lens, query_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size,
                                    dtype, rng.randrange(2**31))
        _assert_attention_matches(triton_attention, case, seed, window, splits,
                                  label=f"{dtype} heads={num_kv_heads * group}/{num_kv_heads} d={head_dim} "
                                        f"bs={block_size} seq_lens={seq_lens} query_lens={query_lens}")


def test_paged_attention_decode_split_k_with_sliding_window():
    seed = _make_seed()
    case = _make_attention_case([260, 33], [1, 1], 4, 4, 64, 16, torch.float32, seed)
    _assert_attention_matches(triton_attention, case, seed, sliding_window=90, num_splits=3)


def test_paged_attention_long_prefill_chunk_over_several_tiles():
    """A chunk longer than a query tile, starting mid-block, over a cached prefix of several KV tiles."""
    seed = _make_seed()
    case = _make_attention_case([150, 1], [77, 1], 4, 2, 64, 16, torch.bfloat16, seed)
    _assert_attention_matches(triton_attention, case, seed, label="prefill 77 of 150")
    _assert_attention_matches(triton_attention, case, seed, sliding_window=40, label="prefill 77 of 150")


def test_paged_attention_single_token_and_empty_step():
    seed = _make_seed()
    one = _make_attention_case([1], [1], 3, 1, 64, 8, torch.float32, seed)
    _assert_attention_matches(triton_attention, one, seed, label="one token")
    _assert_attention_matches(triton_attention, one, seed, num_splits=2, label="one token")
    _, k_cache, v_cache = _make_cache(2, 8, 1, 64, torch.float32, "cpu")
    meta = AttentionMetadata.build([], [], [], 8)
    out = triton_attention.paged_attention(torch.empty(0, 3, 64), k_cache, v_cache, meta, 0.125)
    assert out.shape == (0, 3, 64)


def test_paged_attention_builds_the_step_plan_once_for_all_layers():
    seed = _make_seed()
    query, k_cache, v_cache, meta = _make_attention_case([20, 9], [1, 9], 4, 2, 64, 8, torch.float32, seed)
    first = triton_attention.paged_attention(query, k_cache, v_cache, meta, 0.125)
    plan = meta.backend_cache["triton"]
    tiles = {key: value for key, value in plan.items() if isinstance(key, tuple) and key[0] == "tiles"}
    second = triton_attention.paged_attention(query, k_cache, v_cache, meta, 0.125)
    assert meta.backend_cache["triton"] is plan
    for key, value in tiles.items():
        assert plan[key] is value
    torch.testing.assert_close(first, second, atol=0, rtol=0)


def test_choose_num_splits(monkeypatch):
    monkeypatch.setattr(triton_attention, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda", 0)
    choose = triton_attention.choose_num_splits
    assert choose(4 * 8, 100_000, torch.device("cpu")) == 1                # nothing to fill on the CPU
    assert choose(4 * 8, 32_000, cuda) == 9                                 # 4 decodes x 8 KV heads: 264 / 32
    assert choose(1 * 8, 32_000, cuda) == 33                                # one long decode
    assert choose(1 * 8, 1_000, cuda) == 3                                  # segments stay >= MIN_SPLIT_LEN
    assert choose(1 * 8, 400, cuda) == 1                                    # too short to split
    assert choose(200 * 8, 32_000, cuda) == 1                               # the grid fills the GPU already
    assert choose(1, 10**7, cuda) == triton_attention.MAX_SPLITS


# --- dispatch ---------------------------------------------------------------------------------

def test_get_backend_choice_and_override(monkeypatch):
    monkeypatch.delenv("CLIFFGUARD_ATTENTION_BACKEND", raising=False)
    assert kernels.get_backend("cpu") is cpu_attention
    assert kernels.get_backend("meta") is reference
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", "triton")
    backend = kernels.get_backend("cpu")                                    # through the interpreter
    assert backend is triton_attention
    assert backend.store_kv is triton_kv_store.store_kv
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", "torch")
    assert kernels.get_backend("cpu") is reference
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", "cuda-graphs")
    with pytest.raises(ValueError, match="unknown backend 'cuda-graphs'"):
        kernels.get_backend("cpu")


def test_get_backend_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", "triton")
    monkeypatch.setattr(triton_attention, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.get_backend("cpu")


def test_launch_variants_cover_every_step_and_compile_kernels_runs_them(monkeypatch):
    """What `compile_kernels` launches before serving is every variant a step can compile: each
    `_launch_config` any query length of the paged kernel gives, unsplit and split, the reduce kernel's
    every pad, and one chunk long enough for the prefill kernel (one variant per attention shape)."""
    longest = triton_attention.PREFILL_MIN_QUERY_LEN - 1
    for num_kv_heads, group, head_dim, size in [(8, 4, 128, 2), (3, 3, 64, 2), (2, 1, 64, 4), (1, 8, 128, 4),
                                                (4, 16, 64, 2), (32, 1, 96, 2), (2, 4, 80, 4), (4, 2, 192, 2)]:
        variants = triton_attention.launch_variants(group * num_kv_heads, num_kv_heads, head_dim, size)
        paged = [(q, s) for q, s in variants if q <= longest]
        configs = {triton_attention._launch_config(group, q, head_dim, size) for q, _ in paged}
        for split in (1, 2):
            assert configs == {triton_attention._launch_config(group, q, head_dim, size)
                               for q, s in paged if s == split}
        assert all(triton_attention._launch_config(group, q, head_dim, size) in configs
                   for q in range(1, longest + 1))
        assert [v for v in variants if v not in paged] == [(longest + 1, 1)]
        pads = {triton.next_power_of_2(s) for _, s in variants if s > 1}
        assert {triton.next_power_of_2(n) for n in range(2, triton_attention.MAX_SPLITS + 1)} <= pads
    # under the interpreter, on a small shape (and at most 4 splits: 256 cached positions)
    monkeypatch.setattr(triton_attention, "MAX_SPLITS", 4)
    launched = []
    real = triton_attention.paged_attention

    def paged_attention(query, *args, num_splits=None, **kwargs):
        launched.append((query.shape[0], num_splits))
        return real(query, *args, num_splits=num_splits, **kwargs)

    monkeypatch.setattr(triton_attention, "paged_attention", paged_attention)
    count = triton_attention.compile_kernels(4, 2, 16, 16, torch.float32, torch.device("cpu"))
    assert launched == triton_attention.launch_variants(4, 2, 16, 4) and count == len(launched) == 8


class _LaunchKeys:
    """Stands in for the four kernels and records each launch's compile key as Triton forms it (every
    argument's specialization, the constexprs, the launch options) without running anything; the
    attention outputs are zeroed so callers see finite rows."""

    def __init__(self, monkeypatch, specialize):
        self.specialize, self.keys, self.phase = specialize, {}, "compile"
        self.launched: dict[str, set[str]] = {"compile": set(), "step": set()}   # kernel names by phase
        for module, name in [(triton_attention, "_paged_attention_kernel"),
                             (triton_attention, "_reduce_splits_kernel"), (triton_kv_store, "_store_kv_kernel"),
                             (triton_prefill, "_prefill_attention_kernel")]:
            kernel = getattr(module, name)
            monkeypatch.setattr(module, name, _KeyRecorder(self, name, kernel.fn,
                                                           kernel.kwargs.get("do_not_specialize") or ()))


class _KeyRecorder:
    def __init__(self, keys: _LaunchKeys, name, fn, do_not_specialize):
        import inspect

        self.keys, self.name, self.dns, self.signature = keys, name, set(do_not_specialize), inspect.signature(fn)

    def __getitem__(self, grid):
        def launch(*args, num_warps=4, num_stages=None, **kwargs):
            bound = self.signature.bind(*args, **kwargs).arguments
            key = [self.name, num_warps, num_stages]
            for param in self.signature.parameters.values():
                arg = bound[param.name]
                if "constexpr" in str(param.annotation):
                    key.append((param.name, str(arg)))
                else:
                    key.append((param.name, self.keys.specialize(arg, param.name not in self.dns)))
            self.keys.keys.setdefault(tuple(key), self.keys.phase)
            self.keys.launched[self.keys.phase].add(self.name)
            if self.name != "_store_kv_kernel":
                args[3].zero_()
        return launch


@pytest.mark.parametrize("window,head_dim", [(None, 64), (1024, 64), (None, 80)])
def test_every_launch_a_step_makes_is_a_variant_compile_kernels_compiled(monkeypatch, window, head_dim):
    """Each launch of steps of any shape (decodes and chunks of any mix, short chunks in the paged kernel
    and long ones in the prefill kernel, split or not, a query and K/V sliced out of one fused projection
    as the model does) has the compile key of a launch that `compile_kernels` made, so no step compiles
    while serving, at head_dim 80 too (padded to 128 in the kernels). On a GPU an odd tile count left the
    tiles' second row 4 bytes off 16-byte alignment, and Triton compiled that pointer's variant anew."""
    jit = pytest.importorskip("triton.runtime.jit")
    compiler = pytest.importorskip("triton.backends.compiler")
    if not hasattr(jit, "native_specialize_impl"):
        pytest.skip("this Triton forms its compile keys elsewhere")
    keys = _LaunchKeys(monkeypatch, lambda arg, specialize: jit.native_specialize_impl(
        compiler.BaseBackend, arg, False, specialize, True))
    num_heads, num_kv_heads, block_size = 9, 3, 16                      # the builtin model's attention
    triton_attention.compile_kernels(num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16,
                                     torch.device("cpu"), window)
    keys.phase = "step"
    rng = random.Random(_make_seed())
    width = (num_heads + 2 * num_kv_heads) * head_dim
    cache = torch.zeros(2, 4096, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16)
    for _ in range(60):
        query_lens = [rng.choice([1, 1, 1, rng.randint(2, 70), rng.randint(70, 700)])
                      for _ in range(rng.randint(1, 40))]
        seq_lens = [q + rng.randint(0, 3000) for q in query_lens]
        tables = [rng.sample(range(4096), -(-n // block_size)) for n in seq_lens]
        meta = AttentionMetadata.build(tables, query_lens, seq_lens, block_size)
        qkv = torch.zeros(sum(query_lens), width, dtype=torch.bfloat16)
        query = qkv[:, :num_heads * head_dim].view(-1, num_heads, head_dim)
        key = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(-1, num_kv_heads, head_dim)
        value = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(-1, num_kv_heads, head_dim)
        triton_attention.store_kv(key, value, cache[0], cache[1], meta)
        triton_attention.paged_attention(query, cache[0], cache[1], meta, 0.125, window,
                                         num_splits=rng.choice([None, 1, 2, 3, 5, 8, 17, 64]))
    assert keys.launched["step"] == keys.launched["compile"] == {
        "_paged_attention_kernel", "_reduce_splits_kernel", "_store_kv_kernel", "_prefill_attention_kernel"}
    new = [key for key, phase in keys.keys.items() if phase == "step"]
    assert not new, f"{len(new)} launch keys no compile_kernels launch had, e.g. {new[0]}"
    assert sum(phase == "compile" for phase in keys.keys.values()) >= len(triton_attention.launch_variants(
        num_heads, num_kv_heads, head_dim, 2))


def test_the_runner_compiles_kernels_on_cuda_only():
    from types import SimpleNamespace

    from engine.model_runner import _Forward

    calls = []
    attn = SimpleNamespace(num_heads=6, num_kv_heads=2, sliding_window=None,
                           config=SimpleNamespace(head_dim=64, sliding_window=None))
    runner = SimpleNamespace(model=SimpleNamespace(layers=[SimpleNamespace(self_attn=attn)]),
                             kv_cache=SimpleNamespace(block_size=16, dtype=torch.bfloat16),
                             backend=SimpleNamespace(compile_kernels=lambda *a: calls.append(a) or 11),
                             device=torch.device("cpu"))
    _Forward.compile_kernels(runner)
    assert calls == []                                      # the CPU runs the torch reference or the interpreter
    runner.device = torch.device("cuda", 0)
    _Forward.compile_kernels(runner)
    assert calls == [(6, 2, 64, 16, torch.bfloat16, torch.device("cuda", 0), None)]
    runner.backend = reference                              # a backend with nothing to compile
    _Forward.compile_kernels(runner)
    assert len(calls) == 1


# --- CUDA, realistic sizes ----------------------------------------------------------------------

def _check_gpu_kernels(dtype_name: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    """The body of the gpu test. It runs in a process started with TRITON_INTERPRET=0: once Triton's
    interpreter has been on in a process it has patched `triton.language` there, and kernels compiled
    afterwards in that process fail to build (seen with Triton 3.6 on an H100, 2026-11-23)."""
    assert not triton_attention.INTERPRETED, "the compiled check ran under Triton's interpreter"
    dtype = getattr(torch, dtype_name)
    seed = _make_seed()
    # store_kv: a step of 3000 tokens, some slots -1
    _assert_store_kv_matches(triton_kv_store.store_kv, [2048, 900, 52], [2048, 900, 52], dtype, dtype, block_size,
                             num_kv_heads, head_dim, 400, seed, "cuda")
    torch.cuda.synchronize()

    # every variant compiled before the steps below (with and without a window): none compiles during them
    for window in (None, 1024):
        triton_attention.compile_kernels(num_heads, num_kv_heads, head_dim, block_size, dtype, torch.device("cuda"),
                                         window)
    compiled = triton_attention.compiled_variants()

    # decode-only (split-K chosen by the heuristic, and forced), then a mixed step with a long chunk
    decode = ([4096, 3000, 8191, 17], [1, 1, 1, 1])
    mixed = ([4096, 1500, 8191, 1, 700] + [1000] * 20, [1, 511, 1, 1, 700] + [1] * 20)
    for (lens, q_lens), window, splits in [(decode, None, None), (decode, None, 1), (decode, 1024, None),
                                           (mixed, None, None), (mixed, 4096, None), (mixed, None, 7)]:
        case = _make_attention_case(lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed,
                                    device="cuda")
        _assert_attention_matches(triton_attention, case, seed, window, splits,
                                  label=f"{dtype} {num_heads}/{num_kv_heads} d={head_dim} bs={block_size} "
                                        f"lens={lens[:5]}")
        if lens is decode[0] and splits is None:   # the heuristic chose flash-decoding for 4 long decodes
            plan = case[3].backend_cache["triton"]
            assert max(v for k, v in plan.items() if isinstance(k, tuple) and k[0] == "num_splits") > 1
    if compiled is not None:
        new = triton_attention.compiled_variants() - compiled
        assert not new, f"{len(new)} variants compiled after compile_kernels:\n" + "\n".join(sorted(new))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(32, 8, 128, 16), (24, 8, 64, 32),
                                                                      (32, 32, 96, 16)])
def test_gpu_kernels_match_reference_at_realistic_sizes(dtype, num_heads, num_kv_heads, head_dim, block_size):
    code = (f"from tests.kernels.test_triton import _check_gpu_kernels; "
            f"_check_gpu_kernels({dtype!r}, {num_heads}, {num_kv_heads}, {head_dim}, {block_size})")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
