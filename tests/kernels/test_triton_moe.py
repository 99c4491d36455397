"""The Triton MoE experts (`kernels.triton_moe`) against the loop over the experts, through Triton's
interpreter on the CPU; and a Qwen3-MoE engine on the Triton ops, eager and with its decode steps
replayed from recorded graphs, against transformers.

Inputs are fresh random every run; the seed is in every assertion message (rerun one case with
`CLIFFGUARD_TEST_SEED=<seed>`).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from kernels.triton_moe import fused_moe, moe_align, moe_block_m  # noqa: E402
from tests.kernels.test_reference import _make_seed  # noqa: E402

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2)}


def _loop(x, w13, w2, weights, experts, b13=None, b2=None, act=lambda gate, up: F.silu(gate) * up):
    """Each token's experts one at a time, in float32: the sums the kernels must give (with the experts' biases
    and another activation where given)."""
    x, w13, w2, weights = x.float(), w13.float(), w2.float(), weights.float()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(experts.shape[1]):
            e = int(experts[t, slot])
            h = x[t] @ w13[e].T + (b13[e].float() if b13 is not None else 0.0)
            y = act(*h.chunk(2)) @ w2[e].T + (b2[e].float() if b2 is not None else 0.0)
            out[t] += y * weights[t, slot]
    return out


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(1, 4, 2, 16), (7, 8, 3, 16), (40, 3, 2, 16), (5, 64, 8, 64)])
def test_align_lays_each_experts_pairs_out_in_whole_blocks(tokens, experts, top_k, block_m):
    seed = _make_seed()
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    sorted_pairs, block_expert = moe_align(chosen, experts, block_m)
    flat, pairs = chosen.flatten(), tokens * top_k
    assert sorted_pairs.shape == (block_expert.shape[0] * block_m,), f"seed {seed}"
    seen = []
    for b, e in enumerate(block_expert.tolist()):
        rows = sorted_pairs[b * block_m:(b + 1) * block_m].tolist()
        real = [p for p in rows if p < pairs]
        if e < 0:
            assert not real, f"seed {seed}: block {b} unused but holds {real}"
            continue
        assert real and all(flat[p] == e for p in real), f"seed {seed}: block {b} of expert {e} holds {real}"
        assert rows[:len(real)] == real and real == sorted(real), f"seed {seed}: block {b} padding or order"
        seen += real
    assert sorted(seen) == list(range(pairs)), f"seed {seed}: every pair once"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", [
    (1, 64, 32, 4, 2), (6, 40, 24, 8, 3), (33, 48, 80, 5, 1), (20, 96, 40, 16, 4),
])
def test_fused_moe_equals_the_loop_over_the_experts(dtype, tokens, hidden, inter, experts, top_k):
    # Sizes off the tiles (40, 24, 80 columns) mask the edges; 16 experts over 20 tokens leave some unused.
    seed = _make_seed()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    scores = torch.randn(tokens, experts, generator=gen).softmax(-1)
    weights, chosen = scores.topk(top_k, dim=-1)
    out = fused_moe(x, w13, w2, weights.to(dtype), chosen)
    assert out.dtype == dtype and out.shape == x.shape
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), _loop(x, w13, w2, weights.to(dtype), chosen), atol=atol, rtol=rtol,
                               msg=lambda m: f"seed {seed}: {m}")


def test_fused_moe_takes_float32_router_weights_beside_bfloat16_activations():
    """Mixtral's router leaves its top-k weights in float32 (`ModelConfig.moe_float_weights`): the kernels read
    them as they are, each pair's product unrounded, the token's sum rounded once to bfloat16."""
    seed = _make_seed()
    gen = torch.Generator().manual_seed(seed)
    tokens, hidden, inter, experts, top_k = 6, 40, 24, 8, 3
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(torch.bfloat16)
    weights, chosen = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    out = fused_moe(x, w13, w2, weights, chosen)
    assert weights.dtype == torch.float32 and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _loop(x, w13, w2, weights, chosen), atol=3e-2, rtol=3e-2,
                               msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_with_biases_and_a_clamped_swiglu_equals_the_loop(dtype):
    """GPT-OSS's experts: a bias on each expert's gate/up and down products, added in the kernels before their
    rounding, and its clamped SwiGLU launched between the GEMMs; a clamp that bends these activations."""
    from engine.layers import ClampedSwiGLU

    seed = _make_seed()
    gen = torch.Generator().manual_seed(seed)
    tokens, hidden, inter, experts, top_k = 9, 40, 24, 8, 3
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    b13 = torch.randn(experts, 2 * inter, generator=gen).to(dtype)
    b2 = torch.randn(experts, hidden, generator=gen).to(dtype)
    weights, chosen = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    act = ClampedSwiGLU(1.702, 0.8)
    out = fused_moe(x, w13, w2, weights.to(dtype), chosen, b13, b2, act)
    want = _loop(x, w13, w2, weights.to(dtype), chosen, b13, b2, lambda gate, up: act(torch.cat([gate, up])))
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), want, atol=atol * 2, rtol=rtol, msg=lambda m: f"seed {seed}: {m}")
    plain = _loop(x, w13, w2, weights.to(dtype), chosen, b13, b2)
    assert (plain - want).abs().max() > 0.1, f"seed {seed}: the clamp changed nothing"


def test_block_rows_follow_the_pairs_per_expert():
    assert moe_block_m(8, 128) == 16 and moe_block_m(64 * 8, 128) == 16 and moe_block_m(4096, 128) == 64


MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
       "mlp_only_layers": [1], "head_dim": 32}
# GPT-OSS: biased experts, a clamped SwiGLU, attention sinks, sliding and full layers
GPT_OSS = {"intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
           "sliding_window": 8, "swiglu_limit": 1.5}
# DeepSeek V3: its float32 router (grouped sigmoid), ungated shared experts, latent attention through the Triton kernels
DEEPSEEK = {"num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "n_group": 2, "topk_group": 1}
# Llama 4: its experts take their tokens scaled (the kernels see each pair at weight 1) beside dense layers, its
# rotating layers attend within chunks of 8 (the prompts and outputs cross them), its NoPE layer's queries scaled
LLAMA4 = {"intermediate_size": 48, "intermediate_size_mlp": 96, "num_local_experts": 4, "head_dim": 16,
          "num_hidden_layers": 4, "interleave_moe_layer_step": 2, "attention_chunk_size": 8, "floor_scale": 4,
          "attn_scale": 0.5}
MODELS = [("qwen3_moe", MOE), ("gpt_oss", GPT_OSS), ("deepseek_v3", DEEPSEEK), ("llama4", LLAMA4)]


def _build_for_sm90(warps: int | None = None) -> dict:
    """Compile the expert GEMM for sm_90 (bfloat16 activations, tiles of 128 columns by 64 of the input) as a decode
    launch (16 pairs a block) over each kind of expert weights, and INT8's as a prefill launch (64), on `warps` or
    those `moe_warps` gives; report each build's stack (spills)."""
    import triton.language as tl

    from kernels import triton_moe
    from tests.kernels.test_triton import _build_kernel_for_sm90

    report = {}
    for kind, block_m in (("bf16", 16), ("fp8", 16), ("mxfp4", 16), ("int4", 16), ("int8", 16), ("int8", 64)):
        packed = kind if kind in triton_moe.PACKINGS else None
        pointers = {"a_ptr": "bf16", "w_ptr": {"bf16": "bf16", "fp8": "fp8e4nv"}.get(kind, "u8"), "out_ptr": "bf16",
                    "weight_ptr": "fp32", "bias_ptr": "bf16", "z_ptr": "u8",
                    "s_ptr": {"mxfp4": "u8", "fp8": "fp32"}.get(kind, "bf16")}
        _, usage = _build_kernel_for_sm90(
            triton_moe._moe_gemm_kernel, dict(
                MUL_WEIGHT=True, HAS_BIAS=False, W_FP8=kind == "fp8", PACKED=triton_moe.PACKINGS.index(packed),
                ZEROS=kind in ("int4", "int8"), BF16_BY_BITS=False, DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32",
                BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=64),
            pointers, num_warps=warps or triton_moe.moe_warps(block_m, 128, kind != "bf16"))
        report[f"{kind} {block_m}"] = usage.get("stack", 0)
    return report


