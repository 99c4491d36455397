"""The builtin model served with `kv_cache_dtype: fp8` (config/pools.yaml with the device key set), asked
through the openai SDK: four times the KV blocks of the float32 cache from the same bytes, and greedy chat
answers the same as the default server's on most questions; and a tiny model served with `quantization: fp8`,
answering as its FP8-rounded weights do; GPT-OSS's MXFP4 experts and DeepSeek V3's INT4 experts (Kimi K2's kind)
served held as stored."""

from __future__ import annotations

import asyncio

import openai
import pytest
import yaml

from bench.kvcache import CHAT_QUESTIONS
from tests.gateway.conftest import DEFAULT_CONFIG, LiveServer

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def fp8_server(tmp_path_factory):
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config["devices"]["default"].update(kv_cache_dtype="fp8", dtype="float32")   # the default server's dtype
    path = tmp_path_factory.mktemp("fp8") / "pools.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    with LiveServer(path) as server:
        yield server


async def _answers(url: str) -> list[str]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        async def ask(question: str) -> str:
            reply = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=8)
            return reply.choices[0].message.content
        return list(await asyncio.gather(*map(ask, CHAT_QUESTIONS)))


def _blocks(url: str) -> dict[str, int]:
    model = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0).models.retrieve(MODEL)
    return {pool["name"]: pool["num_blocks"] for pool in model.model_extra["pools"]}


@pytest.mark.slow   # model-size: the builtin model served twice, ~21 s; the default run serves an FP8 cache only
# through tiny models (tests/engine/test_kv_fp8.py, tests/kernels/test_triton*.py)
def test_served_with_an_fp8_cache_four_times_the_blocks_and_most_answers_the_same(fp8_server, live_builtin_server):
    """Most of the 20 questions (at least 11) answered identically over 8 tokens: 12-15 measured on 2026-11-28
    over seven rounds, concurrent and one at a time (with an FP8 cache an answer may turn on how its request was
    batched and what the prefix cache held; the float32 cache's answers never moved). Longer answers drift
    further apart: docs/PERF.md, "FP8 KV cache"."""
    fp8_blocks, default_blocks = _blocks(fp8_server.url), _blocks(live_builtin_server.url)
    assert fp8_blocks.keys() == default_blocks.keys() == {"chat", "rag"}
    for pool, blocks in default_blocks.items():   # float32 -> e4m3: a quarter of the bytes a block
        assert fp8_blocks[pool] >= 3.9 * blocks
    assert any("FP8 KV cache: scales measured" in line for line in fp8_server.log)
    fp8, default = asyncio.run(_answers(fp8_server.url)), asyncio.run(_answers(live_builtin_server.url))
    assert all(default) and all(fp8)
    assert sum(a == b for a, b in zip(default, fp8)) >= 11


def test_a_device_with_quantization_fp8_serves_its_weights_quantized_a_row_at_a_time(tmp_path, builtin_path):
    """The device key `quantization: fp8` in a pool file reaches the engine: a tiny float model served through it
    answers (through the openai SDK, greedy) what transformers answers with each layer's projections quantized a row
    at a time and dequantized back, which here differs from the float model's own answers."""
    import torch
    import transformers

    from tests.conftest import make_tiny_model
    from tests.engine.test_engine_vs_hf import _hf_greedy
    from tests.engine.test_fp8_weights import _round_rows

    folder = make_tiny_model(tmp_path / "tiny", "llama", builtin_path, vocab_size=49152, max_position_embeddings=1024,
                             initializer_range=0.1)
    prompts = [[5, 9, 200, 31, 7], list(range(40, 60)), [1000, 2000, 3000]]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    plain = [_hf_greedy(hf, p, 16, eos_ids=None) for p in prompts]
    _round_rows(hf)
    rounded = [_hf_greedy(hf, p, 16, eos_ids=None) for p in prompts]
    assert rounded != plain   # the weights' rounding shows in the answers
    _served_answers(tmp_path, folder, "fp8", prompts, rounded)


def test_a_device_with_quantization_mxfp4_serves_gpt_oss_experts_held_as_stored(tmp_path, builtin_path):
    """`quantization: mxfp4` in a pool file reaches the engine: a tiny GPT-OSS checkpoint with MXFP4 experts, served
    with them held as stored (the server's log says so), answers (through the openai SDK, greedy) what transformers
    answers over the dequantized checkpoint."""
    from tests.engine.test_engine_vs_hf import mxfp4_gpt_oss

    folder, hf, _ = mxfp4_gpt_oss(tmp_path / "gpt_oss", builtin_path, vocab_size=49152, max_position_embeddings=1024)
    _served_as_transformers(tmp_path, folder, hf, "mxfp4", "experts of 3 layers held in MXFP4 as stored")


def test_a_device_with_quantization_int4_serves_int4_experts_held_as_stored(tmp_path, builtin_path):
    """`quantization: int4`: a tiny DeepSeek V3 checkpoint whose routed experts are pack-quantized INT4 (Kimi K2
    Thinking's kind), served with them held as stored, answers (through the openai SDK, greedy) what transformers
    answers over the weights the format defines."""
    pytest.importorskip("compressed_tensors")
    import torch
    import transformers

    from tests.conftest import make_tiny_model
    from tests.engine.test_engine_vs_hf import DEEPSEEK
    from tests.engine.test_int4_weights import int4_checkpoint

    folder = make_tiny_model(tmp_path / "kimi", "deepseek_v3", builtin_path, **DEEPSEEK, vocab_size=49152,
                             max_position_embeddings=1024)
    hf = transformers.AutoModelForCausalLM.from_pretrained(int4_checkpoint(folder, experts_only=True),
                                                           dtype=torch.float32).eval()
    _served_as_transformers(tmp_path, folder, hf, "int4", "experts of 2 layers held in INT4 as stored")


def _served_as_transformers(tmp_path, folder, hf, quantization: str, logged: str) -> None:
    """The model in `folder` served with `quantization` answers two prompts (greedy, through the openai SDK) as
    transformers' model `hf` does, and the server's log says `logged`."""
    from tests.engine.test_engine_vs_hf import _hf_greedy

    prompts = [[5, 9, 200, 31, 7], list(range(40, 60))]
    _served_answers(tmp_path, folder, quantization, prompts, [_hf_greedy(hf, p, 12, eos_ids=None) for p in prompts],
                    logged)


def _served_answers(tmp_path, folder, quantization: str, prompts, want, logged: str | None = None) -> None:
    """The model in `folder`, served (a chat pool) with the device's `quantization`, completes each prompt greedily
    with the text of its `want` tokens (as many, through the openai SDK); the server's log says `logged` if given."""
    from engine.tokenizer import Tokenizer
    from tests.gateway.conftest import chat_pool_yaml

    (path := tmp_path / "pools.yaml").write_text(chat_pool_yaml(folder, device_keys=f"quantization: {quantization}"))
    tokenizer = Tokenizer.from_folder(folder)
    with LiveServer(path) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        for prompt, tokens in zip(prompts, want):
            reply = client.completions.create(model=folder.name, prompt=prompt, max_tokens=len(tokens), temperature=0,
                                              extra_body={"ignore_eos": True})
            assert reply.choices[0].text == tokenizer.decode(tokens)
        assert logged is None or any(logged in line for line in server.log)
