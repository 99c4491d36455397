"""What a device worker's start costs: a restart is a new process, so every second of the load is a
second the device is down. The model is built without torch's compiler stack, the CPU KV tensor is
zeroed by the OS page by page, and the engine reports where its load went."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from engine.config import CacheConfig, EngineConfig, PoolConfig
from engine.model_config import ModelConfig
from engine.kv_cache import KVCache
from engine.llm_engine import LLMEngine
from tests.conftest import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]

BUILD_IN_A_FRESH_PROCESS = """
import sys
from pathlib import Path
import torch
from engine.model_config import ModelConfig
from engine.models import build_model
config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=160,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
model = build_model(config, torch.float32, "cpu")
assert model.embed_tokens.weight.shape == (1000, 64) and model.rotary_emb.cos_sin_cache.device.type == "cpu"
print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
"""


def test_building_the_model_imports_no_compiler_stack():
    # Before: nn.Embedding's random init and the rope frequencies ran torch's Python meta kernels on the
    # meta device, whose first use imports torch._dynamo and sympy: 1.5 s of every worker's start.
    out = subprocess.run([sys.executable, "-c", BUILD_IN_A_FRESH_PROCESS], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_the_cpu_kv_tensor_is_zeroed_without_being_written():
    model = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=512, intermediate_size=1024,
                        num_layers=8, num_heads=8, num_kv_heads=8, head_dim=64)
    before = _rss_bytes()
    cache = KVCache(model, num_blocks=1024, block_size=16, dtype=torch.float32, device="cpu")
    grown = _rss_bytes() - before
    assert cache.num_bytes == 512 << 20
    assert grown < 64 << 20            # torch.zeros wrote all 512 MiB (and took 0.1 s per 512 MiB) first
    for layer in (0, 7):
        k, v = cache.layers[layer]
        assert not k[::97].any() and not v[1::89].any()
    k, v = cache.layers[3]
    k[5, 2].fill_(1.5)
    cache.copy_blocks([(5, 9)])
    assert cache.layers[3][0][9, 2].eq(1.5).all() and cache.data[3, 0, 9].sum().item() == 1.5 * 8 * 64


def test_the_engine_reports_where_its_load_went(tmp_path, builtin_path):
    folder = make_tiny_model(tmp_path, "llama", builtin_path)
    config = EngineConfig(model=str(folder), cache=CacheConfig(block_size=8), pools=(PoolConfig(num_blocks=64),))
    engine = LLMEngine(config, progress=False)
    assert list(engine.load_phases) == ["weights", "kv", "kernels", "schedulers", "warm-up", "slo"]
    assert engine.load_phases["weights"] > 0   # reading the shards takes time; the others may round to 0
    # each phase is rounded to the millisecond (`engine.stats.Laps`): their sum may pass the total by as much
    assert sum(engine.load_phases.values()) <= engine.load_seconds + 0.0005 * len(engine.load_phases)
