"""The model's shared layers (`engine.layers`) against transformers' own modules, on both their paths
(the torch ops, and the Triton kernels through the interpreter), and the operators a decoder layer runs.

transformers' modules are the yardstick: `LlamaRMSNorm`, `LlamaRotaryEmbedding` with
`apply_rotary_pos_emb` (default, `llama3`, `linear` and `yarn` rope scaling) and `LlamaMLP`, on the same
weights and inputs, in float32 and bfloat16.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")

from transformers.models.llama import modeling_llama  # noqa: E402

from engine.model_config import ModelConfig  # noqa: E402
from engine.layers import RMSNorm, RotaryEmbedding  # noqa: E402
from engine.layers.rotary import rope_attention_factor, rope_inv_freq  # noqa: E402
from engine.model import MLP  # noqa: E402
from engine.models import build_model  # noqa: E402
from engine.parallel import Collectives, ShardShape  # noqa: E402
from kernels import AttentionMetadata, fused, reference, triton_fused  # noqa: E402

OPS = {"torch": fused, "triton": triton_fused}
DTYPES = (torch.float32, torch.bfloat16)
# (atol, rtol) against transformers in the same dtype, for the Triton kernels (the torch path must match
# exactly: it is transformers' operators in transformers' order). They round where transformers does,
# but compute each step in float32 (rotary's two products and their sum rounded once) and sum the
# squares in another order: in float32 within an ulp or so, in bfloat16 within two ulps.
TOLERANCES = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (2e-2, 2e-2)}
ROPE_PARAMETERS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 256},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "original_max_position_embeddings": 256,
                    "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn-attention-factor": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "attention_factor": 1.25,
                              "original_max_position_embeddings": 1024},
}


def _make_configs(rope: str = "default") -> tuple[object, ModelConfig]:
    """(transformers' LlamaConfig, ours from its dict): 4 query heads, 2 KV heads of 16, 2,048 positions."""
    hf = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                  rms_norm_eps=1e-5, rope_parameters=ROPE_PARAMETERS[rope],
                                  architectures=["LlamaForCausalLM"])
    return hf, ModelConfig.from_hf_config(hf.to_dict())


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, exact: bool = False) -> None:
    atol, rtol = (0.0, 0.0) if exact else TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ops", OPS)
def test_rms_norm_and_the_fused_residual_add_match_transformers(ops, dtype):
    torch.manual_seed(0)
    hf = modeling_llama.LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.3 * torch.randn(64))
    ours = RMSNorm(64, 1e-5, OPS[ops]).to(dtype)
    ours.load_state_dict(hf.state_dict())
    x, residual = (torch.randn(9, 64) * 3).to(dtype), torch.randn(9, 64).to(dtype)
    # The torch path is transformers' order, operator for operator. Triton's interpreter rounds float32
    # to bfloat16 toward zero (a GPU to nearest even, as torch), so there even the residual sum may be an
    # ulp off.
    exact = ops == "torch"
    with torch.inference_mode():
        _assert_close(ours(x), hf(x), f"{ops} rms_norm", exact)
        normed, new_residual = ours(x.clone(), residual.clone())
        _assert_close(new_residual, x + residual, f"{ops} residual add", exact or dtype == torch.float32)
        _assert_close(normed, hf(x + residual), f"{ops} add + rms_norm", exact)


