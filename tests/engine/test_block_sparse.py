"""MiniMax M3's block-sparse layers in the engine: the indexer keys the KV cache keeps beside their K/V (copied and
swapped with their blocks, counted in S_KV), and a prompt prefilled in chunks picking the blocks it picks whole."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KVCache, SwapSpace
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.sampling import SamplingParams
from tests.conftest import assert_all_free, make_tiny_model
from tests.engine.test_engine_vs_hf import (MINIMAX_M3, _hf_greedy, assert_preempted_batch_answers,
                                             preempting_engine)

SMALL = {"architectures": ["MiniMaxM3VLForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 32,
         "dense_intermediate_size": 96, "shared_intermediate_size": 48, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
         "num_experts_per_tok": 2, "index_n_heads": 2, "index_head_dim": 16,
         "layer_types": ["full_attention", "minimax_m3_sparse", "full_attention", "minimax_m3_sparse"]}


def test_the_indexer_keys_lie_in_the_cache_and_move_with_their_blocks():
    """A sparse layer's cache entry is (K, V, its indexer keys), the keys a tensor among the cache's, so a block copy
    and a swap out and back in move them with the K/V; the cache's bytes are S_KV's. An FP8 cache keeps the keys in
    bfloat16 (its S_KV counts them so), and its swap space the same."""
    config = ModelConfig.from_hf_config(SMALL)
    cache = KVCache(config, num_blocks=6, block_size=4, dtype=torch.float32, device="cpu")
    assert [len(entry) for entry in cache.layers] == [2, 3, 2, 3]
    assert tuple(cache.tensors[-1].shape) == (2, 1, 6, 4, 1, 16) and cache.layers[3][2].shape == (6, 4, 1, 16)
    assert cache.num_bytes == 6 * 4 * config.kv_bytes_per_token(torch.float32)
    for tensor in cache.tensors:
        tensor.copy_(torch.randn(tensor.shape))
    before = [tensor.clone() for tensor in cache.tensors]
    cache.copy_blocks([(1, 4)])
    assert torch.equal(cache.layers[1][2][4], before[-1][0, 0, 1])
    swap = SwapSpace(cache, num_blocks=3)
    swap.swap_out([(2, 0)])
    for tensor in cache.tensors:
        tensor[:, :, 2] = 0
    swap.swap_in([(0, 5)])
    assert torch.equal(cache.layers[3][2][5], before[-1][1, 0, 2])
    fp8 = KVCache(config, num_blocks=6, block_size=4, dtype=torch.float8_e4m3fn, device="cpu")
    assert [t.dtype for t in fp8.tensors] == [torch.float8_e4m3fn, torch.bfloat16]
    # 4 layers' K and V of 2 heads of 16, a byte each; 2 sparse layers' keys of 16 in bfloat16
    assert fp8.num_bytes == 6 * 4 * config.kv_bytes_per_token(torch.float8_e4m3fn)
    assert config.kv_bytes_per_token(torch.float8_e4m3fn) == 4 * 2 * 2 * 16 + 2 * 16 * 2
    assert [t.dtype for t in SwapSpace(fp8, num_blocks=2).tensors] == [torch.float8_e4m3fn, torch.bfloat16]


@pytest.mark.usefixtures("one_thread")
def test_a_prompt_prefilled_in_chunks_attends_to_the_blocks_it_would_whole(tmp_path, builtin_path):
    """A 70-token prompt in chunks of 16 (blocks of 4 keys, the best 2 a query): each chunk's queries pick among the
    blocks the sequence holds so far, which is what they pick over the whole prompt (a later block is never theirs);
    the tokens are transformers'. Then the same prompt again, its first blocks cached: the same tokens."""
    import transformers

    folder = make_tiny_model(tmp_path / "m3", "minimax_m3_vl_text", builtin_path, **MINIMAX_M3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, max_num_batched_tokens=16,
                                 progress=False)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 512, (70,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = _hf_greedy(hf, prompt, 12, eos_ids=None)
    assert engine.generate([prompt], params)[0].outputs[0].token_ids == expected
    assert engine.generate([prompt], params)[0].outputs[0].token_ids == expected
    assert engine.schedulers["default"].block_manager.num_prefix_hits >= 64
    assert_all_free(engine)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_sequences_resume_with_their_indexer_keys(tmp_path, builtin_path, mode):
    """Six sequences on 12 blocks preempt one another, recomputed or swapped out and back (their indexer keys with
    their K/V): each answers as transformers does."""
    import transformers

    folder = make_tiny_model(tmp_path / "m3", "minimax_m3_vl_text", builtin_path, **MINIMAX_M3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert_preempted_batch_answers(preempting_engine(folder, mode), hf, torch.Generator().manual_seed(3), mode)
