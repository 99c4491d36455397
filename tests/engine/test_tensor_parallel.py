"""Tensor parallelism (`engine.parallel`): greedy output with `tensor_parallel_size` N equals N = 1.

The ranks are real processes joined over gloo on the CPU, in float32: rank 0 is the engine in this
process, the others are spawned by it. Where a token differs, it must be a near-tie of the
one-rank run (its top-2 logprob gap under 1e-4): the sums of a row-parallel layer are added in
another order.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engine.config import CacheConfig, ConfigError, EngineConfig, PoolConfig, SchedulerConfig
from engine.model_config import ModelConfig
from engine.llm_engine import LLMEngine
from engine.parallel import ShardShape, check_tensor_parallel
from engine.sampling import SamplingParams
from tests.conftest import BUILTIN, assert_all_free, make_tiny_model
from tests.engine.test_engine_vs_hf import (AXK2, BAILING, BEAM, COHERE2_MOE, COMPASS, DEEPSEEK, DEEPSEEK_V4, GEMMA3N,
                                             GEMMA4, GEMMA4_E, GEMMA4_MOE, GLM4_MOE, HYV4, LARA_MINI, LONGCAT,
                                             DORY, MINIMAX, MINIMAX_M3, QWEN4_EXP)

pytestmark = pytest.mark.usefixtures("one_thread")   # and `cpu_threads=1` in each follower: a core per rank

NEAR_TIE = 1e-4
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)


def _model(num_heads: int, num_kv_heads: int, intermediate_size: int = 160, vocab_size: int = 1000) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab_size, hidden_size=64,
                       intermediate_size=intermediate_size, num_layers=2, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=16)


def test_shards_split_heads_and_replicate_kv_heads_past_their_count():
    smollm = _model(9, 3, intermediate_size=1536)
    shards = [ShardShape.of(smollm, r, 3) for r in range(3)]
    assert [(s.head_start, s.num_heads, s.kv_head_start, s.num_kv_heads) for s in shards] == \
        [(0, 3, 0, 1), (3, 3, 1, 1), (6, 3, 2, 1)]
    eight = [ShardShape.of(_model(8, 2), r, 8) for r in range(8)]   # 8 ranks, 2 KV heads: each held 4 times
    assert [s.kv_head_start for s in eight] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(s.num_heads == 1 and s.num_kv_heads == 1 for s in eight)
    # the vocabulary in ceil(V/T) rows per rank, the last rank's tail padding
    vocab = [ShardShape.of(_model(4, 2, vocab_size=1001), r, 2) for r in range(2)]
    assert [(s.vocab_start, s.vocab_rows, s.num_vocab_rows_used) for s in vocab] == [(0, 501, 501), (501, 501, 500)]


def _hf(arch: str, **extra) -> ModelConfig:
    base = {"architectures": [arch], "vocab_size": 1001, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6}
    return ModelConfig.from_hf_config(base | extra)


@pytest.mark.parametrize("config", [
    _hf("LlamaForCausalLM", attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    _hf("Qwen2ForCausalLM", attention_bias=True, tie_word_embeddings=True),
    _hf("Qwen3ForCausalLM"),
    _hf("Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1]),
    _hf("Gemma3ForCausalLM", sliding_window=8, query_pre_attn_scalar=16),
    _hf("GraniteMoeHybridForCausalLM", layer_types=["mamba", "attention", "mamba"], num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=32, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=1),
    _hf("Qwen3NextForCausalLM", num_hidden_layers=4, linear_num_key_heads=8, linear_num_value_heads=16,
        linear_key_head_dim=8, linear_value_head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=16, mlp_only_layers=[1]),
    _hf("StableLmForCausalLM", use_qkv_bias=True, use_parallel_residual=True, qk_layernorm=True),
    _hf("NemotronHForCausalLM", layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=8, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, moe_latent_size=16),
    _hf("OlmoHybridForCausalLM", layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=8, linear_key_head_dim=8, linear_value_head_dim=8),
    _hf("LongcatFlashForCausalLM", **{**LONGCAT, "num_key_value_heads": 8, "pad_token_id": None}),
    _hf("AXK2ForCausalLM", **{**AXK2, "num_key_value_heads": 8, "pad_token_id": None}),
    _hf("HYV4ForCausalLM", **{**HYV4, "num_key_value_heads": 8, "pad_token_id": None}),
    _hf("DeepseekV4ForCausalLM", **{**DEEPSEEK_V4, "num_attention_heads": 8, "o_groups": 8, "pad_token_id": None}),
    _hf("BeamForCausalLM", **{**BEAM, "pad_token_id": None}),
    _hf("PhiForCausalLM"),
    _hf("GPTNeoXForCausalLM"),
    _hf("GPTNeoXForCausalLM", use_parallel_residual=False, attention_bias=False),
    _hf("OlmoForCausalLM", clip_qkv=8.0),
    _hf("GPTJForCausalLM", rotary_dim=8),
    _hf("GPTBigCodeForCausalLM"),
    _hf("GPTBigCodeForCausalLM", multi_query=False),
    _hf("GPT2LMHeadModel"),
    _hf("OPTForCausalLM", enable_bias=False),
    _hf("FalconForCausalLM"),
    _hf("FalconForCausalLM", new_decoder_architecture=True, num_kv_heads=2, bias=True, tie_word_embeddings=False),
    _hf("PhimoeForCausalLM", num_local_experts=4, attention_bias=True, lm_head_bias=True),
    _hf("LagunaForCausalLM", num_hidden_layers=3, num_attention_heads_per_layer=[8, 16, 8], num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=16, attention_bias=True),
    # its n-gram tables 12 wide: split over 2 ranks, whole on each of 8
    _hf("Qwen4ExpForCausalLM", **{**QWEN4_EXP, "num_key_value_heads": 8, "linear_num_key_heads": 8,
                                  "linear_num_value_heads": 16, "ple_embed_dim": 48, "eos_token_id": 2}),
    _hf("DoryForCausalLM", **{**DORY, "num_key_value_heads": 8, "pad_token_id": None}),
], ids=lambda c: c.architecture)
def test_the_capacity_plans_count_of_a_ranks_weights_is_what_the_rank_builds(config):
    """ShardShape.num_params: what the plan sets aside on each GPU for the weights is what the
    rank's model holds, KV heads replicated past their count (8 ranks, 2 KV heads), the vocab padded."""
    from engine.models import model_class
    from kernels import fused

    for tp in (1, 2, 8):
        for rank in {0, tp - 1}:
            shard = ShardShape.of(config, rank, tp)
            with torch.device("meta"):
                model = model_class(config)(config, shard, None, fused)
            assert shard.num_params(config) == sum(p.numel() for p in model.parameters()), (tp, rank)
    assert ShardShape.of(config).num_params(config) == config.num_params()
    assert ShardShape.of(config, 0, 8).num_params(config) > config.num_params() // 8   # K/V held 4 times


