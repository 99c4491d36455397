"""pools.device_memory: the headroom `memory_utilization` leaves a GPU, against what sampling holds there."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.penalties import MIN_ROWS, PenaltyCounts, table_bytes
from engine.sampler import SAMPLE_BYTES_PER_LOGIT, SAMPLE_CHUNK_ELEMENTS, sampling_memory_bytes
from engine.sampling import SamplingParams, SamplingRow
from pools.capacity_plan import plan_capacity
from pools.config.yaml_file import parse_config
from pools.device_memory import CUDA_CONTEXT_BYTES, headroom_warning
from pools.model_configs import resolve_model_configs

GiB = 1 << 30
VOCAB = 151_936   # Qwen2.5's


def _plan(memory: str, utilization: float = 0.9, device: str = "cuda", **chat):
    """SmolLM2's shape with Qwen2.5's vocabulary: a small model with a large vocabulary, chat and rag."""
    data = {"devices": {"default": {"device": device, "memory": memory, "memory_utilization": utilization}},
            "pools": [{"name": "chat", "model": "builtin:smollm2-135m-instruct", "route": {"max_prompt_tokens": 512},
                       "kv_share": 0.5, "avg_len": 512, "max_model_len": 2048, **chat},
                      {"name": "rag", "model": "builtin:smollm2-135m-instruct", "route": {"min_prompt_tokens": 513},
                       "kv_share": 0.5, "avg_len": 2048, "max_model_len": 2048}]}
    config = parse_config(data, env={})
    models = {m: _with_vocab(c) for m, c in resolve_model_configs(config).items()}
    return plan_capacity(config, models)


def _with_vocab(model):
    return dataclasses.replace(model, vocab_size=VOCAB)


def _headroom_warnings(plan) -> list[str]:
    return [w for w in plan.warnings if ".memory_utilization:" in w]


def test_a_small_model_with_a_large_vocabulary_is_warned_of_where_sampling_outgrows_the_headroom():
    plan = _plan("24GiB")
    chat, rag = plan.pools["chat"], plan.pools["rag"]
    rows = min(chat.max_num_seqs, 2048) + min(rag.max_num_seqs, 2048)
    need = CUDA_CONTEXT_BYTES + sampling_memory_bytes(rows, VOCAB, 2) + table_bytes(
        chat.max_num_seqs + rag.max_num_seqs, VOCAB)
    assert need > 24 * GiB - int(0.9 * 24 * GiB)   # the case: this much cannot fit 2.4 GiB
    [warning] = _headroom_warnings(plan)
    assert warning.startswith("devices.default.memory_utilization: 0.9 leaves 2.40 GiB per GPU")
    assert f"a step of {rows} rows of {VOCAB} logits" in warning and "lower memory_utilization" in warning
    # room for it: a lower utilization, or fewer sequences a step and fewer running
    assert _headroom_warnings(_plan("24GiB", utilization=0.8)) == []
    assert _headroom_warnings(_plan("80GiB")) == []


def test_every_cuda_plan_at_full_utilization_is_warned_and_a_cpu_plan_never():
    [warning] = _headroom_warnings(_plan("80GiB", utilization=1))
    assert warning.startswith("devices.default.memory_utilization: 1 leaves 0 B per GPU")
    assert _headroom_warnings(_plan("4GiB", utilization=1, device="cpu")) == []


def test_the_estimate_is_the_sum_of_its_parts():
    device = parse_config({"devices": {"default": {"device": "cuda", "memory": "10GiB"}},
                           "pools": [{"name": "p", "model": "builtin:smollm2-135m-instruct", "kv_share": 1.0}]},
                          env={}).devices["default"]
    headroom = 10 * GiB - int(0.9 * 10 * GiB)
    pools = [(3000, 2048), (100, 4096)]   # 3000 running sequences, at most 2048 a step; and 100

    def need(vocab: int) -> int:
        return CUDA_CONTEXT_BYTES + sampling_memory_bytes(2148, vocab, 2) + table_bytes(3100, vocab)

    assert need(1000) <= headroom < need(30_000)
    assert headroom_warning(device, 10 * GiB, 1000, 2, pools) is None
    warning = headroom_warning(device, 10 * GiB, 30_000, 2, pools)
    assert f"{sampling_memory_bytes(2148, 30_000, 2) / 2**20:.2f} MiB to sample a step of 2148 rows" in warning
    assert f"{table_bytes(3100, 30_000) / 2**20:.2f} MiB of token counts while its 3100 sequences" in warning
    assert sampling_memory_bytes(2148, 1000, 2) == 2148 * 1000 * 2 + SAMPLE_BYTES_PER_LOGIT * 2148 * 1000
    assert sampling_memory_bytes(10 ** 6, 1000, 2) == 2 * 10 ** 9 + SAMPLE_BYTES_PER_LOGIT * SAMPLE_CHUNK_ELEMENTS


@pytest.mark.parametrize("rows", [1, MIN_ROWS, MIN_ROWS + 1, 40, 64, 65])
def test_the_penalty_table_never_holds_more_than_table_bytes(rows, monkeypatch):
    """Its capacity and, while it grows, the old table beside the new: never past `table_bytes`."""
    vocab = 50
    counts = PenaltyCounts(vocab, "cpu")
    peak = [0]
    real_zeros = torch.Tensor.new_zeros

    def held() -> int:
        return counts.counts.numel() * 4 + counts.in_prompt.numel()

    def zeros(self, *size, **kwargs):   # a table about to be made: what is held now, and it
        made = real_zeros(self, *size, **kwargs)
        peak[0] = max(peak[0], held() + made.numel() * made.element_size())
        return made

    monkeypatch.setattr(torch.Tensor, "new_zeros", zeros)
    params = SamplingParams(repetition_penalty=1.2)
    counts.rows([SamplingRow(params, None, 0, frozenset(), token_ids=[1, 2], key=k) for k in range(rows)])
    assert counts.counts.shape[0] >= rows and held() <= table_bytes(rows, vocab)
    assert peak[0] <= table_bytes(rows, vocab)
    capacity = counts.counts.shape[0]
    assert table_bytes(rows, vocab) == 5 * vocab * (capacity + (capacity // 2 if capacity > MIN_ROWS else 0))