def test_the_expert_gemm_builds_for_h100_without_spilling():
    """What the interpreter cannot show: each kind of expert weights' decode launch (and INT8's prefill one) compiles
    for sm_90 with nothing on the stack (quantized weights' tiles on 8 warps: on 4, FP8's spilled 96 bytes and INT8's
    with zero points 224)."""
    pytest.importorskip("triton.compiler")
    from tests.kernels.test_triton import _compiled_report

    report = _compiled_report(_build_for_sm90)
    assert report == {key: 0 for key in ("bf16 16", "fp8 16", "mxfp4 16", "int4 16", "int8 16", "int8 64")}, report


@pytest.mark.parametrize("arch,overrides", MODELS)
def test_an_moe_engine_on_the_triton_ops_runs_its_sparse_layers_through_fused_moe(tmp_path, builtin_path, monkeypatch,
                                                                                  arch, overrides):
    """The default run's view of the test below: on the Triton ops each sparse layer (not a dense one)
    takes `fused_moe`, which CUDA graphs may capture; on the torch ops none does (the loop over the experts)."""
    from engine.model_config import ModelConfig
    from engine.models import build_model
    from tests.conftest import make_tiny_model

    config = ModelConfig.from_folder(make_tiny_model(tmp_path / "moe", arch, builtin_path, **overrides))
    for backend, fused in (("triton", fused_moe), ("torch", None)):
        monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", backend)
        model = build_model(config, torch.float32, "cpu")
        sparse = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "w13")]
        assert len(sparse) == sum(map(config.is_sparse_layer, range(config.num_layers))) > 0
        assert all(mlp.fused_moe is fused for mlp in sparse) and model.graph_safe == (fused is not None)