@pytest.mark.parametrize("heads, kv_heads, inter, tp, named", [
    (9, 3, 1536, 2, "does not divide the model's 9 attention heads"),
    (8, 4, 160, 8, None),
    (12, 4, 160, 6, "neither divides nor is a multiple of the model's 4 KV heads"),
    (8, 2, 150, 4, "does not divide the model's intermediate_size 150"),
])
def test_a_model_the_ranks_cannot_split_is_refused_naming_tensor_parallel_size(heads, kv_heads, inter, tp, named):
    model = _model(heads, kv_heads, intermediate_size=inter)
    if named is None:
        check_tensor_parallel(model, tp)
        return
    with pytest.raises(ConfigError, match=f"^tensor_parallel_size: {tp} {named}"):
        check_tensor_parallel(model, tp)


def test_a_rank_not_ready_by_the_deadline_is_named_as_late_not_as_exited():
    """Rank 1 said it is ready, rank 2 has said nothing by the deadline (here at once): rank 2 did not load in
    time. The links' sockets never turn non-blocking past the deadline (rank 2 read as exited before)."""
    import socket

    from engine.parallel import Collectives, PlanLink, TensorParallelGroup

    pairs = [socket.socketpair() for _ in range(2)]
    group = TensorParallelGroup(3, Collectives(), [PlanLink(ours) for ours, _ in pairs])
    try:
        pairs[0][1].sendall(b"R")
        with pytest.raises(RuntimeError, match="tensor-parallel rank 2 did not load within 0 s"):
            group.wait_ready(timeout=0)
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


def test_a_rank_that_fails_to_load_is_named_with_its_own_reason():
    """A follower whose load fails (out of memory, a bad shard) says why on its link before it exits (non-zero):
    rank 0's error (the gateway's StartupError) gives that reason, whether it reads it while waiting for the
    ranks or when it finds the link closed as it sends them their setup. It said nothing before and exited 0:
    rank 0 reported "exited while loading (exit code 0)", the cause only in the follower's log."""
    import socket

    from engine.parallel import Collectives, PlanLink, RankSetup, TensorParallelGroup

    for sending_first in (False, True):
        pairs = [socket.socketpair() for _ in range(2)]
        group = TensorParallelGroup(3, Collectives(), [PlanLink(ours) for ours, _ in pairs])
        try:
            pairs[0][1].sendall(b"R")
            PlanLink(pairs[1][1]).say_failed("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
            pairs[1][1].close()
            with pytest.raises(RuntimeError, match="tensor-parallel rank 2 failed to load: OutOfMemoryError: "
                                                   "CUDA out of memory. Tried to allocate 2.00 GiB$"):
                group.broadcast(RankSetup({})) if sending_first else group.wait_ready(timeout=5)
        finally:
            for ours, theirs in pairs:
                ours.close()
                theirs.close()


def follower_that_cannot_load(*args) -> None:
    """`engine.model_runner.follower_main` whose shard's load fails as a GPU out of memory does (a follower's
    process runs it: `TensorParallelGroup.start`)."""
    import engine.model_runner as runner

    def load(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    runner.FollowerRunner.load = staticmethod(load)
    runner.follower_main(*args)


def follower_that_cannot_start(*args) -> None:
    """A follower rank's process that ends before it joins the group (a driver it cannot open, a bad install)."""
    raise SystemExit(3)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, builtin_path) -> str:
    """The tiny Llama of the tests below that do not compare architectures (read only: one for the module)."""
    return str(make_tiny_model(tmp_path_factory.mktemp("tp") / "llama", "llama", builtin_path))


def test_a_real_follower_that_fails_to_load_exits_non_zero_and_says_why(llama):
    from engine.parallel import TensorParallelGroup

    config = EngineConfig(model=llama, device="cpu", dtype="float32", tensor_parallel_size=2,
                          cache=CacheConfig(block_size=8), pools=(PoolConfig(num_blocks=16),))
    group = TensorParallelGroup.start(config, [torch.device("cpu")] * 2, follower_that_cannot_load)
    try:
        with pytest.raises(RuntimeError, match="rank 1 failed to load: RuntimeError: CUDA out of memory"):
            group.wait_ready(60)
        assert group.processes[0].wait(30) == 1
    finally:
        group.close()


def test_the_groups_store_listens_on_127_0_0_1_alone():
    """Rank 0's store (`engine.rendezvous.serve_store`) listens on the loopback address only, never on every
    interface (as a TCPStore given a host and a port of its own does)."""
    from engine.rendezvous import serve_store

    store = serve_store(2)
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == store.port:   # 0A: LISTEN
                    listening.append(local.rsplit(":", 1)[0])
    assert listening == ["0100007F"]   # 127.0.0.1, little-endian


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "spawned"])
def test_a_follower_that_ends_before_it_joins_fails_the_start_at_once_naming_it(llama, monkeypatch, forked):
    """Rank 0 waits for each follower to say it joined (a key in the group's store) and watches its process meanwhile:
    one that ends first fails the group's start at once, with how it ended, not at the rendezvous's 300 s bound."""
    import time

    import engine.fork_server
    from engine.parallel import TensorParallelGroup

    if not forked:
        monkeypatch.setattr(engine.fork_server, "forks_followers", lambda: False)
    config = EngineConfig(model=llama, device="cpu", dtype="float32", tensor_parallel_size=3,
                          cache=CacheConfig(block_size=8), pools=(PoolConfig(num_blocks=16),))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^tensor-parallel rank 1 of 3 \(pid \d+\) exited before it joined the "
                                           r"group \(exit code 3\)$"):
        TensorParallelGroup.start(config, [torch.device("cpu")] * 3, follower_that_cannot_start)
    assert time.monotonic() - started < 10


