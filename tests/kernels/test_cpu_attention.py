"""The CPU backend's C decode kernel against the dense yardstick (`reference.dense_causal_attention`) and
the torch reference, on fresh random steps: the seed is in every message (`CLIFFGUARD_TEST_SEED=<seed>`
reruns one). Every cache slot no sequence wrote is NaN and so is every output row before the call, so a
kernel that reads past a sequence or leaves a row unwritten fails."""

from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch

import kernels
from kernels import AttentionMetadata, cpu_attention, reference
from kernels.cpu_build import load_c_library

TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2)}

pytestmark = pytest.mark.skipif(cpu_attention.load_library() is None, reason="no C compiler on this machine")


def _seed() -> int:
    forced = os.environ.get("CLIFFGUARD_TEST_SEED")
    return int(forced) if forced else random.SystemRandom().randrange(2**31)


def _make_step(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """A step over shuffled blocks (some owned by nobody): each sequence's K/V written, the rest NaN.
    Returns the query, the caches, the metadata and each sequence's dense (keys, values)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-s // block_size) for s in seq_lens]
    ids = list(range(sum(counts) + 3))
    rng.shuffle(ids)
    tables, pos = [], 0
    for n in counts:
        tables.append(ids[pos:pos + n])
        pos += n
    cache = torch.full((2, len(ids), block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    dense = [(torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype),
              torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)) for s in seq_lens]
    for table, (k, v) in zip(tables, dense):
        for p in range(k.shape[0]):
            cache[0, table[p // block_size], p % block_size] = k[p]
            cache[1, table[p // block_size], p % block_size] = v[p]
    meta = AttentionMetadata.build(tables, query_lens, seq_lens, block_size)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    return query, cache[0], cache[1], meta, dense


def _assert_matches_dense(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                          window=None, strided=False, chunk=None):
    seed = _seed()
    query, k_cache, v_cache, meta, dense = _make_step(seq_lens, query_lens, num_heads, num_kv_heads, head_dim,
                                                      block_size, dtype, seed)
    if strided:   # the query as the model has it: the first heads of a fused q/k/v projection's rows
        fused = torch.full((query.shape[0], num_heads + 2 * num_kv_heads, head_dim), float("nan"), dtype=dtype)
        fused[:, :num_heads] = query
        query = fused[:, :num_heads]
    scale = head_dim ** -0.5
    out = cpu_attention.paged_attention(query, k_cache, v_cache, meta, scale, window, chunk=chunk)
    where = f"seed={seed} lens={seq_lens} queries={query_lens} heads={num_heads}/{num_kv_heads} d={head_dim} " \
            f"block={block_size} {dtype} window={window} chunk={chunk}"
    assert not out.isnan().any(), f"{where}: NaN in the output (a poisoned slot read, or a row unwritten)"
    atol, rtol = TOLERANCES[dtype]
    start = 0
    for (k, v), q_len in zip(dense, query_lens):
        want = reference.dense_causal_attention(query[start:start + q_len].float(), k.float(), v.float(), scale,
                                                window, chunk=chunk)
        torch.testing.assert_close(out[start:start + q_len].float(), want, atol=atol, rtol=rtol,
                                   msg=lambda m: f"{where}\n{m}")
        start += q_len


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 16), (4, 2, 16), (8, 1, 64), (12, 4, 128)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_tokens_match_dense_attention(num_heads, num_kv_heads, head_dim, block_size):
    b = block_size
    seq_lens = [1, 5, b, b + 1, 3 * b + 7, 9 * b + 2]
    _assert_matches_dense(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim, block_size, torch.float32)


def test_a_query_of_strided_tokens():
    _assert_matches_dense([9, 40, 1, 77], [1, 1, 1, 1], 8, 2, 32, 16, torch.float32, strided=True)


@pytest.mark.parametrize("window", [1, 7, 40])
def test_sliding_window(window):
    _assert_matches_dense([3, 20, 41, 130], [1, 1, 1, 1], 4, 2, 32, 16, torch.float32, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 8, 16, 50, 1000])
def test_chunked_attention_by_the_kernel(chunk, dtype, monkeypatch):
    """Llama 4's chunked attention in the C kernel (its window argument -chunk): rows at a chunk's first
    position (one key), its last, past several chunks; the kernel, not the reference, ran them."""
    def refused(*args, **kwargs):
        raise AssertionError("the decode rows went to the reference")

    monkeypatch.setattr(cpu_attention, "reference_decode_attention", refused)
    _assert_matches_dense([1, 16, 17, 41, 130, 200], [1] * 6, 6, 2, 32, 8, dtype, chunk=chunk, strided=True)


def test_bfloat16_cache():
    _assert_matches_dense([2, 33, 90], [1, 1, 1], 8, 2, 64, 16, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256, 4, 20, 80, 264])
def test_head_dims_compiled_as_constants_and_the_generic_path(head_dim, dtype):
    """The head_dims the kernel specialises and others: a scalar tail past a multiple of 8 (20), only a tail
    (4), bfloat16 rows too long to be widened once for all heads (264); lengths ending mid-block, over
    several tiles."""
    _assert_matches_dense([1, 7, 45, 130], [1] * 4, 6, 2, head_dim, 16, dtype)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(5, 5), (4, 2), (6, 2), (8, 2), (10, 2), (24, 2), (40, 8),
                                                   (36, 1)])
def test_gqa_groups_of_every_size(num_heads, num_kv_heads):
    """GQA groups whose V sums take 1, 2, 3, 4 and 8 heads at a time (5 = 4 + 1, 12 = 8 + 4), and more heads
    than one pass over the rows takes (32): a group split between two passes."""
    _assert_matches_dense([3, 50, 97], [1] * 3, num_heads, num_kv_heads, 32, 8, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_sequences_long_and_short_rows(dtype):
    """Rows of 4 KiB (32 heads of 128 over 8 KV heads: tiles of 8 positions, the next one prefetched), short
    rows (tiles of 64 positions across blocks of 8), sequences ending mid-block."""
    _assert_matches_dense([1, 300, 1029], [1] * 3, 32, 8, 128, 16, dtype)
    _assert_matches_dense([700, 1, 66], [1] * 3, 4, 2, 16, 8, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 20])
@pytest.mark.parametrize("window", [1, 5, 64, 100])
def test_sliding_window_specialised_and_generic(window, head_dim, dtype):
    _assert_matches_dense([3, 70, 201], [1] * 3, 9, 3, head_dim, 16, dtype, window, strided=True)


def test_a_head_dim_past_the_stack_scratch():
    """head_dim over 4096 floats: one head at a time, the scratch allocated."""
    _assert_matches_dense([5, 20], [1, 1], 2, 1, 4104, 16, torch.float32)


def test_mixed_step_decode_by_the_kernel_prefill_by_the_reference(monkeypatch):
    """Decode rows through the C kernel, prefill chunks (over a cached prefix, mid-block) through the
    reference, in one call; and the kernel is what ran the decode rows."""
    calls = []
    real = cpu_attention.decode_attention
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *a: calls.append(1) or real(*a))
    _assert_matches_dense([40, 17, 1, 70, 9], [1, 5, 1, 30, 0], 4, 2, 16, 16, torch.float32)
    assert calls == [1]


def test_without_a_compiler_or_for_another_dtype_the_reference_runs(monkeypatch):
    seed = _seed()
    query, k_cache, v_cache, meta, _ = _make_step([12, 30], [1, 1], 4, 2, 16, 8, torch.float16, seed)
    assert not cpu_attention.decode_attention(query, k_cache, v_cache, meta, 0.25, None, torch.empty_like(query))
    want = reference.paged_attention(query, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(cpu_attention.paged_attention(query, k_cache, v_cache, meta, 0.25), want)
    monkeypatch.setattr(cpu_attention, "load_library", lambda: None)
    query, k_cache, v_cache, meta, _ = _make_step([12, 30], [1, 1], 4, 2, 16, 8, torch.float32, seed)
    assert not cpu_attention.decode_attention(query, k_cache, v_cache, meta, 0.25, None, torch.empty_like(query))


def test_a_compiled_kernel_is_cached_by_its_source(tmp_path, monkeypatch):
    """The cache's rules on a one-line C file (the attention kernel itself takes seconds to compile)."""
    import tempfile

    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    monkeypatch.setenv("CLIFFGUARD_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "a-file"))   # no fallback folder: a file's place
    (tmp_path / "a-file").write_text("")
    library = load_c_library(source, ["-O1"], {"one": []})
    assert library is not None and library.one() == 1
    (built,) = (tmp_path / "cache").glob("one-*.so")
    monkeypatch.setenv("CC", "/nonexistent/cc")      # a cached build needs no compiler
    assert load_c_library(source, ["-O1"], {"one": []}).one() == 1
    assert list((tmp_path / "cache").glob("*.so")) == [built]
    assert load_c_library(source, ["-O2"], {"one": []}) is None   # other flags: another build, and no compiler
    source.write_text("int one(void) { return 2; }\n")
    assert load_c_library(source, ["-O1"], {"one": []}) is None   # another source: the same
    monkeypatch.delenv("CC")
    assert load_c_library(source, ["-O1"], {"one": []}).one() == 2
    (built,) = [p for p in (tmp_path / "cache").glob("one-*.so") if p != built]
    assert built.stat().st_mode & 0o777 == 0o755   # whatever the umask: no other user may write what is loaded



def test_a_build_that_cannot_be_kept_or_loaded_where_it_is_cached_is_made_elsewhere(tmp_path, monkeypatch):
    """A cached library cut short (or another machine's) raised out of ctypes and the worker did not start; a
    cache folder that cannot be written, or whose libraries cannot be mapped (a `noexec` mount), left every
    C kernel off (a decode 8x slower). The build is made again, in the temporary folder where it must."""
    import tempfile

    from kernels import cpu_build

    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("CLIFFGUARD_KERNEL_CACHE", str(tmp_path / "first"))
    assert load_c_library(source, ["-O1"], {"one": []}).one() == 1
    (first,) = (tmp_path / "first").glob("one-*.so")   # (a file a process has loaded is never overwritten)
    (tmp_path / "cache").mkdir()
    built = tmp_path / "cache" / first.name
    built.write_bytes(b"\x7fELF cut short")
    monkeypatch.setenv("CLIFFGUARD_KERNEL_CACHE", str(tmp_path / "cache"))
    assert load_c_library(source, ["-O1"], {"one": []}).one() == 1               # built in the temporary folder
    assert len(list((tmp_path / "tmp").glob("cliffguard-kernels-*/one-*.so"))) == 1
    assert load_c_library(source, ["-O1"], {"one": [], "two": []}) is None       # a function it lacks: None
    source.write_text("int one(void) { return 3; }\n")
    load = cpu_build._load
    monkeypatch.setattr(cpu_build, "_load", lambda path, *args: None if path.parent == tmp_path / "cache"
                        else load(path, *args))                                  # a noexec cache folder
    assert load_c_library(source, ["-O1"], {"one": []}).one() == 3
    assert len(list((tmp_path / "tmp").glob("cliffguard-kernels-*/one-*.so"))) == 2
    monkeypatch.undo()
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp2"))
    (tmp_path / "tmp2").mkdir()
    monkeypatch.setenv("CLIFFGUARD_KERNEL_CACHE", str(tmp_path / "a-file" / "kernels"))
    assert load_c_library(source, ["-O1"], {"one": []}).one() == 3               # a folder that cannot be made
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "a-file"))
    assert load_c_library(source, ["-O2"], {"one": []}) is None                  # nor the temporary one: None