@pytest.mark.parametrize("rope", ROPE_PARAMETERS)
def test_the_inverse_frequencies_are_transformers(rope):
    hf_config, config = _make_configs(rope)
    hf = modeling_llama.LlamaRotaryEmbedding(hf_config)
    assert rope_attention_factor(config) == hf.attention_scaling and (hf.attention_scaling != 1.0) == ("yarn" in rope)
    torch.testing.assert_close(rope_inv_freq(config), hf.inv_freq, atol=0, rtol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("rope", ROPE_PARAMETERS)
def test_rotary_from_the_cache_matches_transformers(rope, ops, dtype):
    hf_config, config = _make_configs(rope)
    hf = modeling_llama.LlamaRotaryEmbedding(hf_config)
    ours = RotaryEmbedding(config, OPS[ops])
    ours.cos_sin_cache = ours.cos_sin_cache.to(dtype)      # as build_model leaves it
    gen = torch.Generator().manual_seed(1)
    positions = torch.cat((torch.randint(0, 2047, (10,), generator=gen), torch.tensor([0, 255, 2047])))
    q = torch.randn(len(positions), 4, 16, generator=gen).to(dtype)
    k = torch.randn(len(positions), 2, 16, generator=gen).to(dtype)

    cos, sin = hf(q, positions[None])                        # [1, num_tokens, head_dim]
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    query_key = torch.cat((q, k), dim=1)
    with torch.inference_mode():
        ours(query_key, ours.rows(positions))
    _assert_close(query_key[:, :4], want_q[0].transpose(0, 1), f"{rope} {ops} q", exact=ops == "torch")
    _assert_close(query_key[:, 4:], want_k[0].transpose(0, 1), f"{rope} {ops} k", exact=ops == "torch")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ops", OPS)
def test_mlp_with_silu_and_mul_matches_transformers(ops, dtype):
    hf_config, config = _make_configs()
    torch.manual_seed(2)
    hf = modeling_llama.LlamaMLP(hf_config).to(dtype)
    ours = MLP(config, ShardShape.of(config), Collectives(), OPS[ops]).to(dtype)
    with torch.no_grad():
        ours.gate_up_proj.weight.copy_(torch.cat((hf.gate_proj.weight, hf.up_proj.weight)))
        ours.down_proj.weight.copy_(hf.down_proj.weight)
    x = torch.randn(7, 64).to(dtype)
    with torch.inference_mode():
        _assert_close(ours(x), hf(x), f"{ops} mlp", exact=ops == "torch")


class _OpCounter(TorchDispatchMode):
    """Records the aten operators that run inside it, two ways.

    `calls`: each operator as the code calls it (a composite such as `rms_norm` or `linear` once).
    `kernels`: the operators that run a kernel of their own: a composite counted as the operators it
    decomposes into, views (which only make a tensor header) left out. `opaque(name, fn)` wraps `fn` to
    count as one entry in both, its insides unrecorded: the attention backend, a Triton launch.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.kernels: list[str] = []
        self._depth = 0
        self._paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if self._depth == 0:
            self.calls.append(name)
        self._depth += 1
        try:
            with self:
                out = func.decompose(*args, **kwargs)
        finally:
            self._depth -= 1
        if out is not NotImplemented:
            return out
        if not func.is_view:
            self.kernels.append(name)
        return func(*args, **kwargs)

    def opaque(self, name: str, fn):
        def call(*args, **kwargs):
            self.calls.append(name)
            self.kernels.append(name)
            self._paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._paused = False
        return call


def _count_decode_layer(monkeypatch, backend: str) -> _OpCounter:
    """The operators of one decode token through layer 1 of a tiny Llama built for the CPU with
    `CLIFFGUARD_ATTENTION_BACKEND=backend`; store_kv and attention count one each."""
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", backend)
    _, config = _make_configs()
    model = build_model(config, torch.float32, "cpu")
    model.init_random()
    counter = _OpCounter()
    ops = OPS[backend]
    assert model.layers[1].input_layernorm.ops is ops
    if backend == "triton":
        for name in ("rms_norm", "add_rms_norm", "rotary", "silu_and_mul"):
            monkeypatch.setattr(ops, name, counter.opaque(name, getattr(ops, name)))
    attention = type("Backend", (), {"store_kv": staticmethod(counter.opaque("store_kv", reference.store_kv)),
                                     "paged_attention": staticmethod(counter.opaque("attention",
                                                                                    reference.paged_attention))})
    kv_cache = torch.zeros(2, 8, 2, 16), torch.zeros(2, 8, 2, 16)
    meta = AttentionMetadata.build([[0, 1]], [1], [9], 8, "cpu")
    with torch.inference_mode():
        hidden, residual = torch.randn(1, 64), torch.randn(1, 64)
        rope_rows = model.rotary_emb.rows(torch.tensor([8]))
        with counter:
            model.layers[1](hidden, residual, rope_rows, kv_cache, meta, attention)
    return counter


def test_a_decode_layer_on_the_cpu_runs_26_kernels(monkeypatch):
    """The torch path, float32: add + norm (the add, `rms_norm`'s pow, mean, add, rsqrt, mul, and the
    weight: 7 kernels), qkv (1), rotary (flip, mul, mul, add: 4), store_kv, attention, o_proj, add + norm
    (7), gate_up, silu x mul (2), down: 26 kernels run, from 18 operators called (24 with the views).
    The layer before the fused ops called 50 operators (views included) and ran 32 kernels, rotary 10
    of them, on cos and sin rebuilt from the positions every forward."""
    counter = _count_decode_layer(monkeypatch, "torch")
    assert counter.kernels == ["add_", "pow", "mean", "add_", "rsqrt", "mul", "mul_", "mm",
                               "flip", "mul_", "mul_", "add_", "store_kv", "attention", "mm",
                               "add_", "pow", "mean", "add_", "rsqrt", "mul", "mul_", "mm", "silu", "mul_", "mm"]
    assert counter.calls == ["add_", "rms_norm", "mul_", "linear", "view", "slice",
                             "view", "flip", "mul_", "mul_", "add_", "split_with_sizes", "store_kv", "attention",
                             "reshape", "linear",
                             "add_", "rms_norm", "mul_", "linear", "chunk", "silu", "mul_", "linear"]


def test_a_decode_layer_on_triton_is_ten_launches(monkeypatch):
    """The Triton path (here through the interpreter; on CUDA the same launches, the matmuls cuBLAS's):
    add + norm, qkv, rotary, store_kv, attention, o_proj, add + norm, gate_up, silu x mul, down."""
    counter = _count_decode_layer(monkeypatch, "triton")
    assert counter.kernels == ["add_rms_norm", "mm", "rotary", "store_kv", "attention", "mm",
                               "add_rms_norm", "mm", "silu_and_mul", "mm"]
    assert counter.calls == ["add_rms_norm", "linear", "view", "slice", "rotary", "split_with_sizes", "store_kv",
                             "attention", "reshape", "linear", "add_rms_norm", "linear", "silu_and_mul", "linear"]


@pytest.mark.parametrize("kind", ["olmo2", "minimax_m2"])
def test_a_whole_projection_qk_norm_rounds_as_transformers_in_bfloat16(kind):
    """OLMo 2's q/k norm multiplies the float32 row by its weight and rounds once; MiniMax-M2's rounds the row,
    then multiplies (Llama's order): each is its own transformers norm to the bit in bfloat16."""
    from engine.models.olmo2 import RoundedWideRMSNorm, WideRMSNorm
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 4, 16, generator=gen).to(torch.bfloat16)
    ours = (RoundedWideRMSNorm if kind == "minimax_m2" else WideRMSNorm)(4, 16, 1e-6, Collectives(), 4, 1)
    theirs = (MiniMaxM2RMSNorm if kind == "minimax_m2" else Olmo2RMSNorm)(64, eps=1e-6)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(64, generator=gen) * 0.5 + 1)
        ours = ours.to(torch.bfloat16)
        theirs = theirs.to(torch.bfloat16)
        ours.weight.copy_(theirs.weight)
        got = x.clone()
        ours(got)
        assert torch.equal(got.reshape(7, 64), theirs(x.reshape(7, 64)))


@pytest.mark.parametrize("kind", ["centered", "input_scaled", "unit", "glimmer_centered", "glimmer_final"])
def test_muses_norms_round_as_transformers_in_bfloat16(kind):
    """Muse Spark's Gemma norm rounds 1 + weight to the weight's dtype before its float32 product, Glimmer's does not;
    Spark's input-scaled norm rounds x times 1 + weight before it norms; the weightless norm and Glimmer's final norm
    (Gemma 4's) keep their float32 statistics: each is its transformers norm to the bit in bfloat16, its weight
    random."""
    from transformers.models.muse_glimmer import modeling_muse_glimmer as glimmer
    from transformers.models.muse_spark import modeling_muse_spark as spark

    from engine.layers import FloatRMSNorm, GemmaRMSNorm
    from engine.models.muse import InputScaledNorm, SparkNorm, UnitNorm

    ours, theirs = {"centered": (SparkNorm(64, 1e-5), spark.MuseSparkTextCenteredRMSNorm(64, eps=1e-5)),
                    "input_scaled": (InputScaledNorm(64, 1e-3), spark.MuseSparkTextInputScaledRMSNorm(64, eps=1e-3)),
                    "unit": (UnitNorm(1e-5), spark.MuseSparkRMSNorm(eps=1e-5, with_scale=False)),
                    "glimmer_centered": (GemmaRMSNorm(64, 1e-5), glimmer.MuseGlimmerTextCenteredRMSNorm(64, eps=1e-5)),
                    "glimmer_final": (FloatRMSNorm(64, 1e-5), glimmer.MuseGlimmerRMSNorm(64, eps=1e-5))}[kind]
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 64, generator=gen) * 3).to(torch.bfloat16)
    with torch.no_grad():
        ours, theirs = ours.to(torch.bfloat16), theirs.to(torch.bfloat16)
        if kind != "unit":
            theirs.weight.copy_(torch.randn(64, generator=gen) * 0.7)
            ours.weight.copy_(theirs.weight)
        assert torch.equal(ours(x), theirs(x))