def test_the_engine_refuses_it_before_any_rank_starts():
    with pytest.raises(ConfigError, match="^tensor_parallel_size: 2 does not divide the model's 9 attention heads"):
        LLMEngine(EngineConfig(model=BUILTIN, device="cpu", tensor_parallel_size=2,
                               pools=(PoolConfig(num_blocks=64),)), progress=False)


def _engine(model: str, tp: int, num_blocks: int = 256, overlap: bool | None = None, **sched) -> LLMEngine:
    sched.setdefault("max_num_batched_tokens", 64)
    pool = PoolConfig(num_blocks=num_blocks, scheduler=SchedulerConfig(**sched))
    return LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", tensor_parallel_size=tp,
                                  cpu_threads=1, cache=CacheConfig(block_size=16), pools=(pool,),
                                  async_scheduling=overlap),
                     progress=False)


def _generate(engine: LLMEngine, prompts, params: SamplingParams | None = None) -> list:
    """Each prompt's first sample (with `params`: each request's output); then every follower has ended itself, exit
    code 0, on rank 0's `stop` (not killed as one that lingers)."""
    followers = engine.group.processes
    try:
        outs = engine.generate(prompts, params or GREEDY)
        assert_all_free(engine)
    finally:
        engine.close()
    assert [p.returncode for p in followers] == [0] * len(followers)
    return outs if params is not None else [o.outputs[0] for o in outs]


def _assert_same_or_near_tie(reference: list, got: list) -> None:
    """Token-identical, or diverging first at a near-tie of the reference run."""
    for i, (ref, out) in enumerate(zip(reference, got)):
        for pos, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)):
            if a != b:
                (_, lp1), (_, lp2) = ref.top_logprobs[pos][:2]
                assert lp1 - lp2 < NEAR_TIE, (f"prompt {i}: token {pos} is {b} with tensor parallelism, {a} "
                                              f"without, and the top-2 gap {lp1 - lp2:.2e} is no near-tie")
                break
        else:
            assert len(ref.token_ids) == len(out.token_ids)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(8, 70))] for _ in range(5)]


QWEN3 = {"head_dim": 32, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                             "original_max_position_embeddings": 32}}


