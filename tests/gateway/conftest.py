"""Gateway fixtures: a tiny random model with the builtin tokenizer, pool files, live servers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from bench.live import LiveServer
from tests.conftest import make_tiny_model

__all__ = ["DEFAULT_CONFIG", "LiveServer", "chat_pool_yaml", "pools_yaml", "start_gateway"]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, builtin_path) -> Path:
    """A 2-layer random Llama with the builtin SmolLM2 tokenizer (and its full vocabulary)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gateway"), "llama", builtin_path,
                           vocab_size=49152, max_position_embeddings=1024)


def pools_yaml(model: Path | str, *, chat_max: int = 64, rag_kv: str = "kv_share: 0.3", api_keys: str = "[]",
               max_body: str = "1MiB", extra_pools: str = "", device_keys: str = "") -> str:
    """Two pools of `model` on one CPU device: `chat` (prompts up to `chat_max` tokens) with config/pools.yaml's
    explicit SLO, whose worker starts ~0.5 s sooner than one that measures a derived SLO (`chat_pool_yaml`'s
    pool derives one), and `rag`. `device_keys`: more keys of the device (`tensor_parallel_size: 3, ...`)."""
    return f"""
gateway: {{api_keys: {api_keys}, max_body_bytes: {max_body}}}
devices:
  cpu: {{device: cpu, memory: 256MiB, dtype: float32{", " + device_keys if device_keys else ""}}}
pools:
  - name: chat
    model: {model}
    device: cpu
    route: {{max_prompt_tokens: {chat_max}}}
    kv_share: 0.3
    avg_len: 128
    max_model_len: 512
    slo: {{ttft_ms: 1000, itl_ms: 100}}
  - name: rag
    model: {model}
    device: cpu
    route: {{min_prompt_tokens: {chat_max + 1}}}
    {rag_kv}
    avg_len: 256
    max_model_len: 512
{extra_pools}"""


def chat_pool_yaml(model: Path | str, *, gateway: str = "{}", max_model_len: int = 128, extra: str = "",
                   device_keys: str = "") -> str:
    """One CPU pool `chat` of 256 KiB of KV (the tiny model: 32 blocks of 16 tokens), `gateway` as given;
    `extra` is more YAML lines of the pool (indented like its keys), `device_keys` more keys of the device
    (`replicas: 2, cpu_threads: 1`)."""
    return f"""
gateway: {gateway}
devices:
  cpu: {{device: cpu, memory: 256MiB, dtype: float32{", " + device_keys if device_keys else ""}}}
pools:
  - name: chat
    model: {model}
    device: cpu
    kv_cache_bytes: 256KiB
    avg_len: 64
    max_model_len: {max_model_len}
{extra}"""


DEFAULT_CONFIG = REPO / "config" / "pools.yaml"


@pytest.fixture(scope="session")
def lltokenizer(builtin_path):
    """llguidance's view of the builtin tokenizer (what the engine's matchers use)."""
    import llguidance

    from engine.tokenizer import Tokenizer

    return llguidance.LLTokenizer(Tokenizer.from_folder(builtin_path).to_json())


def accepts(lltokenizer, constraint, text: str) -> bool:
    """Whether `text` (as the tokenizer splits it) is a whole output the grammar of `constraint` (a
    `StructuredOutput`) allows, token by token as llguidance's matcher reads it."""
    import llguidance

    matcher = llguidance.LLMatcher(lltokenizer, constraint.grammar_text(), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    tokens = lltokenizer.tokenize_str(text)
    if matcher.validate_tokens(tokens) < len(tokens):
        return False
    matcher.consume_tokens(tokens)
    return matcher.is_accepting()


@pytest.fixture(scope="session")
def live_builtin_server(tmp_path_factory):
    """`cliffguard serve` on the default config/pools.yaml (what `make serve` starts) in float32, shared by the
    session; `config_path` is the file it serves. Float32 whatever the CPU: `auto` may be bfloat16, whose greedy
    answers can move where a request finds its prefix cached, and these tests compare a whole answer with the
    same request streamed."""
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config["devices"]["default"]["dtype"] = "float32"
    path = tmp_path_factory.mktemp("builtin-server") / "pools.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    server = LiveServer(path)
    server.config_path = path
    yield server
    server.stop()


async def start_gateway(aiohttp_client, tmp_path: Path, text: str, data_dir: Path | None = None):
    """(test client, Gateway) of an in-process app over the pool file `text` (keeping batches and responses in
    `data_dir`, if given), once it is ready."""
    from gateway.app import create_app
    from gateway.runtime import Gateway
    from pools.config.yaml_file import load_config

    path = tmp_path / "pools.yaml"
    path.write_text(text)
    gateway = Gateway.from_config(load_config(path))
    client = await aiohttp_client(create_app(gateway, data_dir=data_dir), server_kwargs={"handler_cancellation": True})
    for _ in range(600):
        if (await client.get("/ready")).status == 200:
            return client, gateway
        await asyncio.sleep(0.1)
    raise TimeoutError("never ready")
