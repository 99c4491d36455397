"""The whole engine on the Triton kernels (through Triton's interpreter on the CPU) gives the same greedy
tokens as on the torch reference: prefill, chunked prefill mixed with decode, preemption, n > 1."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import random

import pytest

pytest.importorskip("triton")

from engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from tests.conftest import assert_all_free, make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, builtin_path):
    # head_dim 16 (4 heads over 64), GQA 2: small enough for the interpreter
    return make_tiny_model(tmp_path_factory.mktemp("tiny-triton"), "llama", builtin_path)


def _engine(path, backend: str, monkeypatch, **sched) -> LLMEngine:
    monkeypatch.setenv("CLIFFGUARD_ATTENTION_BACKEND", backend)
    sched.setdefault("max_num_batched_tokens", 24)  # chunked prefill: chunks start mid-block
    config = EngineConfig(model=str(path), cache=CacheConfig(block_size=8),
                          pools=(PoolConfig(num_blocks=12, scheduler=SchedulerConfig(**sched)),))
    engine = LLMEngine(config, progress=False)
    assert ("triton" in engine.runner.backend.paged_attention.__module__) == (backend == "triton")
    return engine


def test_engine_on_triton_kernels_matches_the_reference(tiny, monkeypatch):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 19, 33, 47)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 3 + \
             [SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)]
    results = {}
    for backend in ("torch", "triton"):
        engine = _engine(tiny, backend, monkeypatch)
        outs = engine.generate(prompts, params)
        results[backend] = [[o.token_ids for o in out.outputs] for out in outs]
        assert engine.schedulers["default"].stats.num_preemptions > 0  # 12 blocks of 8: under pressure
        assert_all_free(engine)
    assert results["triton"] == results["torch"]
