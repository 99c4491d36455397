"""Gateway fixtures: a tiny random model with the builtin tokenizer, pool files, live servers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import make_tiny_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, builtin_path) -> Path:
    """A 2-layer random Llama with the builtin SmolLM2 tokenizer (and its full vocabulary)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gateway"), "llama", builtin_path,
                           vocab_size=49152, max_position_embeddings=1024)


def pools_yaml(model: Path | str, *, chat_max: int = 64, rag_kv: str = "kv_share: 0.3", api_keys: str = "[]",
               max_body: str = "1MiB", extra_pools: str = "") -> str:
    return f"""
gateway: {{api_keys: {api_keys}, max_body_bytes: {max_body}}}
devices:
  cpu: {{device: cpu, memory: 256MiB, dtype: float32}}
pools:
  - name: chat
    model: {model}
    device: cpu
    route: {{max_prompt_tokens: {chat_max}}}
    kv_share: 0.3
    avg_len: 128
    max_model_len: 512
  - name: rag
    model: {model}
    device: cpu
    route: {{min_prompt_tokens: {chat_max + 1}}}
    {rag_kv}
    avg_len: 256
    max_model_len: 512
{extra_pools}"""


class LiveServer:
    """`cliffguard serve` in a subprocess on an ephemeral port."""

    def __init__(self, config_path: Path, timeout: float = 180) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path), "--host", "127.0.0.1",
             "--port", "0"], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        deadline = time.monotonic() + timeout
        self.url = None
        while self.url is None:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("cliffguard serve exited:\n" + "".join(self.log))
            self.log.append(line)
            match = re.search(r"serving on (http://\S+) ", line)
            if match:
                self.url = match.group(1)
            if time.monotonic() > deadline:
                raise TimeoutError("".join(self.log))
        # keep draining stderr so the server never blocks on a full pipe
        import threading

        threading.Thread(target=self._drain, daemon=True).start()
        while True:
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("server never became ready:\n" + "".join(self.log))
            time.sleep(0.2)

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


DEFAULT_CONFIG = REPO / "config" / "pools.yaml"


@pytest.fixture(scope="session")
def live_builtin_server():
    """`cliffguard serve` on the default config/pools.yaml (what `make serve` starts), shared by the session."""
    server = LiveServer(DEFAULT_CONFIG)
    yield server
    server.stop()