def test_muse_sparks_residual_gate_is_transformers_to_the_bit():
    """The float32 gate joining a bfloat16 sublayer output to the bfloat16 stream: transformers' to the bit."""
    from transformers import MuseSparkTextConfig
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkResidualGate

    from engine.models.muse import ResidualGate

    gen = torch.Generator().manual_seed(1)
    theirs = MuseSparkResidualGate(MuseSparkTextConfig(hidden_size=64, num_attention_heads=4,
                                                       residual_gate_temperature=0.7))
    ours = ResidualGate(64, 0.7)
    stream, out = ((torch.randn(9, 64, generator=gen) * 2).to(torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        theirs.gate.copy_(torch.randn(64, generator=gen) * 2)
        ours.gate.copy_(theirs.gate)
        assert torch.equal(ours(stream, out), theirs(stream, out))


def test_muse_sparks_router_picks_and_weighs_as_transformers_on_bfloat16_tokens():
    """Muse Spark's router: float32 logits of the bfloat16 tokens times `output_multiplier`, their sigmoid plus the
    correction bias picks, the picks' scores renormalised past 1e-15 and scaled: transformers' experts (as sets) and
    weights to the bit."""
    from transformers import MuseSparkTextConfig
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkTopkRouter

    from engine.models.muse import MuseSparkMoeBlock

    hf_config = MuseSparkTextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1,
                                    num_local_experts=16, num_experts_per_tok=4, moe_hidden_size=32,
                                    moe_intermediate_size=16, routed_scaling_factor=2.5, output_multiplier=0.3)
    hf_router = MuseSparkTopkRouter(hf_config)
    config = ModelConfig.from_hf_config({**hf_config.to_dict(), "architectures": ["MuseSparkForCausalLM"]})
    gen = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(16, 64, generator=gen), torch.randn(16, generator=gen) * 0.5
    with torch.device("meta"):
        block = MuseSparkMoeBlock(config, ShardShape.of(config), Collectives(), fused)
    block.gate.weight, block.expert_bias.weight = torch.nn.Parameter(weight), torch.nn.Parameter(bias)
    x = torch.randn(33, 64, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        hf_router.weight.copy_(weight)
        hf_router.e_score_correction_bias.copy_(bias)
        _, hf_weights, hf_experts = hf_router(x)
        weights, experts = block.route(x)
    theirs, ours = hf_experts.sort(dim=-1), experts.sort(dim=-1)
    assert torch.equal(ours.values, theirs.values)
    assert torch.equal(weights.gather(1, ours.indices), hf_weights.gather(1, theirs.indices))


# transformers' config class, its router's class and our architecture name, for each router
_ROUTERS = {"deepseek_v3": ("DeepseekV3Config", "deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter",
                            "DeepseekV3ForCausalLM", dict(n_routed_experts=16, n_group=4, topk_group=2,
                                                          routed_scaling_factor=2.5)),
            "deepseek_v2": ("DeepseekV2Config", "deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter",
                            "DeepseekV2ForCausalLM", dict(n_routed_experts=16, n_group=4, topk_group=2,
                                                          topk_method="group_limited_greedy",
                                                          routed_scaling_factor=16.0)),
            "minimax_m2": ("MiniMaxM2Config", "minimax_m2.modeling_minimax_m2.MiniMaxM2TopKRouter",
                           "MiniMaxM2ForCausalLM", dict(num_local_experts=16)),
            "axk2": ("AXK2Config", "axk2.modeling_axk2.AXK2TopkRouter", "AXK2ForCausalLM",
                     dict(n_routed_experts=16, n_group=4, topk_group=2, routed_scaling_factor=2.5))}


@pytest.mark.parametrize("arch", list(_ROUTERS))
def test_deepseeks_and_minimaxs_routers_pick_and_weigh_as_transformers_in_bfloat16(arch):
    """DeepSeek's routers in float32 (transformers keeps their weight and correction bias so), MiniMax-M2's logits in
    the model's dtype: on bfloat16 tokens each picks transformers' experts (as sets) with transformers' weights.
    A.X-K2's scores an expert outside the picked groups 0, not -inf: its correction bias below 0 here, so that such
    an expert is picked over a picked group's (with -inf, V3's, some rows pick otherwise)."""
    import importlib

    import transformers

    from engine.models.deepseek import DeepseekMoeBlock
    from engine.models.deepseek_v32 import AXK2MoeBlock

    config_class, router_path, architecture, experts = _ROUTERS[arch]
    module, router_class = router_path.rsplit(".", 1)
    hf_config = getattr(transformers, config_class)(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                                    num_hidden_layers=1, num_experts_per_tok=4, **experts)
    hf_router = getattr(importlib.import_module(f"transformers.models.{module}"), router_class)(hf_config)
    config = ModelConfig.from_hf_config({**hf_config.to_dict(), "architectures": [architecture]})
    dtype = torch.bfloat16 if arch == "minimax_m2" else torch.float32   # the router's, in each
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(16, 64, generator=gen) * 0.2, torch.randn(16, generator=gen) * 0.5
    bias = bias - 1.0 if arch == "axk2" else bias
    with torch.device("meta"):
        block = (AXK2MoeBlock if arch == "axk2" else DeepseekMoeBlock)(config, ShardShape.of(config), Collectives(),
                                                                       fused)
    block.gate.weight = torch.nn.Parameter(weight.to(dtype))
    if block.gate.e_score_correction_bias is not None:
        block.gate.e_score_correction_bias = torch.nn.Parameter(bias.to(dtype))
    x = torch.randn(33, 64, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        hf_router.weight.copy_(weight)
        hf_router.to(dtype)
        if arch in ("deepseek_v3", "axk2"):
            hf_router.e_score_correction_bias.copy_(bias)
        _, want_weights, want = hf_router(x, bias.to(dtype)) if arch == "minimax_m2" else hf_router(x)
        weights, got = block.route(x)
    got, want = got.sort(dim=-1), want.sort(dim=-1)
    assert torch.equal(got.values, want.values)
    assert torch.equal(weights.gather(1, got.indices), want_weights.float().gather(1, want.indices))
    if arch == "axk2":   # V3's -inf for the experts outside the picked groups picks otherwise
        block.masked_choice = None
        with torch.no_grad():
            assert not torch.equal(block.route(x)[1].sort(dim=-1).values, want.values)