# llama on two ranks: test_swapped_and_copied_blocks_move_on_every_rank. Not here, each covered by a case that is:
# Qwen2 (its q/k/v biases: ERNIE 4.5's, Cohere's, DeepSeek's), Mistral (a window: Gemma 2's, OLMo 3's...), SmolLM3
# (NoPE layers: Cohere 2's full layers, by the same `no_rope_layers`), OLMo 2 (OLMo 3's layers, one KV head)
@pytest.mark.parametrize("arch,overrides,overlap", [
    ("qwen3", QWEN3, True),
    ("qwen3_moe", {**QWEN3, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "norm_topk_prob": True, "mlp_only_layers": [1]}, None),
    ("mixtral", {"intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2}, True),
    ("phi3", {"pad_token_id": 0, "original_max_position_embeddings": 32, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.15 * i for i in range(6)], "long_factor": [2.0 + 1.7 * i for i in range(6)]}}, None),
    ("gemma2", {"head_dim": 32, "sliding_window": 8, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0},
     None),
    ("granite", {"embedding_multiplier": 3.0, "attention_multiplier": 0.05, "residual_multiplier": 0.5,
                 "logits_scaling": 2.0}, None),
    ("olmo3", {"num_hidden_layers": 4, "sliding_window": 8, "num_key_value_heads": 1}, None),
    ("gemma3", {"num_hidden_layers": 3, "head_dim": 32, "sliding_window": 8, "query_pre_attn_scalar": 24,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}, None),
    ("cohere", {"attention_bias": True, "logit_scale": 0.5, "use_qk_norm": True}, None),
    ("cohere2", {"num_hidden_layers": 4, "sliding_window": 8}, None),
    ("cohere_compass_text", COMPASS, None),
    ("ernie4_5", {"use_bias": True, "head_dim": 16}, None),
    ("glm4", {"head_dim": 32, "pad_token_id": 0}, None),
    ("glm", {"head_dim": 32, "pad_token_id": 0}, None),
    ("qwen2_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 48, "num_key_value_heads": 4}, None),
    ("gpt_oss", {"intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                 "sliding_window": 8, "swiglu_limit": 1.5}, None),
    ("deepseek_v3", {"num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 32, "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": 48,
                     "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_group": 2, "topk_group": 1,
                     "attention_bias": True}, True),
    ("youtu", {"num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16,
               "qk_rope_head_dim": 8, "v_head_dim": 16}, None),
    ("deepseek_v32", {"num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
                      "moe_intermediate_size": 32, "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": 48,
                      "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_group": 2, "topk_group": 1,
                      "index_n_heads": 16, "index_head_dim": 16, "index_topk": 8}, None),
    ("glm_moe_dsa", {"num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 32, "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": 48,
                     "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "num_hidden_layers": 3,
                     "index_n_heads": 16, "index_head_dim": 16, "index_topk": 8,
                     "indexer_types": ["full", "shared", "full"]}, None),
    ("mistral4", {"num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": 48,
                  "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_group": 2, "topk_group": 1,
                  "pad_token_id": 0, "rope_parameters": {
                      "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
                      "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.5}}, None),
    ("minimax_m2", {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 16,
                    "rotary_dim": 8}, None),
    ("llama4", {"intermediate_size": 32, "intermediate_size_mlp": 64, "num_local_experts": 4, "head_dim": 16,
                "num_hidden_layers": 4, "interleave_moe_layer_step": 2, "attention_chunk_size": 8, "floor_scale": 4,
                "attn_scale": 0.5}, None),
    ("ministral3", {"head_dim": 16, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 8,
        "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.5}}, None),
    ("glm4_moe_lite", {"num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
                       "moe_intermediate_size": 32, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16,
                       "qk_rope_head_dim": 8, "v_head_dim": 16, "mlp_layer_types": ["dense", "sparse"]}, None),
    ("granitemoehybrid", {"layer_types": ["attention", "attention"], "num_local_experts": 0,
                          "shared_intermediate_size": 96, "position_embedding_type": "rope",
                          "attention_multiplier": 0.25}, None),
    ("exaone4", {"num_hidden_layers": 4, "sliding_window": 8, "head_dim": 16}, None),
    ("hunyuan_v1_dense", {"head_dim": 16, "rope_parameters": {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                                              "rope_theta": 10000.0}}, None),
    ("hunyuan_v1_moe", {"head_dim": 16, "intermediate_size": 32, "num_experts": 8, "moe_topk": 2}, None),
    ("gptj", {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 512, "rotary_dim": 8, "n_inner": 96}, None),
    ("gpt2", {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 512, "layer_norm_epsilon": 1e-5}, None),
    ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2, "bias": True, "tie_word_embeddings": False,
                "ffn_hidden_size": 96, "layer_norm_epsilon": 1e-5}, None),
    ("opt", {"ffn_dim": 96, "word_embed_proj_dim": 64, "pad_token_id": 0}, None),
    ("codegen", {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 512, "rotary_dim": 8, "n_inner": 96,
                 "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False}, None),
    ("gpt_neo", {"num_hidden_layers": 4, "window_size": 8, "intermediate_size": 96,
                 "attention_types": [[["global", "local"], 2]], "layer_norm_epsilon": 1e-5}, None),
    ("nanochat", {"pad_token_id": 0}, None),
    ("minicpm3", {"q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                  "v_head_dim": 16, "num_key_value_heads": 4, "dim_model_base": 16, "pad_token_id": 0}, None),
    ("glm4_moe", {**GLM4_MOE, "use_qk_norm": True, "attention_bias": True, "num_key_value_heads": 4}, None),
    ("ernie4_5_moe", {"moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 32, "moe_num_shared_experts": 1,
                      "num_hidden_layers": 3}, None),
    ("olmoe", {"intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "clip_qkv": 0.5}, None),
    ("apertus", {"head_dim": 16}, None),
    ("apertus1p5_text", {"head_dim": 16, "output_vocab_size": 301}, None),
    ("granitemoehybrid", {"layer_types": ["mamba", "attention", "mamba"], "num_hidden_layers": 3,
                          "num_local_experts": 0, "shared_intermediate_size": 96, "mamba_n_heads": 4,
                          "mamba_d_state": 16, "mamba_n_groups": 2, "position_embedding_type": "rope"}, None),
    ("nemotron_h", {"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"], "head_dim": 16,
                    "mamba_num_heads": 4, "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 2, "chunk_size": 16,
                    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "moe_shared_expert_intermediate_size": 48, "n_group": 2, "topk_group": 1, "moe_latent_size": 16,
                    "routed_scaling_factor": 2.5, "pad_token_id": 0}, None),
    ("olmo_hybrid", {"num_hidden_layers": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                     "linear_key_head_dim": 16, "linear_value_head_dim": 8, "pad_token_id": 0}, None),
    ("longcat_flash", LONGCAT, None),
    ("bamba", {"attn_layer_indices": [1], "num_hidden_layers": 3, "mamba_n_heads": 4, "mamba_d_state": 16,
               "mamba_n_groups": 2}, None),
    ("starcoder2", {"sliding_window": 8}, None),
    ("nemotron", {"attention_bias": True, "mlp_bias": True}, None),
    ("stablelm", {"use_qkv_bias": True, "use_parallel_residual": True, "qk_layernorm": True}, None),
    ("vaultgemma", {"head_dim": 32, "sliding_window": 8, "attn_logit_softcapping": 2.0}, None),
    ("laguna", {"num_hidden_layers": 3, "head_dim": 16, "num_attention_heads_per_layer": [4, 8, 4], "num_experts": 8,
                "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                "moe_router_logit_softcapping": 2.0}, None),
    ("laguna", {"num_hidden_layers": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32, "gating": "per-element"}, None),
    ("mellum", {"num_hidden_layers": 3, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32, "sliding_window": 8, "mlp_layer_types": ["dense", "sparse", "sparse"],
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}, None),
    ("hyperclovax", {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "logits_scaling": 2.0}, None),
    ("falcon_h1", {"num_hidden_layers": 2, "mamba_n_heads": 4, "mamba_d_ssm": 64, "mamba_d_head": 16,
                   "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_rms_norm": True, "projectors_bias": True,
                   "key_multiplier": 1.3, "ssm_multipliers": [0.5, 1.5, 0.75, 1.25, 2.0],
                   "mlp_multipliers": [0.6, 1.4]}, None),
    ("granitemoehybrid", {"layer_types": ["mamba", "attention"], "num_local_experts": 4, "num_experts_per_tok": 2,
                          "intermediate_size": 32, "shared_intermediate_size": 48, "mamba_n_heads": 4,
                          "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_proj_bias": True}, None),
    ("qwen3_5", {"num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                 "linear_key_head_dim": 16, "linear_value_head_dim": 8}, True),
    ("qwen3_next", {"num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                    "linear_key_head_dim": 16, "linear_value_head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "mlp_only_layers": [2]}, None),
    ("lfm2", {"num_hidden_layers": 3, "full_attn_idxs": [1], "conv_bias": True, "block_multiple_of": 16,
              "norm_eps": 1e-5}, None),
    ("axk1", {**DEEPSEEK, "q_lora_rank": 24}, None),
    ("axk2", {**AXK2, "n_group": 2, "topk_group": 1}, None),
    ("hy_v4", HYV4, None),
    ("deepseek_v4", DEEPSEEK_V4, None),
    ("beam", BEAM, None),
    ("helium", {"head_dim": 16, "attention_bias": True}, None),
    ("phi", {"partial_rotary_factor": 0.5, "layer_norm_eps": 1e-5}, None),
    ("gpt_neox", {"layer_norm_eps": 1e-5}, None),
    ("gpt_bigcode", {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 512, "layer_norm_epsilon": 1e-5}, None),
    ("dbrx", {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 512, "pad_token_id": 0,
              "attn_config": {"kv_n_heads": 2, "clip_qkv": 0.5, "rope_theta": 10000.0},
              "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}}, None),
    ("flex_olmo", {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "norm_topk_prob": True,
                   "pad_token_id": 0}, None),
    ("falcon_mamba", {"num_hidden_layers": 2, "state_size": 8, "time_step_rank": 8, "use_bias": True,
                      "pad_token_id": 0}, None),
    ("mamba2", {"num_hidden_layers": 2, "num_heads": 4, "head_dim": 32, "state_size": 16, "n_groups": 2,
                "chunk_size": 16, "pad_token_id": 0}, None),
    ("zamba2", {"num_hidden_layers": 4, "layers_block_type": ["linear_attention", "hybrid", "hybrid", "hybrid"],
                "mamba_d_state": 16, "n_mamba_heads": 4, "mamba_ngroups": 2, "num_mem_blocks": 2,
                "use_shared_attention_adapter": True, "adapter_rank": 8, "num_key_value_heads": 4,
                "add_bias_linear": True, "pad_token_id": 0}, None),
    ("falcon", {"layer_norm_epsilon": 1e-5}, None),
    ("phimoe", {"num_local_experts": 8, "intermediate_size": 32, "attention_bias": True, "lm_head_bias": True,
                "router_jitter_noise": 0.5}, None),
    ("flint", {"num_hidden_layers": 3, "head_dim": 16, "sliding_window": 8, "num_experts": 8, "num_experts_per_tok": 2,
               "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "intermediate_size": 96,
               "mlp_only_layers": [0]}, None),
    ("kolibri1", {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "head_dim": 16,
                  "sliding_window": 8, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48, "norm_topk_prob": True}, None),
    ("lfm3", {"num_hidden_layers": 4, "layer_types": ["conv", "sliding_attention", "full_attention", "conv"],
              "head_dim": 16, "sliding_window": 8, "norm_eps": 1e-5, "pad_token_id": 0}, None),
    ("dots1", {"num_hidden_layers": 3, "head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
               "moe_intermediate_size": 32, "n_shared_experts": 2, "first_k_dense_replace": 1, "sliding_window": 8,
               "max_window_layers": 2}, None),
    ("solar_open", {"head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "attention_bias": True, "pad_token_id": 0}, None),
    ("arcee", {"mlp_bias": True}, None),
    ("jais2", {}, None),
    ("hy_v3", {"num_hidden_layers": 3, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
               "moe_intermediate_size": 32, "num_shared_experts": 1, "router_scaling_factor": 1.5}, None),
    ("granitemoeshared", {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                          "shared_intermediate_size": 48}, None),
    ("granite_swa", {"num_hidden_layers": 4, "sliding_window": 8, "attention_multiplier": 0.05,
                     "layer_rope_theta": [10000.0, 0, 500.0, 10000.0]}, None),
    ("afmoe", {"num_hidden_layers": 4, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32,
               "num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1, "global_attn_every_n_layers": 2,
               "sliding_window": 8, "mup_enabled": True, "pad_token_id": 0}, None),
    ("kimi_linear", {"num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
                     "mlp_layer_types": ["dense", "sparse", "sparse"], "intermediate_size": 96,
                     "moe_intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "kv_lora_rank": 32,
                     "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "linear_head_dim": 16,
                     "linear_num_heads": 4, "num_key_value_heads": 4, "pad_token_id": 0}, None),
    ("bailing_hybrid", BAILING, None),
    ("lfm2_moe", {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"], "intermediate_size": 96,
                  "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_dense_layers": 1,
                  "norm_eps": 1e-5}, None),
    ("jamba", {"num_hidden_layers": 3, "intermediate_size": 96, "num_experts": 4, "attn_layer_period": 2,
               "attn_layer_offset": 1, "mamba_d_state": 8, "mamba_dt_rank": 8, "mamba_proj_bias": True,
               "pad_token_id": 0}, None),
    ("mimo_v2_flash", {"num_hidden_layers": 3, "head_dim": 32, "v_head_dim": 16, "num_key_value_heads": 1,
                       "sliding_window": 8, "n_routed_experts": 8, "num_experts_per_tok": 2,
                       "moe_intermediate_size": 32, "attention_bias": True, "pad_token_id": 0}, None),
    ("exaone_moe", {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": 8, "num_experts": 8,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_shared_experts": 1,
                    "pad_token_id": 0}, None),
    ("cohere2_moe", {**COHERE2_MOE, "rms_norm_eps": None}, None),
    ("gemma4", GEMMA4, None),
    ("gemma4", GEMMA4_MOE, True),
    ("gemma4", GEMMA4_E, None),
    ("gemma3n_text", GEMMA3N, None),
    ("lara_mini", LARA_MINI, None),
    ("qwen4_exp_text", QWEN4_EXP, None),
    ("dory", DORY, None),
    ("minimax", MINIMAX, None),
    ("minimax_m3_vl_text", MINIMAX_M3, None),
    ("bloom", {"n_layer": 2, "n_head": 4}, None),
    ("mpt", {"n_layers": 2, "n_heads": 4, "d_model": 64, "attn_config": {"clip_qkv": 0.8}}, None),
    ("aria_text", {"intermediate_size": 32, "moe_num_experts": 4, "moe_topk": 2}, None),
    ("persimmon", {"num_attention_heads": 4, "intermediate_size": 128}, None),
])
def test_two_ranks_generate_what_one_does(tmp_path, builtin_path, prompts, arch, overrides, overlap):
    # A tiny random model with even head counts (4 heads, 2 KV heads); Qwen3 q/k head norms (whole on every rank) and
    # YaRN; Qwen3-MoE splits each expert's intermediate size (the router whole on every rank), its layer 1 dense;
    # Mixtral the same on every layer, read from its own tensor names; Phi-3 cuts each rank's heads and rows out of the
    # fused q/k/v and gate/up it stores (Phi-4-mini's rope: q/k rows reordered for a partial longrope); Gemma 2 caps
    # each rank's scores and the gathered logits; Granite scales the summed outputs and embeddings; OLMo 3 norms q and k
    # over every rank's heads (its one KV head on both ranks, counted once) beside its windowed layers; Gemma 3 its q/k
    # head norms whole on each rank and two ropes; GPT-OSS cuts each rank's heads' sinks and each expert's biases (the
    # down one added on rank 0 alone); Qwen2-MoE its shared expert's rows (its gate whole on every rank, the gated
    # partial outputs summed with the experts'); Cohere each rank's heads of the q/k rows it reorders, and o_proj's bias
    # once (Cohere 2 its NoPE full layers); DeepSeek V3 each rank's heads' rows of q and of the latent's up-projection
    # (the latent, its cache and the float32 router whole on every rank); MiniMax-M2 its whole-projection q/k norms'
    # sums of squares over the ranks beside the rows it reorders for its partial rotary (GLM-4.5's parts: Qwen3's head
    # norms, GLM-4's reordered rows, DeepSeek's experts); Llama 4 each rank's heads of its reordered q/k rows, their
    # chunks, its NoPE layers' query temperature on each rank's heads, its experts' and shared expert's rows beside
    # dense layers; Ministral 3 its query scaling on each rank's heads; Apertus each rank's rows of its ungated MLP
    # (xIELU's slopes whole on each); Granite 4-H each rank's Mamba heads and groups (then one group whole on each rank,
    # its gated norm's sums over both, biased projections) beside experts; Gemma 4 each layer's attention in its own
    # shape (the full layers' one KV head on both ranks, V its K projection) and the experts' stacked rows beside each
    # MLP (the E models' per-layer inputs whole on each rank, their shared-K/V layers reading their producers' heads on
    # each rank, double-wide MLPs cut in their width); Qwen3.5 each rank's key heads of its linear layers (their value
    # heads' states on that rank) and each rank's heads' gates; Qwen3-Next the same out of its fused projections, beside
    # experts and a dense layer; MiMo-V2-Flash each layer's attention in its own shape (a full layer's one KV head on
    # both ranks, a sliding layer's two one a rank), V's rows and o_proj's columns in value heads, each rank's heads'
    # sinks; K-EXAONE its per-head q/k norms whole on each rank beside NoPE full layers, its experts' and shared
    # expert's rows; Command A Plus its reordered q/k rows, its experts' rows and its shared expert's averaged partial
    # outputs; Jais 2 its LayerNorms whole on each rank, o_proj's and down_proj's biases added once; Granite SWA each
    # rank's heads' sinks beside per-layer ropes; Granite 3's MoE its stacked experts' and shared MLP's rows; HY V3 its
    # per-head q/k norms whole on each rank, its experts' and shared experts' rows; Jamba each rank's Mamba-1 channels
    # (x_proj's partial products summed over both, the norms of dt, B and C whole on each) beside experts; FalconMamba
    # the same with no attention layer (its "heads" its channels, its KV cache of no layer on either rank); Mamba2 each
    # rank's Mamba-2 heads and groups; Apertus 1.5 its pruned head's rows (301: the second rank's last row padding), the
    # ids past it -inf; Zamba2 its Mamba heads and groups, its shared blocks' heads, MLP rows and adapters' second
    # halves (biased MLPs); Nemotron 3 its Mamba heads and groups, its NoPE heads, its squared-ReLU MLP's rows, its
    # experts' rows in their latent space (Super's: the projections whole on each rank) and shared expert's rows under
    # the router whole on each rank; OLMo Hybrid each rank's key heads of its linear blocks' q, k and convolutions,
    # their value heads' v, gate, b and a (stored apart), OLMo 3's q/k norms over both ranks; LongCat-Flash each rank's
    # heads of its sublayers' latent attention, its dense MLPs' and experts' rows (the zero experts' pass-through added
    # once, after the sum); Hunyuan's MoE, GLM-4.5 and ERNIE 4.5's MoE their experts' rows beside their attention's
    # parts; GPT-J, CodeGen, GPT-2, OPT, GPT-Neo, nanochat, MiniCPM3 and Falcon-40B's form (two norms a layer, its q/k/v
    # grouped by KV head) their layers' heads and rows; A.X-K2 each rank's heads' rows of its fused q and gate, its
    # gated norms whole on each rank; HY V4 each rank's heads' output gates and sinks, its streams' mixes whole on each
    # rank; DeepSeek V4 each rank's heads in whole groups (their o_a_proj rows and o_b_proj columns), its K=V head,
    # compressors, indexer and Sinkhorn-mixed streams whole on each rank; Beam each rank's heads' gate rows and biases
    # beside its experts' rows; Lara Mini Qwen3.5's linear layers' cuts beside its experts' stacked rows; Qwen4-Exp
    # those, its n-gram tables' columns split (gathered after the lookup), its mixes, PLE and QSA whole; Dory each
    # rank's heads' gates and query scales, its MLP rows' scales, the norms over all heads and rows summed over the
    # ranks, its rates and logit scale whole; Gemma 3n Gemma
    # 4's E cuts, its sparse gates' statistics summed over both ranks, AltUp and LAuReL whole on each; MiniMax each
    # rank's lightning heads (their slopes, q/k/v rows and gates; the output norm's sum of squares over both ranks)
    # beside Mixtral's experts; MiniMax M3 each rank's KV heads' indexer heads (their rows of its q projection; its key
    # projection and norms whole on each rank) choosing their blocks; BLOOM each rank's heads' ALiBi slopes, its q/k/v
    # rows out of the fused projection, its embedding's LayerNorm whole; MPT its heads' own slopes and q/k/v rows,
    # clamped; Aria its stacked experts' and shared experts' rows; Persimmon its heads' q/k/v rows, its q/k LayerNorms
    # whole on each rank. Qwen3's, Mixtral's and DeepSeek's groups overlap
    # their steps: the other rank fills the placeholders of each step's inputs from rank 0's sampled ids
    # (engine.overlap). Six tokens each: a wrong cut shows at once, and each step of two gloo ranks costs ~80 ms on a
    # 2-core machine
    path = str(make_tiny_model(tmp_path / arch, arch, builtin_path, **overrides))
    params = dataclasses.replace(GREEDY, max_tokens=6)
    reference = [o.outputs[0] for o in _generate(_engine(path, 1), prompts, params)]
    engine = _engine(path, 2, overlap=overlap)
    assert engine.overlap is bool(overlap)
    _assert_same_or_near_tie(reference, [o.outputs[0] for o in _generate(engine, prompts, params)])


def test_every_rank_resumes_a_cached_prefix_from_the_state_kept_with_it(tmp_path, builtin_path):
    """Qwen3.5 on two ranks with overlapped steps: each rank keeps its key heads' snapshots (`engine.state_cache`) in
    the same slots as rank 0's plans say, and copies them into a sequence's row before the step that resumes it. A
    system prompt before three users' messages (the third resumes from the state the second kept at the prompt's
    end) and the second user's prompt again: what one rank generates."""
    from tests.engine.test_engine_vs_hf import QWEN3_5

    path = str(make_tiny_model(tmp_path / "qwen3_5", "qwen3_5", builtin_path, **QWEN3_5))
    rng = random.Random(5)
    system = [rng.randrange(3, 500) for _ in range(37)]
    prompts = [system + [rng.randrange(3, 500) for _ in range(n)] for n in (12, 20, 7)]
    prompts.append(prompts[1])
    params = dataclasses.replace(GREEDY, max_tokens=6)
    runs = {}
    for tp in (1, 2):
        engine = _engine(path, tp, overlap=tp == 2)
        try:
            runs[tp] = [engine.generate([p], params)[0].outputs[0] for p in prompts]   # one after another
            assert engine.schedulers["default"].state_snapshots.num_loaded == 2
            assert_all_free(engine)
        finally:
            engine.close()
    _assert_same_or_near_tie(runs[1], runs[2])


def test_swapped_and_copied_blocks_move_on_every_rank(llama, prompts):
    # 10 blocks of 16 tokens: the five prompts together do not fit, so victims are swapped out and in,
    # and the other rank must move its shard of their blocks exactly as rank 0 does; with overlapped
    # steps, whose placeholders it fills from rank 0's sampled ids.
    # Each prompt's logprobs too: the other rank computes the logits of the same prompt rows (their gather
    # pairs up) and rank 0's equal one rank's.
    params = dataclasses.replace(GREEDY, prompt_logprobs=2)
    reference = _generate(_engine(llama, 1), prompts, params)
    engine = _engine(llama, 2, num_blocks=10, overlap=True, preemption_mode="swap", swap_space_bytes=1 << 20)
    got = _generate(engine, prompts, params)
    assert engine.schedulers["default"].stats.num_swap_preemptions > 0
    _assert_same_or_near_tie([o.outputs[0] for o in reference], [o.outputs[0] for o in got])
    for ref, out in zip(reference, got):
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs), torch.tensor(ref.prompt_logprobs),
                                   atol=1e-4, rtol=0)


@pytest.mark.slow   # model-size: the tiny models' two ranks of each architecture, and three served ranks run by default
def test_three_ranks_of_the_builtin_model_generate_what_one_does(builtin_path):
    # SmolLM2-135M: 9 heads and 3 KV heads, one KV head per rank.
    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
               "Explain in one sentence why the sky is blue."]
    reference = _generate(_engine(BUILTIN, 1), prompts)
    engine = _engine(BUILTIN, 3)
    assert engine.kv_cache.data.shape[4] == 1   # this rank's KV heads
    _assert_same_or_near_tie(reference, _generate(engine, prompts))


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def rank0_that_forks_its_followers(model: str) -> None:
    """Rank 0 of a group in a process of its own that runs the fork server (as this one does: tests/conftest.py):
    say its follower's pid, serve a request, then wait to be killed."""
    import sys
    import time

    from engine.fork_server import start_fork_server

    start_fork_server()
    engine = _engine(model, 2)
    out = engine.generate([[5, 6, 7, 8]], dataclasses.replace(GREEDY, max_tokens=4))[0].outputs[0]
    print(engine.group.processes[0].pid, len(out.token_ids), flush=True)
    sys.stdout.close()
    time.sleep(120)


def test_followers_forked_from_the_fork_server_die_with_rank_0s_process(llama):
    """A process that runs the fork server forks its followers from it (`engine.fork_server.start_follower`): the
    follower is the server's child, not rank 0's, and serves as a spawned one does; when rank 0's process is killed
    (-9), the server ends with it and the follower with the server (`PR_SET_PDEATHSIG`)."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    command = [sys.executable, "-c", "from tests.engine.test_tensor_parallel import rank0_that_forks_its_followers; "
                                     f"rank0_that_forks_its_followers({llama!r})"]
    rank0 = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        follower, generated = map(int, rank0.stdout.readline().split())
        assert generated == 4
        assert follower not in _children(rank0.pid)
        assert any(follower in _children(child) for child in _children(rank0.pid))   # the fork server's child
    finally:
        rank0.kill()
        rank0.wait()
    deadline = time.monotonic() + 10
    while _alive(follower) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(follower)


@dataclasses.dataclass(frozen=True)
class _MarkArgs:
    """What `start_follower` hands a follower: its rank and link, and here a file to write."""

    rank: int
    link_fd: int
    path: str


def follower_that_writes_its_environment(args: _MarkArgs) -> None:
    import os
    from pathlib import Path

    Path(args.path).write_text(os.environ.get("CLIFFGUARD_TEST_MARK", "unset"))


def test_a_forked_follower_runs_under_rank_0s_environment_not_the_fork_servers(tmp_path, monkeypatch):
    """The fork server keeps the environment it started with (tests/conftest.py starts it first): a follower forked
    from it takes rank 0's as it is when it forks (a backend variable set since: both ranks' kernels alike)."""
    import socket

    from engine.fork_server import forks_followers, start_follower

    assert forks_followers()
    monkeypatch.setenv("CLIFFGUARD_TEST_MARK", "set since the server started")
    ours, theirs = socket.socketpair()
    with ours, theirs:
        process = start_follower(follower_that_writes_its_environment, _MarkArgs(1, -1, str(tmp_path / "env")), theirs)
        assert process.wait(60) == 0
    assert (tmp_path / "env").read_text() == "set since the server started"


def test_a_killed_worker_takes_its_other_ranks_with_it(llama):
    import asyncio
    import os
    import signal
    import time

    from engine.client import AsyncEngineClient

    config = EngineConfig(model=llama, device="cpu", dtype="float32", tensor_parallel_size=2, cpu_threads=1,
                          pools=(PoolConfig(num_blocks=64),))

    async def scenario() -> list[int]:
        client = AsyncEngineClient(config)
        info = await client.start()
        assert info.tensor_parallel_size == 2
        outs = [o async for o in client.generate([5, 6, 7, 8], SamplingParams(max_tokens=4, ignore_eos=True))]
        assert outs[-1].finished and outs[-1].outputs[0].num_tokens == 4
        followers = _children(client.pid)
        assert len(followers) == 1
        os.kill(client.pid, signal.SIGKILL)
        await client.died
        return followers

    followers = asyncio.run(scenario())
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in followers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in followers)


def test_a_hung_rank_fails_the_step_within_the_collective_timeout_and_a_dead_one_is_reported(llama):
    """Plans travel on the followers' links, so only a step's collectives can time out: a follower stopped
    with SIGSTOP fails rank 0's next step after `collective_timeout_seconds`; a follower killed is reported
    through `on_rank_exit` (the device worker makes that its own death) with how its process ended."""
    import os
    import signal
    import time

    config = EngineConfig(model=llama, device="cpu", dtype="float32", tensor_parallel_size=2, cpu_threads=1,
                          collective_timeout_seconds=2, pools=(PoolConfig(num_blocks=64),))
    engine = LLMEngine(config, progress=False)
    lost: list[str] = []
    engine.group.on_rank_exit = lost.append   # the default ends the process: this one is pytest
    follower = engine.group.processes[0]
    try:
        engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=2, ignore_eos=True))
        os.kill(follower.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(RuntimeError):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - started < 10
        assert not lost
        os.kill(follower.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while not lost and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lost == [f"tensor-parallel rank 1 of 2 (pid {follower.pid}) exited (signal 9, SIGKILL)"]
    finally:
        engine.close()


@pytest.mark.parametrize("wrapper", ["step3p7", "muse_glimmer", "muse_spark"])
def test_two_ranks_serve_a_vision_checkpoints_text_model_as_one_does(tmp_path, builtin_path, prompts, wrapper):
    """Step 3.7's text model from its release's layout (transformers' tiny `Step3p7ForConditionalGeneration`, its
    vision tower beside it, not read): each rank its sliding and full layers' own query heads and their sigmoid
    gates, the q/k Gemma norms whole, the experts' and shared expert's rows under their clamps; Muse Glimmer's: each
    rank its heads' gate rows (`gate_proj` cut as q_proj), the weightless q/k norms a head; Muse Spark's: its experts'
    rows, each (token, expert) row summed over the ranks before its norm; what one rank generates."""
    import shutil

    from tests.engine.test_multimodal_text import vision_checkpoint

    _, folder = vision_checkpoint(tmp_path, wrapper)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_path / name, folder / name)
    params = dataclasses.replace(GREEDY, max_tokens=6)
    reference = [o.outputs[0] for o in _generate(_engine(str(folder), 1), prompts, params)]
    _assert_same_or_near_tie(reference, [o.outputs[0] for o in _generate(_engine(str(folder), 2), prompts, params)])