def test_fp8_experts_decode_alike_on_the_triton_kernels_and_on_the_loop(tmp_path, builtin_path, monkeypatch):
    """A Qwen3-MoE FP8 checkpoint (blocks of 16 x 32) held in FP8, and a GPT-OSS float checkpoint quantized a row at
    a time (`quantization: fp8`: its biased experts and clamped SwiGLU): the Triton kernels dequantizing each weight
    tile as loaded decode the greedy tokens the loop over the experts does with each hit expert's weights
    dequantized whole."""
    from tests.conftest import make_tiny_model
    from tests.engine.test_engine_vs_hf import QWEN3_MOE, _fp8_checkpoint

    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (6, 19)]
    for arch, overrides in (("qwen3_moe", QWEN3_MOE), *[m for m in MODELS if m[0] == "gpt_oss"]):
        path = make_tiny_model(tmp_path / arch, arch, builtin_path, **overrides)
        if arch == "qwen3_moe":
            _fp8_checkpoint(path, (16, 32))
        results = _greedy_by_backend(path, "fp8", prompts, monkeypatch,
                                     lambda mlp: mlp.w13.dtype == torch.float8_e4m3fn)
        assert results["triton"] == results["torch"], arch


@pytest.mark.slow   # ~16 s through the interpreter; the wiring is shown above, fused_moe equals the loop, and the
# MoE engine (torch ops) equals transformers in tests/engine/test_engine_vs_hf.py
@pytest.mark.parametrize("arch,overrides", MODELS)
def test_an_moe_engine_on_the_triton_kernels_decodes_as_transformers_and_replays_graphs(tmp_path, builtin_path,
                                                                                       monkeypatch, arch, overrides):
    """Qwen3-MoE, GPT-OSS, DeepSeek V3 and Llama 4 on the Triton ops run their experts through `fused_moe` (GPT-OSS's
    attention its sinks, Llama 4's its chunks, through the Triton attention): greedy tokens equal transformers', and
    with the decode steps replayed from recorded graphs (what a CUDA graph freezes) they stay equal."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import make_tiny_model

    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", "triton")
    path = make_tiny_model(tmp_path / "moe", arch, builtin_path, **overrides)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (6, 19)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        expected.append(out[0, len(ids):].tolist())
    assert_decodes_eager_and_from_recorded_graphs(path, prompts, expected)


def assert_decodes_eager_and_from_recorded_graphs(path, prompts: list[list[int]], expected: list[list[int]]) -> None:
    """The model at `path` (float32, on the ops the backend gives: its sparse layers through `fused_moe`) decodes
    `expected` greedily, eager and with its decode steps replayed from recorded graphs."""
    from engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams
    from tests.engine.graph_recorder import RecordingGraphBackend

    for graphs in (False, True):
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", cache=CacheConfig(block_size=8),   # as hf
                                        pools=(PoolConfig(num_blocks=16, scheduler=SchedulerConfig(
                                            max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64)),)),
                           progress=False)
        assert all(m.fused_moe is fused_moe for m in engine.model.modules() if hasattr(m, "w13"))
        if graphs:
            recorder = RecordingGraphBackend()
            engine.runner.capture_graphs(2, 64, recorder)
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == expected, f"graphs {graphs}"
        if graphs:
            assert recorder.replays >= 6


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_on_cuda_fused_moe_at_qwen3_30b_a3b_shape_equals_the_loop(tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator().manual_seed(tokens)
    hidden, inter, experts, top_k = 2048, 768, 128, 8
    x = torch.randn(tokens, hidden, generator=gen).to("cuda", torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to("cuda", torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to("cuda", torch.bfloat16)
    weights, chosen = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    weights, chosen = weights.to("cuda", torch.bfloat16), chosen.cuda()
    out = fused_moe(x, w13, w2, weights, chosen)
    rows = range(min(tokens, 8))   # the loop in float32 on the host is slow: a few tokens checked
    expected = _loop(x[list(rows)].cpu(), w13.cpu(), w2.cpu(), weights[list(rows)].cpu(), chosen[list(rows)].cpu())
    torch.testing.assert_close(out[list(rows)].float().cpu(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("arch,overrides", MODELS)
def test_on_cuda_an_moe_model_is_captured_in_graphs_and_decodes_as_eager(tmp_path, builtin_path, arch, overrides):
    from tests.conftest import make_tiny_model

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    assert_cuda_graphs_decode_as_eager(make_tiny_model(tmp_path / "moe", arch, builtin_path, **overrides))


def assert_cuda_graphs_decode_as_eager(path) -> None:
    """The model at `path` on CUDA (float32) decodes four prompts to the same tokens with its decode steps in CUDA
    graphs as eagerly."""
    from engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams

    rng = random.Random(9)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 17, 30, 41)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 20, 11, 30)]
    results = {}
    for eager in (True, False):
        engine = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="float32", enforce_eager=eager,
                                        cache=CacheConfig(block_size=16), pools=(PoolConfig(
                                            num_blocks=64, scheduler=SchedulerConfig(
                                                max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256)),)),
                           progress=False)
        assert (engine.runner.graphs is None) == eager
        results[eager] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert results[True] == results[False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_over_fp8_experts_equals_the_loop_over_their_dequantized_weights(dtype):
    """FP8 experts (blocks of 16 x 32, partial at the edges) with their scales: each weight tile dequantized as the
    kernels load it, as the whole weights dequantized (each value times its block's scale, rounded to x's dtype)
    give through the loop."""
    from kernels.fp8_gemm import dequantize_blocks

    seed = _make_seed()
    gen = torch.Generator().manual_seed(seed)
    tokens, hidden, inter, experts, top_k, block = 9, 80, 40, 4, 2, (16, 32)

    def fp8(rows, cols):
        values = (torch.randn(experts, rows, cols, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(experts, -(-rows // 16), -(-cols // 32), generator=gen) * 2e-3 + 1e-4
        return values, scale, torch.stack([dequantize_blocks(v, s, block) for v, s in zip(values, scale)]).to(dtype)

    w13, s13, dense13 = fp8(2 * inter, hidden)
    w2, s2, dense2 = fp8(hidden, inter)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights, chosen = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    weights = weights.to(dtype)
    got = fused_moe(x, w13, w2, weights, chosen, w13_scale=s13, w2_scale=s2, block=block)
    want = fused_moe(x, dense13, dense2, weights, chosen)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(got.float(), _loop(x, dense13, dense2, weights, chosen), rtol=rtol, atol=atol,
                               msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_over_mxfp4_experts_equals_it_over_their_dequantized_weights(dtype):
    """MXFP4 experts (GPT-OSS's: every e2m1 code, scales over 2 ** -127 .. 2 ** 1 including the subnormal 0, biases
    and a clamped SwiGLU) decoded tile by tile as the kernels load them give the same bits as the kernels over the
    weights dequantized whole (the decoding is exact), and the loop's sums."""
    from engine.layers import ClampedSwiGLU
    from kernels.mxfp4 import dequantize_packed

    seed = _make_seed()
    gen = torch.Generator().manual_seed(seed)
    tokens, hidden, inter, experts, top_k = 11, 96, 64, 4, 2

    def mxfp4(rows, cols):
        packed = torch.randint(0, 256, (experts, rows, cols // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
        scales = torch.randint(120, 126, (experts, rows, cols // 32), generator=gen, dtype=torch.int32)
        scales[0, 0, 0], scales[1, 0, 0], scales[1, 1, 0] = 0, 1, 128   # 2 ** -127 (subnormal), 2 ** -126, 2
        scales = scales.to(torch.uint8)
        return packed, scales, dequantize_packed(packed, scales, dtype)

    w13, s13, dense13 = mxfp4(2 * inter, hidden)
    w2, s2, dense2 = mxfp4(hidden, inter)
    assert dense13[0, 0, :32].abs().max() < 1e-37 and dense13[1, 1, :32].abs().max() >= 1, f"seed {seed}"
    b13 = torch.randn(experts, 2 * inter, generator=gen).to(dtype)
    b2 = torch.randn(experts, hidden, generator=gen).to(dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights, chosen = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    weights, act = weights.to(dtype), ClampedSwiGLU(1.702, 7.0)
    got = fused_moe(x, w13, w2, weights, chosen, b13, b2, act, w13_scale=s13, w2_scale=s2, packed="mxfp4")
    assert torch.equal(got, fused_moe(x, dense13, dense2, weights, chosen, b13, b2, act)), f"seed {seed}"
    if dtype == torch.float32:   # (bfloat16's roundings of h and of the activation are the fused kernels' own)
        want = _loop(x, dense13, dense2, weights, chosen, b13, b2, lambda gate, up: act(torch.cat([gate, up])))
        # float32 sums in another order: their rounding scales with the largest sum (2 ** 1 scales reach the 100s)
        atol = 1e-5 * float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda m: f"seed {seed}: {m}")


def test_mxfp4_experts_decode_alike_on_the_triton_kernels_and_on_the_loop(tmp_path, builtin_path, monkeypatch):
    """A GPT-OSS checkpoint with MXFP4 experts held as stored (`quantization: mxfp4`): the Triton kernels decoding
    each tile as loaded give the greedy tokens the loop over the experts gives with each hit expert dequantized."""
    from tests.engine.test_engine_vs_hf import mxfp4_gpt_oss

    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (6, 19)]
    folder, _, _ = mxfp4_gpt_oss(tmp_path / "gpt_oss", builtin_path)
    results = _greedy_by_backend(folder, "mxfp4", prompts, monkeypatch, lambda mlp: mlp.packed == "mxfp4")
    assert results["triton"] == results["torch"]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_on_cuda_fused_moe_over_mxfp4_experts_at_gpt_oss_shape_equals_it_over_the_decoded_weights(tokens):
    """gpt-oss-120b's layer (128 experts of 2,880, 4 a token, biases, the clamped SwiGLU) with MXFP4 experts: the
    kernels decoding each tile on the GPU give the bits they give over the weights decoded whole."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from engine.layers import ClampedSwiGLU
    from kernels.mxfp4 import dequantize_packed

    gen = torch.Generator().manual_seed(tokens)
    hidden = inter = 2880
    experts, top_k = 128, 4

    def mxfp4(rows, cols):
        packed = torch.randint(0, 256, (experts, rows, cols // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
        scales = torch.randint(118, 122, (experts, rows, cols // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
        return packed.cuda(), scales.cuda(), dequantize_packed(packed, scales, torch.bfloat16).cuda()

    w13, s13, dense13 = mxfp4(2 * inter, hidden)
    w2, s2, dense2 = mxfp4(hidden, inter)
    b13 = torch.randn(experts, 2 * inter, generator=gen).to("cuda", torch.bfloat16)
    b2 = torch.randn(experts, hidden, generator=gen).to("cuda", torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=gen).to("cuda", torch.bfloat16)
    weights, chosen = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    weights, chosen, act = weights.to("cuda", torch.bfloat16), chosen.cuda(), ClampedSwiGLU(1.702, 7.0)
    got = fused_moe(x, w13, w2, weights, chosen, b13, b2, act, w13_scale=s13, w2_scale=s2, packed="mxfp4")
    assert torch.equal(got, fused_moe(x, dense13, dense2, weights, chosen, b13, b2, act))


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (8, 0)])
@pytest.mark.parametrize("dtype,zeros", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_fused_moe_over_int4_experts_equals_it_over_their_dequantized_weights(dtype, zeros, bits, group):
    """INT4 experts (pack-quantized checkpoints': every value of -8 .. 7, a scale in x's dtype per 32 inputs, signed;
    AWQ's: less a zero point 0 .. 15 a group instead of 8) and INT8 ones (a code a byte, less 128 or a zero point of
    0 .. 255; a scale a 32 or, group 0, one a row: W8A16's) decoded tile by tile as the kernels load them (the value
    times its scale in float32, rounded once) give the bits the kernels give over the weights dequantized whole; in
    float32 the loop's sums too."""
    from engine.int4_weights import dequantize_int4

    seed = _make_seed()
    gen = torch.Generator().manual_seed(seed)
    tokens, hidden, inter, experts, top_k = 11, 96, 64, 4, 2

    def int4(rows, cols):
        packed = torch.randint(0, 256, (experts, rows, cols * bits // 8), generator=gen,
                               dtype=torch.int32).to(torch.uint8)
        scales = (torch.randn(experts, rows, cols // (group or cols), generator=gen) * 0.03 * 8
                  / (1 << (bits - 1))).to(dtype)
        zero = torch.randint(0, 1 << bits, scales.shape, generator=gen, dtype=torch.int32).to(torch.uint8) if zeros \
            else None
        return packed, scales, zero, dequantize_int4(packed, scales, dtype, zero, bits=bits)

    w13, s13, z13, dense13 = int4(2 * inter, hidden)
    w2, s2, z2, dense2 = int4(hidden, inter)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights, chosen = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    weights = weights.to(dtype)
    got = fused_moe(x, w13, w2, weights, chosen, w13_scale=s13, w2_scale=s2, block=(1, group), packed=f"int{bits}",
                    w13_zeros=z13, w2_zeros=z2)
    assert torch.equal(got, fused_moe(x, dense13, dense2, weights, chosen)), f"seed {seed}"
    if dtype == torch.float32:
        torch.testing.assert_close(got, _loop(x, dense13, dense2, weights, chosen), rtol=1e-5, atol=1e-4,
                                   msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("kind", ["pack-quantized", "awq", "gptq-int8", "w8a16"])
def test_int4_experts_decode_alike_on_the_triton_kernels_and_on_the_loop(tmp_path, builtin_path, monkeypatch, kind):
    """A DeepSeek V3 checkpoint with INT4 experts held as stored (`quantization: int4`): pack-quantized (Kimi K2's
    kind), or AWQ's with a zero point a group (every projection); or with INT8 ones (GPTQ's 8 bits, `int8`; W8A16's,
    a scale a row): the Triton kernels decoding each tile as loaded give the greedy tokens the loop over the experts
    gives."""
    pytest.importorskip("compressed_tensors")
    from tests.conftest import make_tiny_model
    from tests.engine.test_awq_gptq_weights import awq_checkpoint, awq_packing
    from tests.engine.test_engine_vs_hf import DEEPSEEK
    from tests.engine.test_int4_weights import int4_checkpoint
    from tests.engine.test_int8_weights import gptq_int8_checkpoint, pack_quantized_checkpoint

    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (6, 19)]
    folder = make_tiny_model(tmp_path / "deepseek", "deepseek_v3", builtin_path, **DEEPSEEK)
    if kind == "awq":
        awq_checkpoint(folder, awq_packing())
    elif kind == "gptq-int8":
        gptq_int8_checkpoint(folder, awq_packing())
    elif kind == "w8a16":
        pack_quantized_checkpoint(folder)
    else:
        int4_checkpoint(folder, experts_only=True)
    packing = "int8" if kind in ("gptq-int8", "w8a16") else "int4"
    results = _greedy_by_backend(folder, packing, prompts, monkeypatch,
                                 lambda mlp: mlp.packed == packing and (mlp.w13_zeros is not None) == (kind == "awq"))
    assert results["triton"] == results["torch"]


def _greedy_by_backend(path, quantization: str, prompts, monkeypatch, held) -> dict[str, list[list[int]]]:
    """Greedy tokens of the model at `path` with `quantization`, on the Triton ops and on the torch ones (backend ->
    each prompt's tokens); every sparse block is `held` as asked, and runs `fused_moe` on the Triton ops alone."""
    from engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from engine.models.qwen3_moe import SparseMoeBlock
    from engine.sampling import SamplingParams

    results = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", backend)
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", quantization=quantization,
                                        cache=CacheConfig(block_size=8),
                                        pools=(PoolConfig(num_blocks=16, scheduler=SchedulerConfig(
                                            max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64)),)),
                           progress=False)
        sparse = [m for m in engine.model.modules() if isinstance(m, SparseMoeBlock)]
        assert sparse and all(held(m) and (m.fused_moe is fused_moe) == (backend == "triton") for m in sparse)
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        results[backend] = [o.outputs[0].token_ids for o in outs]
    return results


def test_muse_sparks_expert_rows_through_fused_moe_equal_the_grouped_matmuls(tmp_path, builtin_path, monkeypatch):
    """Muse Spark's sparse layer on the Triton ops makes its (token, expert) rows through `fused_moe`, a row one expert
    at weight 1 (each row normed before it is weighed): the layer's output as with the grouped matmuls, and its model
    graph-safe (nothing read back)."""
    from engine.models import build_model
    from engine.models.muse import MuseSparkMoeBlock
    from engine.model_config import ModelConfig
    from tests.engine.test_multimodal_text import vision_checkpoint

    _, folder = vision_checkpoint(tmp_path, "muse_spark")
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", "triton")
    model = build_model(ModelConfig.from_folder(folder), torch.float32, "cpu")
    model.init_random(std=0.3)
    blocks = [m for m in model.modules() if isinstance(m, MuseSparkMoeBlock)]
    assert len(blocks) == 3 and all(b.fused_moe is fused_moe for b in blocks) and model.graph_safe
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fused = blocks[1](x)
        blocks[1].fused_moe = None
        torch.testing.assert_close(fused, blocks[1](x), atol=1e-5, rtol=1e-5)


@pytest.mark.slow   # ~20 s through the interpreter; the rows' equality is shown above
def test_muse_spark_on_the_triton_kernels_decodes_as_transformers_and_replays_graphs(tmp_path, builtin_path,
                                                                                    monkeypatch):
    """Muse Spark's tiny model on the Triton ops (its experts through `fused_moe` a row at a time, the attention
    through the Triton kernels): transformers' greedy tokens, eager and with its decode steps replayed from recorded
    graphs."""
    import shutil

    from tests.engine.test_engine_vs_hf import _hf_greedy
    from tests.engine.test_multimodal_text import vision_checkpoint

    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", "triton")
    hf, folder = vision_checkpoint(tmp_path, "muse_spark")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_path / name, folder / name)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (6, 19)]
    assert_decodes_eager_and_from_recorded_graphs(folder, prompts, [_hf_greedy(hf, ids, 8, eos_ids=None)
                                                                     for ids in prompts])


@pytest.mark.gpu
def test_on_cuda_muse_spark_is_captured_in_graphs_and_decodes_as_eager(tmp_path, builtin_path):
    """Compiled on a GPU (`bench/gpu_session.sh`'s tests step): Muse Spark's tiny model, its expert rows through
    `fused_moe`, decodes the same tokens with its decode steps in CUDA graphs as eagerly."""
    import shutil

    from tests.engine.test_multimodal_text import vision_checkpoint

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _, folder = vision_checkpoint(tmp_path, "muse_spark")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_path / name, folder / name)
    assert_cuda_graphs_decode_as_eager(folder)