def test_a_compiler_that_leaves_a_child_behind_is_not_waited_for(tmp_path, monkeypatch):
    """A compiler wrapper that leaves a process behind holding its stderr (a compile server, ccache's): reading
    the output to its end waited for that process, a good build reported failed past COMPILE_SECONDS."""
    import shutil
    import tempfile
    import time

    from kernels import cpu_build

    wrapper = tmp_path / "cc"
    wrapper.write_text(f"#!/bin/sh\n(sleep 12 &)\nexec {shutil.which('cc')} \"$@\"\n")
    wrapper.chmod(0o755)
    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    monkeypatch.setattr(cpu_build, "COMPILE_SECONDS", 10.0)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("CLIFFGUARD_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("")
    began = time.monotonic()
    assert load_c_library(source, ["-O1"], {"one": []}).one() == 1
    assert time.monotonic() - began < 8


def test_a_library_another_user_could_have_written_is_never_loaded(tmp_path, monkeypatch):
    """Loading runs a library's code as us: one in the cache that is another user's, that others may write, or
    a symbolic link (all of which another user could have left in a folder they may write) is made again, ours."""
    import shutil
    import tempfile

    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    theirs = tmp_path / "theirs.c"
    theirs.write_text("int one(void) { return 666; }\n")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "a-file"))   # no fallback folder
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("CLIFFGUARD_KERNEL_CACHE", str(tmp_path / "planted"))
    assert load_c_library(theirs, ["-O1"], {"one": []}).one() == 666
    (planted,) = (tmp_path / "planted").glob("theirs-*.so")
    monkeypatch.setenv("CLIFFGUARD_KERNEL_CACHE", str(tmp_path / "cache"))
    assert load_c_library(source, ["-O1"], {"one": []}).one() == 1
    (ours,) = (tmp_path / "cache").glob("one-*.so")
    for plant in ("writable", "link") + (("owned",) if os.geteuid() == 0 else ()):
        cache = tmp_path / f"cache-{plant}"
        cache.mkdir()
        target = cache / ours.name
        if plant == "link":
            target.symlink_to(planted)
        else:
            shutil.copy(planted, target)
            target.chmod(0o777) if plant == "writable" else os.chown(target, 12345, 12345)
        monkeypatch.setenv("CLIFFGUARD_KERNEL_CACHE", str(cache))
        assert load_c_library(source, ["-O1"], {"one": []}).one() == 1, plant
        assert not target.is_symlink() and target.stat().st_uid == os.geteuid(), plant


