"""Compute isolation, as a user sees it: one long rag prompt in flight must raise an idle chat
request's time to first token by at most chat's TTFT target (the isolation cliff reproduced on
small lengths: the builtin model in a device worker, chat and rag pools on one CPU device).

The control run gives chat no SLO (plain chunked prefill, each pool fills its own 2048-token budget):
there the same chat request waits for a whole rag chunk, which shows the test can fail."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from engine.config import CacheConfig, EngineConfig, LatencySLO, PoolConfig, SchedulerConfig
from engine.sampling import SamplingParams
from engine.client import AsyncEngineClient

SLO = LatencySLO(ttft_ms=800, itl_ms=100)
CHAT = SamplingParams(temperature=0, max_tokens=2)


def _make_config(builtin_path, slo: LatencySLO | None) -> EngineConfig:
    sched = SchedulerConfig(max_num_seqs=8, max_model_len=4096, max_num_batched_tokens=2048)
    # 256 MiB of SmolLM2's float32 K/V (46,080 B/token) = 364 blocks of 16 tokens, split 30/70
    pools = (PoolConfig(name="chat", num_blocks=109, scheduler=sched, slo=slo),
             PoolConfig(name="rag", num_blocks=254, scheduler=sched))
    # float32 whatever the CPU (`auto` may be bfloat16): the loads below are sized to its step times
    return EngineConfig(model=str(builtin_path), dtype="float32", cache=CacheConfig(block_size=16), pools=pools)


async def _ttft(client: AsyncEngineClient, prompt: list[int]) -> float:
    started = time.perf_counter()
    async for out in client.generate(prompt, CHAT, pool="chat"):
        if out.outputs and out.outputs[0].delta_token_ids:
            return time.perf_counter() - started
    raise AssertionError("the chat request produced no token")


async def _ttft_increase(config: EngineConfig) -> float:
    """Chat TTFT with a 3,000-token rag prompt in flight, minus the same request's TTFT when idle."""
    rng = random.Random(0)
    chat = [rng.randrange(100, 40000) for _ in range(40)]
    rag = [rng.randrange(100, 40000) for _ in range(3000)]
    async with AsyncEngineClient(config) as client:
        await _ttft(client, chat[::-1])                       # warm-up (first steps, cost-model data)
        idle = min([await _ttft(client, chat[i:] + chat[:i]) for i in (1, 2)])
        rag_task = asyncio.create_task(_drain(client.generate(rag, SamplingParams(max_tokens=8), pool="rag")))
        await asyncio.sleep(1.5)                              # the rag prefill is under way
        loaded = await _ttft(client, chat[3:] + chat[:3])
        rag_task.cancel()
        await asyncio.gather(rag_task, return_exceptions=True)
    return loaded - idle


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_a_long_rag_prompt_raises_idle_chat_ttft_by_at_most_its_slo(builtin_path):
    increase = asyncio.run(_ttft_increase(_make_config(builtin_path, SLO)))
    assert increase <= SLO.ttft_ms / 1000, f"chat TTFT rose by {increase:.2f} s with a rag prompt in flight"


@pytest.mark.slow   # the live control run; tests/pools/test_composer_replay.py shows it on recorded step costs
def test_without_an_slo_chat_waits_for_a_whole_rag_chunk(builtin_path):
    increase = asyncio.run(_ttft_increase(_make_config(builtin_path, None)))
    assert increase > SLO.ttft_ms / 1000, f"chunk-only scheduling raised chat TTFT by only {increase:.2f} s"