def _failing_compiler(tmp_path, monkeypatch, message: str):
    """(A one-line C source, the file each compiler call adds a line to, the compiler): `$CC` a script that
    fails saying `message`, the cache folder and a temporary one under `tmp_path`."""
    import tempfile

    calls = tmp_path / "calls"
    compiler = tmp_path / "cc"
    compiler.write_text(f"#!/bin/sh\necho x >> {calls}\necho '{message}' >&2\nexit 1\n")
    compiler.chmod(0o755)
    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("CLIFFGUARD_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return source, calls, compiler


def test_a_failed_compile_is_not_tried_again_elsewhere(tmp_path, monkeypatch):
    """A compiler that fails (or hangs: COMPILE_SECONDS each) failed again in the temporary folder: twice the
    wait at a worker's start. Only a folder's own failure moves the build to the next one."""
    source, calls, _ = _failing_compiler(tmp_path, monkeypatch, "no such flag")
    assert load_c_library(source, ["-O1"], {"one": []}) is None
    assert calls.read_text().count("x") == 1


def test_a_failed_compile_is_remembered_across_processes_with_the_same_compiler(tmp_path, monkeypatch, caplog):
    """A build that fails (an OpenMP one where the compiler has no OpenMP) was compiled again at every worker's
    start: seconds past the 2 s restart, COMPILE_SECONDS for a hung compiler. The failure is kept beside the
    build, named in the warning, and passed over once the compiler changes, the file is deleted or it is old."""
    import shutil
    import time

    from kernels import cpu_build

    source, calls, compiler = _failing_compiler(tmp_path, monkeypatch, "unrecognized option -fopenmp")
    assert load_c_library(source, ["-O1"], {"one": []}) is None
    (failed,) = (tmp_path / "cache").glob("one-*.failed")
    assert list((tmp_path / "cache").iterdir()) == [failed] and failed.stat().st_mode & 0o777 == 0o644
    caplog.clear()
    assert load_c_library(source, ["-O1"], {"one": []}) is None     # a later worker's start: no compile
    assert calls.read_text().count("x") == 1
    assert str(failed) in caplog.text and "unrecognized option -fopenmp" in caplog.text
    assert load_c_library(source, ["-O2"], {"one": []}) is None     # another build is its own
    assert calls.read_text().count("x") == 2
    old = time.time() - cpu_build.FAILED_SECONDS - 1
    os.utime(failed, (old, old))                                    # a day later: tried again
    assert load_c_library(source, ["-O1"], {"one": []}) is None
    assert calls.read_text().count("x") == 3
    failed.chmod(0o666)                                             # one another user could write: passed over
    assert load_c_library(source, ["-O1"], {"one": []}) is None
    assert calls.read_text().count("x") == 4 and failed.stat().st_mode & 0o777 == 0o644
    compiler.write_text(f"#!/bin/sh\necho x >> {calls}\nexec {shutil.which('cc')} \"$@\"\n")   # fixed
    assert load_c_library(source, ["-O1"], {"one": []}).one() == 1
    assert calls.read_text().count("x") >= 5


def test_a_compile_that_fills_its_folder_is_made_in_the_temporary_one(tmp_path, monkeypatch):
    """A full disk (or quota) under the cache folder failed the compiler writing there, taken as the compiler's
    own failure: every C kernel off, when the temporary folder had room. The words are the C locale's."""
    import shutil
    import tempfile

    full = tmp_path / "cache"
    compiler = tmp_path / "cc"
    compiler.write_text(f"""#!/bin/sh
case "$*" in *{full}/*) echo "$LC_ALL" > {tmp_path}/locale
    echo "cc1: fatal error: error writing to x.o: No space left on device" >&2; exit 1;; esac
exec {shutil.which('cc')} "$@"
""")
    compiler.chmod(0o755)
    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("LC_ALL", "de_DE.UTF-8")
    monkeypatch.setenv("CLIFFGUARD_KERNEL_CACHE", str(full))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert load_c_library(source, ["-O1"], {"one": []}).one() == 1
    assert len(list((tmp_path / "tmp").glob("cliffguard-kernels-*/one-*.so"))) == 1
    assert (tmp_path / "locale").read_text().strip() == "C"
    # a disk so full the message itself is lost (a linker's cut short): the folder's free space says it
    compiler.write_text(f"""#!/bin/sh
case "$*" in *{full}/*) echo "collect2: error: ld returned 1 exit status" >&2; exit 1;; esac
exec {shutil.which('cc')} "$@"
""")
    source.write_text("int one(void) { return 2; }\n")
    statvfs = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result((4096, 4096, 100, 0, 0, 10, 0, 0, 0, 255))
                        if str(path).startswith(str(full)) else statvfs(path))
    assert load_c_library(source, ["-O1"], {"one": []}).one() == 2


def test_the_cpu_device_gets_this_backend(monkeypatch):
    monkeypatch.delenv("CLIFFGUARD_ATTENTION_BACKEND", raising=False)
    assert kernels.get_backend("cpu") is cpu_attention
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", "torch")
    assert kernels.get_backend("cpu") is reference
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", "cpu")
    with pytest.raises(ValueError, match="CLIFFGUARD_ATTENTION_BACKEND=cpu"):
        kernels.get_backend("meta")


def test_loading_the_c_kernels_leaves_the_process_floats_alone():
    """A library linked with -ffast-math would turn on flush-to-zero and denormals-are-zero for the whole
    process that loads it (Python's floats included: `5e-324 > 0.0` became False, and every `gt=0` check
    of the configs passed a zero). The kernels are compiled with their flags and linked without them."""
    import subprocess
    import sys

    code = ("from kernels import cpu_attention, cpu_fused\n"
            "assert cpu_attention.load_library() is not None and cpu_fused.load_library() is not None\n"
            "tiny = 5e-324\n"
            "assert tiny > 0.0 and tiny * 1.0 > 0.0, 'denormals flushed'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_nan_in_an_attended_key_or_the_query_reaches_the_output_as_in_the_reference():
    """A NaN score poisons the softmax, as in the reference and torch's SDPA: a corrupt cache row or query
    shows, and a stray read of a NaN-filled slot (the steps above) fails for K as for V."""
    block_size, head_dim, length = 16, 64, 40
    k_cache, v_cache = torch.randn(3, block_size, 1, head_dim), torch.randn(3, block_size, 1, head_dim)
    query = torch.randn(1, 1, head_dim)
    meta = AttentionMetadata.build([[0, 1, 2]], [1], [length], block_size)
    k_cache[1, 3, 0, 5] = float("nan")   # position 19's key
    for q in (query, query.clone().fill_(float("nan"))):
        want = reference.paged_attention(q, k_cache, v_cache, meta, head_dim ** -0.5)
        assert want.isnan().all()
        assert cpu_attention.paged_attention(q, k_cache, v_cache, meta, head_dim ** -0.5).isnan().all()
        k_cache[1, 3, 0, 5] = 0.0        # the query alone, the second time


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _decode_into_nan(query, k_cache, v_cache, meta, scale, window) -> torch.Tensor:
    out = torch.full(query.shape, float("nan"), dtype=query.dtype)
    assert cpu_attention.decode_attention(query, k_cache, v_cache, meta, scale, window, out)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("seq_lens", [[300, 1, 17, 90, 2, 64, 5, 129], [1, 1, 1, 300], [300, 1, 1], [40, 7]])
def test_decode_rows_split_over_threads_give_the_bits_of_one_call(dtype, window, seq_lens):
    """Each run is the same code on its rows: split over 2, 3 or 8 threads (forced: these steps read far less than
    `split_min_bytes`), every row written once, the output equal to one call's bit for bit; with the cut between
    rows of every size, a long row first or last, and more threads than rows."""
    if cpu_attention.decode_threads() == 0:
        pytest.skip("the kernel is built without OpenMP here (torch's libgomp is not loaded)")
    seed = _seed()
    query, k_cache, v_cache, meta, _ = _make_step(seq_lens, [1] * len(seq_lens), 8, 2, 64, 16, dtype, seed)
    with cpu_attention.split_min_bytes(1 << 62):
        one = _decode_into_nan(query, k_cache, v_cache, meta, 64 ** -0.5, window)
    assert not one.isnan().any(), f"seed={seed}"
    for threads in (2, 3, 8):
        with _threads(threads), cpu_attention.split_min_bytes(0):
            assert cpu_attention.decode_threads() == threads
            split = _decode_into_nan(query, k_cache, v_cache, meta, 64 ** -0.5, window)
        assert torch.equal(split, one), f"seed={seed} threads={threads}: {(split - one).abs().nan_to_num(9).max()}"


def test_the_kernel_joins_torchs_openmp_threads_where_torch_brought_libgomp():
    """On a torch that loads GNU OpenMP (its Linux builds), the kernel is built with OpenMP and splits over
    torch's thread count; without it, it is built without and never splits."""
    if not cpu_attention.torch_libgomp_loaded():
        assert cpu_attention.decode_threads() == 0
        return
    with _threads(2):
        assert cpu_attention.decode_threads() == 2
    with _threads(1):
        assert cpu_attention.decode_threads() == 1

