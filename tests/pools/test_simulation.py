"""`cliffguard simulate`: the step-time models, the device simulation driving the real schedulers
(exact times under a linear model, credits that prevent preemption, integrity at the end), replicas
behind one credit queue, and the CLI on the seed's Llama-3-70B example."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.calibration import measure_steps
from engine.config import PoolConfig, SchedulerConfig
from engine.model_config import ModelConfig
from engine.scheduler_output import ScheduledSeq
from engine.roofline import PRESETS, RooflineStepTime
from engine.step_cost import (KNEE_MIN_STEPS, LinearStepTime, StepCostModel, StepFeatures, fit_linear, nonnegative_lstsq,
                              read_step_model, read_step_trace, write_step_model)
from gateway.cli import main
from pools.capacity_plan import plan_capacity
from pools.model_configs import read_model_config
from pools.config.spec import SpecError
from pools.config.yaml_file import load_config
from pools.simulation.devicesim import DeviceSim, SimRequest
from pools.simulation.knee import format_sweep, plot_knee, sweep
from pools.simulation.recommend import format_recommendation, recommend
from pools.simulation.devicesim import ReplicaGroup
from pools import demand
from pools.plan_report import plan_verdicts
from pools.simulation.runner import make_requests, shared_layout, simulate, workload_mix
from pools.simulation.summary import format_summary, overload_verdicts, summarize
from pools.workload import LengthDist, SharedPrefix, WorkloadClass

ROOT = Path(__file__).resolve().parents[2]
LLAMA_70B = ROOT / "config" / "examples" / "llama-3-70b"
TINY = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096)


class _Seq:
    """What the roofline reads of a scheduled sequence."""

    def __init__(self, num_computed_tokens: int) -> None:
        self.num_computed_tokens = num_computed_tokens


def _step(roofline: RooflineStepTime, *, decodes: int = 0, context: int = 1000, prefill: int = 0) -> float:
    batch, features = [], StepFeatures()
    for _ in range(decodes):
        batch.append(ScheduledSeq(_Seq(context), 1))
        features.add(context, 1, True)
    if prefill:
        batch.append(ScheduledSeq(_Seq(0), prefill))
        features.add(0, prefill, False)
    return roofline.seconds(batch, features, decodes + (1 if prefill else 0))


def test_roofline_decode_is_memory_bound_and_prefill_compute_bound():
    model = read_model_config(LLAMA_70B)
    tp8 = RooflineStepTime(PRESETS["h100"], model, 2, tp=8)
    one, many = _step(tp8, decodes=1), _step(tp8, decodes=64)
    assert one < many < 1.5 * one                        # decode: the weights stream once for the batch
    weights_s = model.num_params() * 2 / 8 / (3.35e12 * 0.8)
    assert weights_s < one < weights_s + 0.01
    short, long = _step(tp8, prefill=1024), _step(tp8, prefill=8192)
    assert long > 6 * short                               # prefill: FLOPs grow with the tokens
    tp1 = RooflineStepTime(PRESETS["h100"], model, 2, tp=1)
    assert _step(tp1, prefill=8192) > 5 * long            # 8 GPUs share the FLOPs, less the all-reduces
    assert _step(RooflineStepTime(PRESETS["h200"], model, 2, tp=8), decodes=64) < many   # more bandwidth


def test_the_roofline_computes_a_mixture_of_experts_with_its_routed_experts_and_an_fp8_cache_at_a_byte():
    """Qwen3-30B-A3B computes each token with 8 of its 128 experts: its FLOPs per token are its 3.3 B activated
    parameters (Qwen's count: 30.5 B in all), not every expert's, and a decode of one token reads a sixteenth
    of the experts where a batch of 64 reads nearly all. An FP8 cache's K/V is a byte an element."""
    from engine.roofline import step_flops

    model = read_model_config(str(ROOT / "config" / "examples" / "qwen3-30b-a3b"))
    assert 30.4e9 < model.num_params() < 30.6e9
    activated = step_flops(model, 1, 0, 1) / 2 + model.vocab_size * model.hidden_size   # with the embedding
    assert 3.2e9 < activated < 3.45e9, activated
    roofline = RooflineStepTime(PRESETS["h200"], model, 2)
    overhead = PRESETS["h200"].step_overhead_s
    one, batch = _step(roofline, decodes=1) - overhead, _step(roofline, decodes=64) - overhead
    all_weights_s = model.num_params() * 2 / (4.8e12 * 0.8)
    assert one < 0.25 * all_weights_s and 0.9 * all_weights_s < batch < 1.2 * all_weights_s
    prefill_s = _step(roofline, prefill=2048)
    assert prefill_s < 0.05, prefill_s                     # every expert computing each token: 0.21 s
    fp8 = RooflineStepTime(PRESETS["h200"], model, 2, kv_dtype_bytes=1)
    assert 2 * fp8.kv_bytes_per_token == roofline.kv_bytes_per_token == model.kv_bytes_per_token(torch.bfloat16)
    from pools.model_configs import resolve_model_configs
    from pools.simulation.runner import device_step_times

    config = load_config(ROOT / "config" / "examples" / "qwen3-32b-2xh100-fp8.yaml")   # kv_cache_dtype: fp8
    models = resolve_model_configs(config)
    plan = plan_capacity(config, models, vram_bytes=80 * 2**30)
    [(name, step)] = device_step_times(plan, models, preset="h100").items()
    assert step.kv_bytes_per_token == plan.devices[name].kv_bytes_per_token   # a byte an element


def test_the_roofline_reads_each_gpus_kv_heads_where_tp_exceeds_them():
    """Qwen3-30B-A3B has 4 KV heads: on 8 GPUs each holds one (replicated, as the capacity plan counts them),
    so a decode reads a head's K/V on each, not half of one."""
    model = read_model_config(str(ROOT / "config" / "examples" / "qwen3-30b-a3b"))
    assert model.num_kv_heads == 4
    per_head = 2 * model.num_layers * model.head_dim * 2
    assert RooflineStepTime(PRESETS["h100"], model, 2, tp=8).kv_bytes_per_token / 8 == per_head
    assert RooflineStepTime(PRESETS["h100"], model, 2, tp=2).kv_bytes_per_token / 2 == 2 * per_head


def test_the_roofline_reads_a_sliding_window_layers_window_only():
    """A sliding-window layer (Mistral's every layer, Gemma 3's five of six) attends and reads its last window of
    keys, as the kernel starts there: a decode at 32k context read each such layer's whole context (a Gemma 3
    27B decode step at 32k came out 3.6x too slow). Windowed prefill pairs: a token attends at most the window."""
    from engine.roofline import _attended_in_window

    assert _attended_in_window(0, 5, 3) == 1 + 2 + 3 + 3 + 3 and _attended_in_window(10, 1, 4) == 4
    assert _attended_in_window(2, 3, 100) == 3 * 2 + 6   # the window past the context: all of it
    model = dataclasses.replace(TINY, max_position_embeddings=65536, num_layers=6)
    overhead = PRESETS["h200"].step_overhead_s

    def decode_s(config) -> float:
        return _step(RooflineStepTime(PRESETS["h200"], config, 2), decodes=64, context=32768) - overhead

    full = decode_s(model)
    every = decode_s(dataclasses.replace(model, sliding_window=1024))
    five_of_six = decode_s(dataclasses.replace(model, sliding_window=1024, layer_types=(
        "sliding_attention",) * 5 + ("full_attention",)))
    assert every == pytest.approx(full * 1024 / 32768, rel=0.05)   # its K/V is nearly all the step reads
    half = StepFeatures()
    for _ in range(32):
        half.add(32768, 1, True)
    blind = StepFeatures(*(getattr(half, k) for k in ("num_prefill_tokens", "num_decode_tokens", "num_attended",
                                                        "num_keys_read")))   # a trace's: no spans, full attention
    windowed = RooflineStepTime(PRESETS["h200"], dataclasses.replace(model, sliding_window=1024), 2)
    assert windowed.seconds([], blind.plus(half), 64) - overhead == pytest.approx((full + every) / 2, rel=0.05)
    assert five_of_six == pytest.approx(full * (1 + 5 * 1024 / 32768) / 6, rel=0.05)


def test_the_roofline_of_sparse_attention_reads_the_chosen_latents_and_every_indexer_key():
    """DeepSeek V3.2's sparse attention (DeepseekV32Config's shape, TP 8, an FP8 cache): a decode (memory-bound) reads
    every earlier token's indexer key and the latent rows of at most index_topk (2,048) of them, where the same rows
    all attended would read whole rows of all: below 2,048 tokens the same bytes, at 32k about a quarter of them;
    64 such decodes take under 0.8 of the time (the experts' weights, read whatever the context, are the rest)."""
    v32 = ModelConfig.from_hf_config({"architectures": ["DeepseekV32ForCausalLM"]})
    dense = dataclasses.replace(v32, mla=dataclasses.replace(v32.mla, index_topk=0))   # the same rows, all attended
    sparse, full = RooflineStepTime(PRESETS["h200"], v32, 2, 8, 1), RooflineStepTime(PRESETS["h200"], dense, 2, 8, 1)
    row, index = 8 * 61 * 704, 8 * 61 * 128   # a token's bytes on the 8 GPUs (the latent cache whole on each)
    assert (full.kv_bytes_per_token, sparse.index_bytes_per_token) == (row, index)
    bandwidth = PRESETS["h200"].memory_bandwidth * PRESETS["h200"].bandwidth_efficiency
    for context in (1000, 32768):
        step = StepFeatures()
        step.add(context, 1, True)
        read = context * index + min(context, 2048) * (row - index)
        assert sparse.seconds([], step, 1) - full.seconds([], step, 1) == pytest.approx(
            (read - context * row) / 8 / bandwidth, rel=1e-6, abs=1e-12)
    batch = StepFeatures()   # 64 decodes at 32k
    for _ in range(64):
        batch.add(32768, 1, True)
    assert sparse.seconds([], batch, 64) < 0.8 * full.seconds([], batch, 64)


def _sim(pools: list[PoolConfig], step_time: LinearStepTime, *, credits: bool = True) -> DeviceSim:
    return DeviceSim(pools, block_size=16, max_model_lens={p.name: 1024 for p in pools}, step_time=step_time,
                     kv_bytes_per_token=TINY.kv_bytes_per_token(torch.bfloat16), credits=credits)


def _pool(name: str = "chat", *, num_blocks: int = 256, max_num_seqs: int = 64, budget: int = 2048,
          mode: str = "recompute") -> PoolConfig:
    return PoolConfig(name=name, num_blocks=num_blocks, scheduler=SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=1024, preemption_mode=mode))


def test_one_request_times_are_exactly_the_linear_model():
    sim = _sim([_pool()], LinearStepTime(a=0.01, b=0.001, c=0.002, d=0.0))
    request = SimRequest("r0", "chat", arrival=1.5, prompt_len=100, output_len=10, pool="chat")
    sim.run([request])
    assert request.finished and request.error is None
    assert request.ttft == pytest.approx(0.01 + 100 * 0.001)
    assert request.itls == pytest.approx([0.01 + 0.002] * 9)
    assert sim.clock == pytest.approx(1.5 + 0.11 + 9 * 0.012)
    assert sim.schedulers["chat"].block_manager.num_free_blocks == 256


def test_chunked_prefill_spreads_a_long_prompt_over_steps():
    sim = _sim([_pool(budget=256)], LinearStepTime(a=0.01, b=0.001, c=0.0, d=0.0))
    request = SimRequest("r0", "rag", arrival=0.0, prompt_len=1000, output_len=2, pool="chat")
    sim.run([request])
    assert sim.num_steps == 4 + 1                          # 256 + 256 + 256 + 232, then one decode
    assert request.ttft == pytest.approx(4 * 0.01 + 1000 * 0.001)


def _flood(n: int) -> list[SimRequest]:
    return [SimRequest(f"r{i}", "chat", arrival=0.01 * i, prompt_len=200, output_len=300, pool="chat")
            for i in range(n)]


def test_credits_prevent_preemption_that_an_overcommitted_pool_suffers():
    """32 blocks of 16 tokens hold one 500-token request's worst case; with 8 sequences admitted at
    once by the scheduler alone they outgrow the blocks and preempt each other."""
    step = LinearStepTime(a=0.01, b=0.0001, c=0.001, d=0.0)
    with_credits = _sim([_pool(num_blocks=64, max_num_seqs=8)], step)
    requests = _flood(12)
    with_credits.run(requests)
    assert all(r.finished for r in requests)
    assert with_credits.schedulers["chat"].stats.num_preemptions == 0

    without = _sim([_pool(num_blocks=64, max_num_seqs=8)], step, credits=False)
    requests = _flood(12)
    without.run(requests)
    assert all(r.finished for r in requests)
    assert without.schedulers["chat"].stats.num_preemptions > 0
    assert without.schedulers["chat"].stats.num_recomputed_tokens > 0


@pytest.mark.parametrize("limit", [0.0, 0.5, 4.0])
def test_a_request_waiting_for_credits_past_max_queue_seconds_fails_as_the_gateway_answers_it(limit):
    """With 0 a request that does not fit at once is refused (429); with 0.5 s one still waiting then fails
    (503): neither is served late and counted as served, and the others all are. With 4 s the next two are
    admitted while they wait (a run takes about 3.6 s), the rest fail."""
    step = LinearStepTime(a=0.01, b=0.0001, c=0.001, d=0.0)
    pools = [_pool(num_blocks=64, max_num_seqs=8)]
    group = ReplicaGroup(pools, block_size=16, max_queue={"chat": limit})
    sim = DeviceSim(pools, block_size=16, max_model_lens={"chat": 1024}, step_time=step,
                    kv_bytes_per_token=TINY.kv_bytes_per_token(torch.bfloat16), group=group)
    requests = _flood(12)   # 64 blocks hold two 500-token requests' worst cases: the others queue
    sim.run(requests)
    failed = [r for r in requests if r.error is not None]
    assert failed and all(r.finished for r in requests if r.error is None)
    assert all(r.admitted - r.arrival <= limit + 0.05 for r in requests if r.admitted is not None)   # a step
    assert {r.error.split(":")[0] for r in failed} == {"429" if limit == 0 else "503"}
    assert sim.group.ledgers["chat"].num_queued == 0 and not sim.group._queued
    waited = [r for r in requests if r.admitted is not None and r.admitted - r.arrival > 1.0]
    assert bool(waited) == (limit == 4.0)


def test_an_arrival_during_the_step_that_ends_a_request_finds_its_credits_still_held():
    """1 s steps, KV for one request at a time, `max_queue_seconds: 0`: A runs from 0 to 2 s; B, arriving at
    1.5 s, is refused as the gateway refuses it then (A's credits come back at 2 s, when its last step ends);
    C, at 2.5 s, is served."""
    pools = [_pool(num_blocks=8, max_num_seqs=8)]
    group = ReplicaGroup(pools, block_size=16, max_queue={"chat": 0.0})
    sim = DeviceSim(pools, block_size=16, max_model_lens={"chat": 1024}, step_time=LinearStepTime(a=1.0, b=0.0,
                    c=0.0, d=0.0), kv_bytes_per_token=TINY.kv_bytes_per_token(torch.bfloat16), group=group)
    a, b, c = (SimRequest(name, "chat", arrival=at, prompt_len=100, output_len=2, pool="chat")
               for name, at in (("a", 0.0), ("b", 1.5), ("c", 2.5)))
    sim.run([a, b, c])
    assert a.finished and a.error is None and a.token_times == pytest.approx([1.0, 2.0])
    assert b.error is not None and b.error.startswith("429") and b.admitted is None
    assert c.finished and c.error is None and c.admitted == pytest.approx(2.5)


def test_swap_mode_moves_blocks_and_charges_the_copy_time():
    step = LinearStepTime(a=0.01, b=0.0001, c=0.001, d=0.0, swap_bandwidth=1e6)
    pool = PoolConfig(name="chat", num_blocks=64, scheduler=SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=1024, preemption_mode="swap",
        swap_space_bytes=64 << 20))
    sim = _sim([pool], step, credits=False)
    requests = _flood(12)
    sim.run(requests)
    stats = sim.schedulers["chat"].stats
    assert all(r.finished for r in requests)
    assert stats.num_swap_preemptions > 0 and stats.num_swapped_in_blocks > 0 and stats.preempt_seconds > 0
    # the copies take the clock's time, not the forward passes' the composer learns from (as the engine's)
    assert stats.preempt_seconds > 1.0
    # preempt_seconds also holds the scheduler's own time choosing what to preempt, measured on this host (as
    # the engine's is): a few ms at most, which the simulated clock never sees (1.3 ms on a slow VM, 2026-12-02)
    assert 0 <= stats.preempt_seconds - (sim.clock - sim.composer.stats.busy_seconds) < 0.05
    # a copy's latency, measured beside the bandwidth, is charged per batched copy and priced by `auto`
    slow = _sim([pool], dataclasses.replace(step, swap_latency=0.5), credits=False)
    assert slow.schedulers["chat"].cost_model.swap_latency_seconds == 0.5
    slow.run(_flood(12))
    slow_stats = slow.schedulers["chat"].stats
    copies = slow_stats.num_swap_preemptions * 2   # at most: each out, and back in (a step's moves go together)
    moved = (slow_stats.num_swapped_out_blocks + slow_stats.num_swapped_in_blocks) * slow.bytes_per_block / 1e6
    assert slow_stats.num_swap_preemptions > 0
    assert moved + 2 * 0.5 <= slow_stats.preempt_seconds <= moved + copies * 0.5 + 1e-6


def test_a_request_that_can_never_fit_is_an_error_not_a_hang():
    sim = _sim([_pool(num_blocks=8)], LinearStepTime(a=0.01, b=0.0, c=0.0, d=0.0))
    too_big = SimRequest("big", "chat", arrival=0.0, prompt_len=900, output_len=100, pool="chat")
    fine = SimRequest("ok", "chat", arrival=0.0, prompt_len=10, output_len=5, pool="chat")
    sim.run([too_big, fine])
    assert too_big.error and "blocks" in too_big.error and not too_big.finished
    assert fine.finished


def test_simulate_routes_by_prompt_length_and_summarizes():
    config = load_config(ROOT / "config" / "examples" / "llama3-70b-8xh100.yaml")
    model = read_model_config(LLAMA_70B)
    models = {config.pools[0].model: model}                   # one folder for both pools
    plan = plan_capacity(config, models, vram_bytes=80 << 30)
    classes = (WorkloadClass("chat", prompt_len=LengthDist("fixed", value=300),
                             output_len=LengthDist("fixed", value=20), share=0.8),
               WorkloadClass("rag", prompt_len=LengthDist("fixed", value=6000),
                             output_len=LengthDist("fixed", value=20), share=0.2))
    requests = make_requests(classes, 4.0, duration=10.0, seed=1)
    step = {"h100x8": RooflineStepTime(PRESETS["h100"], model, 2, tp=8)}
    result = simulate(config, plan, models, requests, step)
    assert {r.pool for r in requests if r.cls == "chat"} == {"chat"}
    assert {r.pool for r in requests if r.cls == "rag"} == {"rag"}
    summary = summarize(result)
    assert summary["classes"]["chat"]["finished"] == summary["classes"]["chat"]["requests"] > 10
    assert summary["classes"]["rag"]["ttft"]["p50"] > summary["classes"]["chat"]["ttft"]["p50"]
    assert 0 < summary["pools"]["rag"]["kv_usage_max"] <= 1


def test_cli_simulate_prints_json(capsys):
    code = main(["simulate", "--config", str(ROOT / "config" / "examples" / "llama3-70b-8xh100.yaml"),
                 "--model-config", str(LLAMA_70B), "--duration", "5", "--request-rate", "2", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["classes"]["chat"]["finished"] > 0 and set(out["pools"]) == {"chat", "rag"}
    assert out["simulated_seconds"] >= 2.5 and out["steps"] > 0
    verdict = out["overload"]["h100x8"]
    assert verdict["step_model"] == "roofline h100" and not verdict["overloaded"] and set(verdict["pools"]) == {"chat", "rag"}
    assert verdict["pools"]["chat"]["rate"] == pytest.approx(out["classes"]["chat"]["requests"] / 5)   # all routed to chat
    assert main(["simulate", "--duration", "0"]) == 2


def test_shared_layout_merges_each_device_pools_with_the_same_capacity():
    config = load_config(ROOT / "config" / "examples" / "llama3-70b-8xh100.yaml")
    models = {config.pools[0].model: read_model_config(LLAMA_70B)}
    plan = plan_capacity(config, models, vram_bytes=80 << 30)
    shared = shared_layout(config, plan)
    shared_plan = plan_capacity(shared, models, vram_bytes=80 << 30)
    (pool,) = shared_plan.pools.values()
    assert pool.name == "shared" and pool.spec.route.admits(1) and pool.spec.route.admits(8000, 8192)
    assert pool.max_num_seqs == sum(p.max_num_seqs for p in plan.pools.values())
    assert abs(pool.num_blocks - sum(p.num_blocks for p in plan.pools.values())) <= 1
    assert pool.spec.max_num_batched_tokens == 8192 and pool.spec.slo is None


def test_sweep_gives_one_row_per_layout_and_rate_and_plots_the_knee(tmp_path):
    config = load_config(ROOT / "config" / "examples" / "llama3-70b-8xh100.yaml")
    model = read_model_config(LLAMA_70B)
    models = {config.pools[0].model: model}
    plan = plan_capacity(config, models, vram_bytes=80 << 30)
    shared = shared_layout(config, plan)
    layouts = {"split": (config, plan), "shared": (shared, plan_capacity(shared, models, vram_bytes=80 << 30))}
    classes = (WorkloadClass("chat", prompt_len=LengthDist("fixed", value=200),
                             output_len=LengthDist("fixed", value=10), share=0.8),
               WorkloadClass("rag", prompt_len=LengthDist("fixed", value=6000),
                             output_len=LengthDist("fixed", value=10), share=0.2))
    step = {"h100x8": RooflineStepTime(PRESETS["h100"], model, 2, tp=8)}
    rows = sweep(layouts, models, classes, [2.0, 30.0], step, duration=10.0)
    assert [(r["layout"], r["rate"]) for r in rows] == [("split", 2.0), ("shared", 2.0), ("split", 30.0),
                                                        ("shared", 30.0)]
    p99 = {(r["layout"], r["rate"]): r["classes"]["chat"]["ttft"]["p99"] for r in rows}
    assert p99[("split", 30.0)] > p99[("split", 2.0)]           # past the knee the tail grows
    assert p99[("shared", 30.0)] > p99[("split", 30.0)]         # chat waits behind rag in one pool
    path = plot_knee(rows, tmp_path / "knee.png")
    assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"
    assert "rag TTFT p50/p99" in format_sweep(rows)
    # pools that refuse what does not fit at once (max_queue_seconds 0): the failures show beside the p99s
    tight = dataclasses.replace(config, pools=tuple(p.replace(max_queue_seconds=0.0) for p in config.pools))
    refused = sweep({"split": (tight, plan_capacity(tight, models, vram_bytes=80 << 30))}, models, classes, [120.0],
                    step, duration=10.0)
    failed = sum(c["errors"] for c in refused[0]["classes"].values())
    assert failed > 0 and format_sweep(refused).splitlines()[1].split()[-1] == str(failed)
    assert plot_knee(refused, tmp_path / "refused.png").stat().st_size > 10_000


def test_cli_sweep_writes_results_and_plot(tmp_path, capsys):
    code = main(["simulate", "--config", str(ROOT / "config" / "examples" / "llama3-70b-8xh100.yaml"),
                 "--model-config", str(LLAMA_70B), "--duration", "4", "--layout", "both", "--sweep-rate", "1,3",
                 "--out", str(tmp_path)])
    assert code == 0
    rows = json.loads((tmp_path / "results.json").read_text())
    assert len(rows) == 4 and (tmp_path / "knee.png").exists()
    assert main(["simulate", "--sweep-rate", "1,x"]) == 2
    assert "--sweep-rate: not a number" in capsys.readouterr().err
    assert main(["simulate", "--recommend"]) == 2
    assert "--slo-ttft-p99" in capsys.readouterr().err


def test_calibrate_fits_a_real_engine_and_predicts_its_steps(tmp_path_factory, builtin_path):
    """The tiny random model's real steps: the fitted line predicts the median step within a factor
    of two (the machine may be busy), and the coefficients survive a calibration file."""
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from tests.conftest import make_tiny_model

    tiny = make_tiny_model(tmp_path_factory.mktemp("tiny-calibrate"), "llama", builtin_path)
    engine = LLMEngine(EngineConfig(model=str(tiny), cache=CacheConfig(block_size=16),
                                    pools=(PoolConfig(num_blocks=600, scheduler=SchedulerConfig(
                                        max_num_seqs=32, max_num_batched_tokens=256, max_model_len=512)),)),
                       progress=False)
    phases = (((64, 1, 1), (500, 1, 1), (200, 1, 3)), ((16, 8, 1), (32, 8, 8), (64, 8, 24)))
    model, samples = measure_steps(engine, phases=phases)
    assert len(samples) > 20 and engine.num_free_blocks() == 600
    assert any(f.num_prefill_tokens >= 200 for f, _ in samples) and any(f.num_decode_tokens >= 20 for f, _ in samples)
    errors = sorted(abs(model.seconds([], f, 0) / t - 1) for f, t in samples[2:])
    assert errors[len(errors) // 2] < 1.0
    path = tmp_path_factory.mktemp("calib") / "step.json"
    write_step_model(path, model, device="cpu", model_name="tiny", num_steps=len(samples))
    assert read_step_model(path) == model
    path.write_text('{"step_model": "linear", "a": 0.04, "b": 0.001, "c": 0.002, "d": 0.0005}')
    assert read_step_model(path) == LinearStepTime(0.04, 0.001, 0.002, 0.0005, e=0.0)   # written before e
    path.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not a calibration file"):
        read_step_model(path)


def _write_trace(path, model: LinearStepTime, steps) -> None:
    """A worker step trace whose turns cost exactly what `model` says (and whose steps cost less)."""
    lines = []
    for prefill, decode, attended, keys in steps:
        cycle = model.seconds([], StepFeatures(prefill, decode, attended, keys), 0)
        lines.append(json.dumps({"t": 0.0, "cycle_seconds": cycle, "num_prefill_tokens": prefill,
                                 "num_decode_tokens": decode, "num_attended": attended, "num_keys_read": keys,
                                 "seconds": cycle * 0.8}))
    path.write_text("\n".join(lines) + "\n")


def test_a_served_step_trace_fits_the_turns_it_recorded(tmp_path, capsys):
    served = LinearStepTime(a=0.04, b=0.0035, c=0.0095, d=0.0015, e=0.012)
    rng = random.Random(0)
    steps = [(rng.choice([0, 0, 64, 300, 512]), rng.randrange(0, 12), rng.randrange(0, 60_000), rng.randrange(0, 9000))
             for _ in range(80)]
    steps = [(p, d or (0 if p else 1), a, k) for p, d, a, k in steps]
    trace = tmp_path / "steps.jsonl"
    _write_trace(trace, served, [(64, 0, 0, 64), (900, 0, 0, 900)] + steps)      # the first two (warm-up) are left out
    samples = read_step_trace(trace)
    assert len(samples) == 80 and samples[0][0] == StepFeatures(*steps[0])
    fitted = fit_linear(samples)
    for name in ("a", "b", "c", "d", "e"):
        assert getattr(fitted, name) == pytest.approx(getattr(served, name), rel=1e-6)
    out = tmp_path / "served.json"
    assert main(["simulate", "--calibrate", str(out), "--from-trace", str(trace)]) == 0
    assert read_step_model(out).c == pytest.approx(served.c, rel=1e-6)
    assert json.loads(out.read_text())["num_steps"] == 80
    assert main(["simulate", "--from-trace", str(trace)]) == 2
    assert "--from-trace: only with --calibrate" in capsys.readouterr().err
    # a GPU server's trace fitted on this machine: planned with --model-config and --vram, no engine here
    gpu = ["--config", str(ROOT / "config" / "examples" / "llama3-70b-8xh100.yaml"), "--model-config", str(LLAMA_70B)]
    assert main(["simulate", "--calibrate", str(out), "--from-trace", str(trace), *gpu, "--vram", "80GiB"]) == 0
    assert json.loads(out.read_text())["model"].endswith("llama-3-70b") and read_step_model(out).c == pytest.approx(served.c)
    upstream = tmp_path / "upstream.yaml"
    upstream.write_text("pools:\n  - {name: remote, upstream: 'http://127.0.0.1:9/v1', model: m, "
                        "tokenizer: 'builtin:smollm2-135m-instruct'}\n")
    capsys.readouterr()
    assert main(["simulate", "--calibrate", str(out), "--from-trace", str(trace), "--config", str(upstream)]) == 2
    assert "--config: " in (err := capsys.readouterr().err) and "no local device to calibrate" in err, err
    trace.write_text(trace.read_text() + '{"num_decode_tokens": 1}\n')
    with pytest.raises(ValueError, match="line 83 is not a step record"):
        read_step_trace(trace)


# --- the knee: a GPU's step costs its weights' read up to some tokens, its FLOPs past them ------------
LLAMA_8B = ROOT / "bench" / "models" / "llama-3-8b"
SERVED = LinearStepTime(a=0.04, b=0.0035, c=0.0095, d=0.0015, e=0.012)


def _make_features(rng: random.Random, *, max_decodes: int, max_chunk: int) -> tuple[list[ScheduledSeq], StepFeatures]:
    """A step as the roofline reads it: up to `max_decodes` decodes (contexts up to 2,048) and, beside
    fewer than 32, one prefill chunk of up to `max_chunk` tokens (fresh, or after up to 4,096 cached)."""
    batch, features = [], StepFeatures()
    decodes = rng.randint(1, max_decodes) if rng.random() < 0.5 else rng.randrange(0, 32)
    for _ in range(decodes):
        context = rng.randrange(16, 2048)
        batch.append(ScheduledSeq(_Seq(context), 1))
        features.add(context, 1, True)
    if not batch or decodes < 32:
        chunk, cached = rng.randint(16, max_chunk), rng.choice([0, 0, rng.randrange(0, 4096)])
        batch.append(ScheduledSeq(_Seq(cached), chunk))
        features.add(cached, chunk, False)
    return batch, features


def _make_roofline_steps(roofline: RooflineStepTime, num_steps: int, seed: int) -> list[tuple[StepFeatures, float]]:
    rng = random.Random(seed)
    return [(features, roofline.seconds(batch, features, len(batch)))
            for batch, features in (_make_features(rng, max_decodes=256, max_chunk=4096) for _ in range(num_steps))]


def _mean_relative_error(model: LinearStepTime, samples: list[tuple[StepFeatures, float]]) -> float:
    return sum(abs(model.predict(f) / t - 1) for f, t in samples) / len(samples)


def test_knee_0_is_the_plain_linear_form_and_a_knee_frees_the_tokens_below_it():
    rng = random.Random(0)
    for _ in range(50):
        _, f = _make_features(rng, max_decodes=64, max_chunk=1024)
        old = float(f.vector() @ np.array([SERVED.a, SERVED.b, SERVED.c, SERVED.d, SERVED.e]))
        assert SERVED.predict(f) == old                                   # bit for bit
        assert SERVED.predict(f) == pytest.approx(SERVED.a + SERVED.b * f.num_prefill_tokens + SERVED.c * (
            f.num_decode_tokens) + SERVED.d * f.num_attended / 1024 + SERVED.e * f.num_keys_read / 1024, rel=1e-12)
    kneed = LinearStepTime(a=1.0, b=2.0, c=3.0, d=0.0, e=0.5, knee=100)
    assert kneed.predict(StepFeatures(150, 50, 0, 2048)) == pytest.approx(1 + (300 + 150) * 100 / 200 + 1)
    assert kneed.predict(StepFeatures(60, 40, 0, 0)) == 1.0 == kneed.predict(StepFeatures())
    assert "knee of 100" in kneed.describe() and "knee" not in SERVED.describe()
    assert kneed.coefficients()["knee"] == 100 and SERVED.coefficients()["knee"] == 0


def test_a_fit_finds_the_roofline_knee_of_an_h100():
    """Llama-3-8B on one H100: the weights' read (6 ms) outlasts the FLOPs up to about 250 tokens a
    step; the fit's knee is near there and it predicts held-out steps far better than knee 0."""
    roofline = RooflineStepTime(PRESETS["h100"], read_model_config(LLAMA_8B), 2)
    train, held_out = _make_roofline_steps(roofline, 256, seed=1), _make_roofline_steps(roofline, 256, seed=2)
    fitted = fit_linear(train)
    assert 128 <= fitted.knee <= 512
    assert fit_linear(train[:KNEE_MIN_STEPS - 1]).knee == 0                # too few steps to tell
    kneeless = LinearStepTime(*nonnegative_lstsq(np.stack([f.vector() for f, _ in train]),
                                                 np.array([t for _, t in train])))
    error, error_0 = _mean_relative_error(fitted, held_out), _mean_relative_error(kneeless, held_out)
    assert error < 0.03 and error_0 > 3 * error, (error, error_0)
    online = StepCostModel()
    for f, t in train:
        online.observe(f, t)
    assert online.linear.knee == fitted.knee and _mean_relative_error(online.linear, held_out) < 0.1


def test_steps_of_a_linear_model_fit_back_with_knee_0():
    rng = random.Random(3)
    samples = [(f, SERVED.predict(f)) for f in (_make_features(rng, max_decodes=12, max_chunk=512)[1]
                                                for _ in range(256))]
    fitted = fit_linear(samples)
    assert fitted.knee == 0
    for name in ("a", "b", "c", "d", "e"):
        assert getattr(fitted, name) == pytest.approx(getattr(SERVED, name), rel=1e-6)
    noisy = [(f, t * rng.uniform(0.85, 1.15)) for f, t in samples]      # a busy CPU's jitter: no knee either
    assert fit_linear(noisy).knee == 0 and fit_linear(noisy[:64]).knee == 0
    two_sizes = []           # a composer's steady state: 4 decodes, now and then a 16-token chunk beside them
    for _ in range(64):
        f = StepFeatures()
        for _ in range(4):
            f.add(rng.randrange(10, 2000), 1, True)
        if rng.random() < 0.5:
            f.add(rng.randrange(0, 3000), 16, False)
        two_sizes.append((f, SERVED.predict(f)))
    assert fit_linear(two_sizes).knee == 0          # knees below 4 fit as exactly: rounding must not pick one


def test_a_calibration_file_keeps_the_knee_and_refuses_a_bad_one(tmp_path):
    path = tmp_path / "step.json"
    model = dataclasses.replace(SERVED, knee=256)
    write_step_model(path, model, device="h100", model_name="llama-3-8b", num_steps=256)
    assert json.loads(path.read_text())["knee"] == 256 and read_step_model(path) == model
    path.write_text('{"step_model": "linear", "a": 0.04, "b": 0.001, "c": 0.002, "d": 0.0005, "e": 0.01}')
    assert read_step_model(path).knee == 0                                # written before the knee
    path.write_text('{"step_model": "linear", "a": 0.04, "b": 0.001, "c": 0.002, "d": 0.0005, "knee": -8}')
    with pytest.raises(ValueError, match=r"step\.json: knee: must be an integer >= 0"):
        read_step_model(path)
    for bad in (-1, 2.5, True, "256"):
        with pytest.raises(ValueError, match="knee: must be an integer >= 0"):
            LinearStepTime(0.01, 0.001, 0.002, 0.0, knee=bad)


def test_a_calibration_that_fails_to_write_leaves_the_model_it_would_replace(tmp_path, monkeypatch):
    import engine.step_cost as step_cost

    path = tmp_path / "step.json"
    write_step_model(path, SERVED, device="h100", model_name="m", num_steps=9)
    before = path.read_text()

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(step_cost.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_step_model(path, dataclasses.replace(SERVED, a=1.0), device="h100", model_name="m", num_steps=9)
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["step.json"]


def test_a_calibration_keeps_its_swap_bandwidth_and_a_file_without_one_swaps_at_the_presets(tmp_path):
    """A measured model's swap copies are never free: at the bandwidth measured with it, else the preset's
    (with none, swap mode moved blocks in no time and `auto` never swapped)."""
    from pools.simulation.runner import device_step_times

    path = tmp_path / "step.json"
    write_step_model(path, dataclasses.replace(SERVED, swap_bandwidth=20e9, swap_latency=2e-5), device="h100",
                     model_name="m", num_steps=9)
    assert (read_step_model(path).swap_bandwidth, read_step_model(path).swap_latency) == (20e9, 2e-5)
    config = load_config(ROOT / "config" / "examples" / "llama3-70b-8xh100.yaml")
    models = {config.pools[0].model: read_model_config(LLAMA_70B)}
    plan = plan_capacity(config, models, vram_bytes=80 << 30)
    assert {s.swap_bandwidth for s in device_step_times(plan, models, preset="h100", step_model=str(path)).values()} \
        == {20e9}
    path.write_text('{"step_model": "linear", "a": 0.04, "b": 0.001, "c": 0.002, "d": 0.0005}')   # none measured
    assert read_step_model(path).swap_bandwidth is None
    assert {s.swap_bandwidth for s in device_step_times(plan, models, preset="a100", step_model=str(path)).values()} \
        == {PRESETS["a100"].swap_bandwidth}
    path.write_text('{"step_model": "linear", "a": 0.04, "b": 0.001, "c": 0.002, "d": 0.0, "swap_bandwidth": 0}')
    with pytest.raises(ValueError, match=r"step\.json: swap_bandwidth: must be a finite number > 0"):
        read_step_model(path)


@pytest.mark.parametrize("field, value, error", [
    ("a", "NaN", r"a: must be a finite number >= 0, got nan"),   # was `min() arg is an empty sequence`
    ("b", "1e400", r"b: must be a finite number >= 0, got inf"),   # was a ZeroDivisionError traceback
    ("d", "true", r"d: must be a finite number >= 0, got True"),
    ("swap_bandwidth", "true", r"swap_bandwidth: must be a finite number > 0 \(bytes/s\) or null, got True"),
    ("swap_bandwidth", "Infinity", r"swap_bandwidth: must be a finite number > 0"),
])
def test_a_calibration_file_of_non_finite_or_boolean_numbers_is_refused_naming_the_field(tmp_path, field, value,
                                                                                       error):
    """JSON reads NaN, Infinity and 1e400 as floats, and a bool passed for a number: they reached the simulator
    (an empty min(), a division by zero, a swap at 1 byte/s: TTFTs of 10^11 ms, no error)."""
    coefficients = {"a": "0.04", "b": "0.001", "c": "0.002", "d": "0.0", "swap_bandwidth": "null", field: value}
    path = tmp_path / "step.json"
    path.write_text('{"step_model": "linear", ' + ", ".join(f'"{k}": {v}' for k, v in coefficients.items()) + "}")
    with pytest.raises(ValueError, match=f"^--step-model: .*step\\.json: {error}"):
        read_step_model(path)


def test_a_trace_of_a_non_finite_step_and_a_fit_of_nothing_are_refused(tmp_path):
    from engine.step_cost import fit_linear, read_step_trace

    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"num_prefill_tokens": 8, "num_decode_tokens": 0, "cycle_seconds": Infinity}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl line 1: cycle_seconds must be finite, got inf"):
        read_step_trace(trace, skip=0)
    for bad in ('"num_prefill_tokens": Infinity, "num_decode_tokens": 0, "cycle_seconds": 0.1',   # a traceback
                '"num_prefill_tokens": 8, "num_decode_tokens": 0, "cycle_seconds": true'):      # read as 1 s
        trace.write_text("{" + bad + "}\n")
        with pytest.raises(ValueError, match=r"trace\.jsonl line 1 is not a step record"):
            read_step_trace(trace, skip=0)
    zero = [(StepFeatures(8 * k, 0, 0, 0), 0.0) for k in range(1, 30)]   # times no device takes
    with pytest.raises(ValueError, match="predicts 0 s for every step"):
        fit_linear(zero)


def test_the_gateway_death_spiral_detector_trips_in_an_overcommitted_pool_only():
    """An overcommitted pool without credits preempts and recomputes in a loop: the gateway's detector,
    fed every 0.25 simulated s as the gateway feeds it, trips; the same load behind credits never does."""
    from pools.spiral import SpiralConfig

    spiral = {"chat": SpiralConfig(window_seconds=4.0, min_preemptions_per_s=0.5, tokens_tolerance=0.25)}
    step = LinearStepTime(a=0.01, b=0.0002, c=0.001, d=0.0)

    def run(credits: bool) -> DeviceSim:
        sim = DeviceSim([_pool(num_blocks=80, max_num_seqs=32)], block_size=16, max_model_lens={"chat": 1024},
                        step_time=step, kv_bytes_per_token=TINY.kv_bytes_per_token(torch.bfloat16),
                        credits=credits, spirals=spiral)
        sim.run([SimRequest(f"r{i}", "chat", arrival=0.05 * i, prompt_len=100, output_len=400, pool="chat")
                 for i in range(60)])
        return sim

    overcommitted = run(credits=False)
    assert overcommitted.schedulers["chat"].stats.num_preemptions > 50
    assert overcommitted.spiral_trips["chat"] and "death spiral" in overcommitted.spiral_trips["chat"][0][1]
    assert overcommitted.schedulers["chat"].stats.num_generated_tokens == 60 * 400
    credited = run(credits=True)
    assert credited.schedulers["chat"].stats.num_preemptions == 0 and not credited.spiral_trips["chat"]


def _recommend_70b():
    """The 70B example on 8xH100 (its roofline) and two fixed classes, 80% chat of 200 tokens and 20% rag of 6,000:
    (config, model configs, step times, classes), what `recommend` takes."""
    config = load_config(ROOT / "config" / "examples" / "llama3-70b-8xh100.yaml")
    model = read_model_config(LLAMA_70B)
    models = {config.pools[0].model: model}
    step = {"h100x8": RooflineStepTime(PRESETS["h100"], model, 2, tp=8)}
    classes = (WorkloadClass("chat", prompt_len=LengthDist("fixed", value=200),
                             output_len=LengthDist("fixed", value=30), share=0.8),
               WorkloadClass("rag", prompt_len=LengthDist("fixed", value=6000),
                             output_len=LengthDist("fixed", value=30), share=0.2))
    return config, models, step, classes


def test_recommend_picks_the_budget_that_meets_an_itl_target():
    """Big rag chunks lengthen every step: with a p99 ITL target only the small budget meets it."""
    config, models, step, classes = _recommend_70b()
    result = recommend(config, models, classes, 8.0, step, ttft_p99=10.0, itl_p99=0.2, duration=10.0,
                       vram_bytes=80 << 30, shares=(0.3, 0.4), budgets=(512, 8192))
    by = {(c["kv_share"], c["max_num_batched_tokens"]): c for c in result["candidates"]}
    assert by[(0.4, 512)]["meets"] and not by[(0.4, 8192)]["meets"]
    assert by[(0.4, 8192)]["worst_itl_p99"] > 0.2 > by[(0.4, 512)]["worst_itl_p99"]
    assert result["recommended"]["max_num_batched_tokens"] == 512
    assert result["recommended"]["kv_share"] == 0.4                 # a tie: the config's own split
    assert "recommended at 8 requests/s" in format_recommendation(result)
    none = recommend(config, models, classes, 8.0, step, ttft_p99=0.001, duration=5.0, vram_bytes=80 << 30,
                     shares=(0.4,), budgets=(512,))
    assert none["recommended"] is None and "no candidate meets" in format_recommendation(none)
    with pytest.raises(SpecError, match=r"^--request-rate: no request arrives in 1 s"):   # nothing to judge
        recommend(config, models, classes, 0.001, step, ttft_p99=1.0, duration=1.0, vram_bytes=80 << 30)
    bursty = recommend(config, models, classes, 8.0, step, ttft_p99=10.0, duration=5.0, vram_bytes=80 << 30,
                       shares=(0.4,), budgets=(512,), burstiness=0.2)   # --burstiness reaches its arrivals
    poisson = recommend(config, models, classes, 8.0, step, ttft_p99=10.0, duration=5.0, vram_bytes=80 << 30,
                        shares=(0.4,), budgets=(512,))
    assert bursty["candidates"][0]["worst_ttft_p99"] != poisson["candidates"][0]["worst_ttft_p99"]


def test_recommend_picks_the_candidate_with_the_most_headroom_not_the_earliest_last_request():
    """Both budgets meet a loose target and serve the same tokens; 8192's last request happens to end sooner
    (more tokens/s over the run), but 512 has the lower worst p99 TTFT (and ITL): 512 is recommended. A class
    no pool can take has no p99: None, and the JSON is strict."""
    config, models, step, classes = _recommend_70b()
    result = recommend(config, models, classes, 8.0, step, ttft_p99=10.0, duration=10.0, vram_bytes=80 << 30,
                       shares=(0.4,), budgets=(512, 8192))
    small, big = result["candidates"]
    assert small["meets"] and big["meets"] and big["output_tokens_per_s"] > small["output_tokens_per_s"]
    assert round(small["worst_ttft_p99"], 2) < round(big["worst_ttft_p99"], 2)
    assert result["recommended"] is small
    huge = WorkloadClass("huge", prompt_len=LengthDist("fixed", value=200_000),
                         output_len=LengthDist("fixed", value=30), share=0.2)
    result = recommend(config, models, (*classes, huge), 8.0, step, ttft_p99=10.0, duration=10.0,
                       vram_bytes=80 << 30, shares=(0.4,), budgets=(512,))
    assert result["candidates"][0]["worst_ttft_p99"] is None and result["recommended"] is None
    json.dumps(result, allow_nan=False)


# --- replicas ------------------------------------------------------------------------------------
def _replicated_config(replicas: int):
    """One small device (the TINY model: KV never binds) whose one pool runs 8 sequences per replica."""
    return load_config(f"""
devices:
  gpu: {{device: cuda, memory: 1GiB, dtype: bfloat16, replicas: {replicas}}}
pools:
  - {{name: chat, model: tiny, device: gpu, kv_share: 1.0, max_num_seqs: 8, max_model_len: 1024, avg_len: 256,
     slo: null}}
""", env={})


def test_a_wait_that_runs_out_during_a_step_is_refused_when_that_step_frees_the_credits():
    """One request's credits at a time; the first's one step (a 900-token prefill) takes 0.91 s, past the
    second's 0.5 s limit: when the step ends, the second has waited too long and fails, not admitted late."""
    pools = [_pool(num_blocks=64)]
    group = ReplicaGroup(pools, block_size=16, max_queue={"chat": 0.5})
    sim = DeviceSim(pools, block_size=16, max_model_lens={"chat": 1024},
                    step_time=LinearStepTime(a=0.01, b=0.001, c=0.001, d=0.0),
                    kv_bytes_per_token=TINY.kv_bytes_per_token(torch.bfloat16), group=group)
    first, second = (SimRequest(f"r{i}", "chat", arrival=0.0, prompt_len=900, output_len=1, pool="chat")
                     for i in range(2))
    sim.run([first, second])
    assert first.finished and second.admitted is None and second.error.startswith("503")


def test_a_replay_of_what_a_real_run_served_refuses_none_of_it():
    """bench simulate replays the requests a real run served: none may be refused for the queue limit there
    (the server's own refusals are already out of what it replays)."""
    step = {"gpu": LinearStepTime(a=0.01, b=0.0001, c=0.001, d=0.0)}
    config = _replicated_config(1)
    config = dataclasses.replace(config, pools=tuple(p.replace(max_queue_seconds=0.0) for p in config.pools))
    plan = plan_capacity(config, {"tiny": TINY})
    for max_queue in (True, False):
        requests = [SimRequest(f"r{i}", "chat", 0.001 * i, 200, 300) for i in range(40)]
        result = simulate(config, plan, {"tiny": TINY}, requests, step, max_queue=max_queue)
        assert any(r.error for r in result.requests) == max_queue


def test_an_autoscaled_device_is_said_to_run_at_its_max_from_the_start():
    step = {"gpu": LinearStepTime(a=0.01, b=0.0001, c=0.001, d=0.0)}
    chat = WorkloadClass("chat", prompt_len=LengthDist("uniform", min=50, max=150),
                         output_len=LengthDist("uniform", min=50, max=150))
    config = _replicated_config("{min: 1, max: 3}")
    plan = plan_capacity(config, {"tiny": TINY})
    result = simulate(config, plan, {"tiny": TINY}, make_requests((chat,), 2.0, duration=2.0, seed=1), step)
    summary = summarize(result)
    assert summary["replicas"] == {"gpu": 3} and summary["autoscaled"] == {"gpu": 1}
    text = format_summary(summary)
    assert "device gpu: autoscaled (min 1): simulated at its 3 replicas from the start" in text
    # a few requests: their p99s are marked as resting on fewer than 100 samples
    assert summary["classes"]["chat"]["ttft"]["n"] < 100 and "* a p99 over fewer than 100 samples" in text


def test_two_replicas_nearly_double_the_tokens_of_a_saturated_one_and_split_them_evenly():
    step = {"gpu": LinearStepTime(a=0.01, b=0.0001, c=0.001, d=0.0)}
    chat = WorkloadClass("chat", prompt_len=LengthDist("uniform", min=50, max=150),
                         output_len=LengthDist("uniform", min=50, max=150))
    summaries = {}
    for replicas in (1, 2):
        config = _replicated_config(replicas)
        plan = plan_capacity(config, {"tiny": TINY})
        result = simulate(config, plan, {"tiny": TINY}, make_requests((chat,), 16.0, duration=8.0, seed=1), step)
        assert result.replicas == {"gpu": replicas} and len(result.traces["chat"]) == replicas
        summaries[replicas] = summarize(result)
    one, two = summaries[1]["pools"]["chat"], summaries[2]["pools"]["chat"]
    assert one["max_queued"] > 20                                   # one replica is saturated: a queue for credits
    tokens_per_s = {n: summary["classes"]["chat"]["output_tokens_per_s"] for n, summary in summaries.items()}
    assert tokens_per_s[2] >= 1.7 * tokens_per_s[1]
    assert two["output_tokens_per_s"] >= 1.7 * one["output_tokens_per_s"]
    assert [r["token_share"] for r in one["replicas"]] == [1.0] and one["replica_deviation"] == 0
    assert all(0.35 <= r["token_share"] <= 0.65 for r in two["replicas"]) and two["replica_deviation"] <= 0.3
    assert sum(r["requests"] for r in two["replicas"]) == summaries[2]["classes"]["chat"]["requests"]
    assert two["computed_tokens"] == sum(r["computed_tokens"] for r in two["replicas"])
    assert two["num_blocks"] == one["num_blocks"] and two["max_num_seqs"] == 8     # one replica's
    text = format_summary(summaries[2])
    assert "pool chat: 2 replicas" in text and "replicas: gpu x2" in text


def _group(pool: PoolConfig, num_replicas: int) -> ReplicaGroup:
    group = ReplicaGroup([pool], block_size=16, num_replicas=num_replicas)
    for _ in range(num_replicas):
        DeviceSim([pool], block_size=16, max_model_lens={pool.name: 1024},
                  step_time=LinearStepTime(a=0.01, b=0.0001, c=0.001, d=0.0),
                  kv_bytes_per_token=TINY.kv_bytes_per_token(torch.bfloat16), group=group)
    return group


def test_the_simulated_credit_queue_admits_what_the_gateways_does():
    """The gateway's ledger of a pool (`gateway.admission`: the plan's max_num_seqs, an interactive pool's flow
    at most 7/8 of them, the pool's block size) is the simulator's: 30 identical short requests on one replica
    of max_num_seqs 11 run 10 at once in an interactive pool, 11 in a throughput one; never 30."""
    from engine.config import LatencySLO
    from pools.credits.queue import reservation

    need = reservation([256], 64, 1, block_size=32, max_model_len=2048)
    for slo, at_once in ((LatencySLO(ttft_ms=1000, itl_ms=200), 10), (None, 11)):
        pool = PoolConfig(name="chat", num_blocks=756, slo=slo,
                          scheduler=SchedulerConfig(max_num_seqs=11, max_num_batched_tokens=512, max_model_len=2048))
        ledger = ReplicaGroup([pool], block_size=32).ledgers["chat"]
        for i in range(30):
            ledger.submit(f"r{i}", need)
        assert len(ledger.admit()) == at_once, slo


@pytest.mark.parametrize("first_len, second_len", [(80, 10), (10, 80)])
def test_a_request_waiting_for_credits_goes_to_the_replica_that_frees_first(first_len, second_len):
    """12 blocks per replica: one request of 100 + 80 tokens fills a replica, one of 100 + 10 leaves
    too little for another. The third waits on the pool and starts where the shorter one ended."""
    group = _group(_pool(num_blocks=12), 2)
    first, second, waiting = (SimRequest("a", "chat", 0.0, 100, first_len, pool="chat"),
                              SimRequest("b", "chat", 0.001, 100, second_len, pool="chat"),
                              SimRequest("w", "chat", 0.002, 100, 10, pool="chat"))
    group.run([first, second, waiting])
    assert (first.replica, second.replica) == (0, 1)
    shorter = first if first_len < second_len else second
    assert waiting.replica == shorter.replica
    assert waiting.admitted == pytest.approx(shorter.token_times[-1])     # admitted as its credits came back
    assert waiting.admitted < max(first.token_times[-1], second.token_times[-1])
    assert all(r.finished for r in (first, second, waiting)) and group.placements["chat"].load == [0, 0]


def test_a_small_request_of_another_flow_starts_at_the_next_step_boundary_and_the_head_waits():
    """Fair order (`pools.credits.flows`): the small request is of a flow not served yet, so it goes before the
    big head of the queue, to replica 0, which is mid-step: it starts at that step's end. The head then
    waits, with no bypass, until a replica has room for it: replica 0 once a and the small one ended."""
    group = _group(_pool(num_blocks=12), 2)
    a, b = SimRequest("a", "chat", 0.0, 100, 10, pool="chat"), SimRequest("b", "chat", 0.001, 100, 40, pool="chat")
    head = SimRequest("h", "chat", 0.002, 100, 80, pool="chat")
    small = SimRequest("s", "chat", 0.003, 10, 20, pool="chat")
    group.run([a, b, head, small])
    assert (a.replica, b.replica, head.replica, small.replica) == (0, 1, 0, 0)
    assert small.admitted == pytest.approx(a.token_times[0])                    # replica 0's first step ended
    assert head.admitted == pytest.approx(max(a.token_times[-1], small.token_times[-1]))
    assert all(r.finished for r in (a, b, head, small))


def test_shared_layout_keeps_a_replicated_device_replicated():
    config = load_config(ROOT / "config" / "examples" / "llama3-70b-8xh100.yaml")
    config = dataclasses.replace(config, devices={"h100x8": config.devices["h100x8"].replace(replicas=2)})
    models = {config.pools[0].model: read_model_config(LLAMA_70B)}
    plan = plan_capacity(config, models, vram_bytes=80 << 30)
    shared_plan = plan_capacity(shared_layout(config, plan), models, vram_bytes=80 << 30)
    (pool,) = shared_plan.pools.values()
    assert shared_plan.devices["h100x8"].replicas == 2 and pool.replicas == 2
    assert pool.max_num_seqs == sum(p.max_num_seqs for p in plan.pools.values())      # per replica
    assert abs(pool.num_blocks - sum(p.num_blocks for p in plan.pools.values())) <= 1


def test_a_shared_prefix_lengthens_every_prompt():
    rag = WorkloadClass("rag", prompt_len=LengthDist("fixed", value=100), output_len=LengthDist("fixed", value=5),
                        shared_prefix=SharedPrefix(tokens=2000, count=4))
    assert {r.prompt_len for r in make_requests((rag,), 5.0, duration=2.0)} == {2100}


def test_cli_simulate_replicas_overrides_every_device(capsys):
    args = ["simulate", "--config", str(ROOT / "config" / "examples" / "llama3-70b-8xh100.yaml"),
            "--model-config", str(LLAMA_70B), "--duration", "3", "--request-rate", "2"]
    assert main(args + ["--replicas", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["replicas"] == {"h100x8": 2} and len(out["pools"]["chat"]["replicas"]) == 2
    assert sum(r["requests"] for r in out["pools"]["chat"]["replicas"]) == out["classes"]["chat"]["requests"]
    assert main(args + ["--replicas", "0"]) == 2
    assert "argument --replicas: must be an integer in 1.." in capsys.readouterr().err


# --- overloaded or not ------------------------------------------------------------------------------
def _verdict_run(rate: float) -> tuple[dict, dict]:
    """The one-replica TINY device at `rate` requests/s of ~100 + ~100 tokens: (summary, verdicts)."""
    step = {"gpu": LinearStepTime(a=0.01, b=0.0001, c=0.001, d=0.0)}
    chat = WorkloadClass("chat", prompt_len=LengthDist("uniform", min=50, max=150),
                         output_len=LengthDist("uniform", min=50, max=150))
    config = _replicated_config(1)
    plan = plan_capacity(config, {"tiny": TINY})
    result = simulate(config, plan, {"tiny": TINY}, make_requests((chat,), rate, duration=8.0, seed=1), step)
    verdicts = overload_verdicts(result, plan, step, duration=8.0, step_model="test")
    mix, unrouted = workload_mix(config, plan, (chat,), rate)
    assert unrouted == 0
    planned = plan_verdicts(plan, step, mix, step_model="test")
    # what the workload says and what the run got agree (the run's arrivals are a sample of it)
    assert verdicts["gpu"]["offered_load"] == pytest.approx(planned["gpu"]["offered_load"], rel=0.25)
    return summarize(result) | {"overload": verdicts}, verdicts["gpu"]


def test_a_light_rate_is_within_capacity_and_a_heavy_one_overloaded_and_slow():
    light, light_verdict = _verdict_run(2.0)
    heavy, heavy_verdict = _verdict_run(16.0)
    assert not light_verdict["overloaded"] and light_verdict["offered_load"] < demand.OFF_LOAD
    assert light_verdict["replicas_needed"] == 1
    pool = light_verdict["pools"]["chat"]
    assert pool["max_num_seqs"] == 8 and pool["credits"] == light["pools"]["chat"]["num_blocks"] * 16
    assert pool["rate"] == pytest.approx(light["classes"]["chat"]["requests"] / 8.0)
    assert 50 <= pool["prompt_tokens"] <= 150 and pool["offered_decode"] == pytest.approx(
        pool["rate"] * pool["output_tokens"])
    assert heavy_verdict["overloaded"] and heavy_verdict["offered_load"] > 1 and heavy_verdict["replicas_needed"] >= 2
    assert heavy["classes"]["chat"]["ttft"]["p99"] > 10 * light["classes"]["chat"]["ttft"]["p99"]
    assert "device gpu: offered load" in format_summary(light) and "within capacity" in format_summary(light)
    assert (f"overloaded; {heavy_verdict['replicas_needed']} replicas would carry it at most 90% busy"
            in format_summary(heavy))


def test_workload_mix_routes_each_draw_and_weighs_by_class_rate():
    config = load_config(ROOT / "config" / "examples" / "llama3-70b-8xh100.yaml")
    plan = plan_capacity(config, {config.pools[0].model: read_model_config(LLAMA_70B)}, vram_bytes=80 << 30)
    classes = (WorkloadClass("chat", prompt_len=LengthDist("fixed", value=300),
                             output_len=LengthDist("fixed", value=20), share=3),
               WorkloadClass("rag", prompt_len=LengthDist("fixed", value=6000),
                             output_len=LengthDist("fixed", value=40), share=1),
               WorkloadClass("both", prompt_len=LengthDist("uniform", min=4000, max=4193),   # chat takes <= 4096
                             output_len=LengthDist("fixed", value=10), rate=2.0))
    mix, unrouted = workload_mix(config, plan, classes, 4.0)
    assert mix["chat"][0] == pytest.approx(3.0 + 1.0, rel=0.05) and mix["rag"][0] == pytest.approx(1.0 + 1.0, rel=0.05)
    assert mix["chat"][0] + mix["rag"][0] == pytest.approx(6.0) and unrouted == 0
    assert mix["rag"][1] == pytest.approx((6000 + 4145) / 2, rel=0.02)           # 1 req/s of each
    assert mix["rag"][2] == pytest.approx((40 + 10) / 2, rel=0.05)
    assert mix["chat"][1] == pytest.approx((3 * 300 + 4048) / 4, rel=0.02)


def test_isolation_by_default_derives_its_slo_from_the_modelled_step(builtin_path):
    """simulate applies the engine's rule (engine.calibration.slo_probe / slo_from_step) to the modelled step."""
    from engine.calibration import slo_from_step, slo_probe
    from engine.config import LatencySLO
    from pools.simulation.runner import _device_group, modelled_slo

    linear = LinearStepTime(a=0.010, b=0.0, c=0.001, d=0.0)
    assert slo_probe(40, 40 * 8, 16, 4096) == (10, 127)             # a quarter of 40, 8 blocks of 16 each
    assert modelled_slo(linear, 40, 40 * 8, 16, 4096) == LatencySLO(ttft_ms=500, itl_ms=50)   # 2.5 x 20 ms
    assert slo_from_step(0.001) == LatencySLO(ttft_ms=100, itl_ms=10)  # the floor
    assert slo_from_step(0.020, min_share=0.2) == LatencySLO(ttft_ms=630, itl_ms=63)   # 50 ms / 0.8, rounded up
    text = ("devices:\n  d: {device: cpu, memory: 2GiB}\npools:\n"
            "  - {name: chat, model: builtin:smollm2-135m-instruct, device: d, route: {max_prompt_tokens: 512}, "
            "kv_share: 0.4, avg_len: 256, max_model_len: 1024}\n"
            "  - {name: rag, model: builtin:smollm2-135m-instruct, device: d, route: {min_prompt_tokens: 513}, "
            "kv_share: 0.6, avg_len: 900, max_model_len: 1024}\n")
    config = load_config(text, env={})
    model = ModelConfig.from_folder(builtin_path)
    plan = plan_capacity(config, {"builtin:smollm2-135m-instruct": model})
    group = _device_group(config, plan, plan.devices["d"], {"builtin:smollm2-135m-instruct": model}, linear, True, 0)
    chat = plan.pools["chat"]
    expected = modelled_slo(linear, chat.max_num_seqs, chat.num_blocks, 16, chat.max_model_len, 0.2)   # rag's share
    assert group.replicas[0].composer.slos == {"chat": expected, "rag": None} and expected != LatencySLO()


@pytest.mark.parametrize("snapshots", [None, 0, 3])
def test_the_simulator_serves_a_state_models_pools_as_the_engine_does(tmp_path, builtin_path, snapshots):
    """A model with state layers (Qwen3.5): each simulated pool's prefix cache resumes only where it kept a state
    (`engine.state_cache`), with the engine's number of slots; `state_snapshots: 0`: no prefix caching."""
    from pools.simulation.runner import _device_group
    from tests.conftest import make_tiny_model
    from tests.engine.test_engine_vs_hf import QWEN3_5

    folder = make_tiny_model(tmp_path / "qwen3_5", "qwen3_5", builtin_path, **QWEN3_5)
    extra = "" if snapshots is None else f", state_snapshots: {snapshots}"
    text = ("devices:\n  d: {device: cpu, memory: 2GiB, dtype: float32}\npools:\n"
            f"  - {{name: chat, model: {folder}, device: d, kv_cache_bytes: 1MiB, avg_len: 192, max_model_len: 512"
            f"{extra}}}\n")
    config = load_config(text, env={})
    model = ModelConfig.from_folder(folder)
    plan = plan_capacity(config, {str(folder): model})
    group = _device_group(config, plan, plan.devices["d"], {str(folder): model},
                          LinearStepTime(a=0.010, b=0.0, c=0.001, d=0.0), True, 0)
    scheduler = group.replicas[0].schedulers["chat"]
    if snapshots == 0:
        assert scheduler.state_snapshots is None and not scheduler.block_manager.enable_prefix_caching
    else:
        assert scheduler.state_snapshots.num_slots == (plan.pools["chat"].max_num_seqs if snapshots is None else 3)


# --- what the gateway would route: one model's pools, upstream ranges, several devices --------------
QWEN_32B = ROOT / "config" / "examples" / "qwen3-32b"


def _make_config(tmp_path, pools: list[dict], devices=("a", "b")):
    """A config of `pools` (YAML keys) on `devices` (cuda:0, cuda:1, ...), planned at 200 GiB per GPU."""
    import yaml

    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump({"devices": {d: {"device": f"cuda:{i}"} for i, d in enumerate(devices)},
                                    "pools": pools}))
    config = load_config(path)
    models = {str(LLAMA_70B): read_model_config(LLAMA_70B), str(QWEN_32B): read_model_config(QWEN_32B)}
    return path, config, models, plan_capacity(config, models, vram_bytes=200 << 30)


def _fixed(name: str, prompt_len: int, share: float = 1.0) -> WorkloadClass:
    return WorkloadClass(name, prompt_len=LengthDist("fixed", value=prompt_len),
                         output_len=LengthDist("fixed", value=20), share=share)


def test_pools_of_two_models_are_refused_naming_each_models_pools(tmp_path, capsys):
    """A workload names no model: spreading it over two models' pools by length alone put all of it on
    the first model's pool and nothing on the other's; now the configuration is refused."""
    path, config, models, plan = _make_config(tmp_path, [
        {"name": "llama", "model": str(LLAMA_70B), "device": "a", "kv_share": 1.0, "slo": None},
        {"name": "qwen", "model": str(QWEN_32B), "device": "b", "kv_share": 1.0, "slo": None,
         "max_model_len": 32768}])
    message = "the local pools serve 2 models ('llama-3-70b': llama; 'qwen3-32b': qwen)"
    with pytest.raises(SpecError, match=re.escape(message)):
        workload_mix(config, plan, (_fixed("chat", 300),), 4.0)
    with pytest.raises(SpecError, match="take one model at a time"):
        simulate(config, plan, models, make_requests((_fixed("chat", 300),), 1.0, duration=2.0), {})
    assert main(["capacity", "--config", str(path), "--vram", "200GiB", "--rate", "4", "--workload", "chat"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_prompts_an_upstream_pool_takes_are_on_no_device(tmp_path, capsys):
    """The router sends 1025..4096-token prompts of the model to the upstream pool: they are neither a
    local pool's load nor 'no pool takes them'; an upstream pool of another model changes nothing."""
    path, config, models, plan = _make_config(tmp_path, [
        {"name": "chat", "model": str(LLAMA_70B), "device": "a", "kv_share": 0.5, "slo": None,
         "route": {"max_prompt_tokens": 1024}, "max_model_len": 8192},
        {"name": "remote", "model": "llama-3-70b", "upstream": "http://h:8000/v1",
         "route": {"min_prompt_tokens": 1025, "max_prompt_tokens": 4096}},
        {"name": "rag", "model": str(LLAMA_70B), "device": "a", "kv_share": 0.5, "slo": None,
         "route": {"min_prompt_tokens": 4097}, "max_model_len": 8192},
        {"name": "other", "model": "gpt-x", "upstream": "http://h:8000/v1"}], devices=("a",))
    mix, unrouted = workload_mix(config, plan, (_fixed("short", 300), _fixed("mid", 2000), _fixed("long", 6000)), 6.0)
    assert unrouted == 0 and "other" not in mix
    assert mix["chat"][0] == pytest.approx(2.0) and mix["rag"][0] == pytest.approx(2.0)
    assert mix["remote"] == pytest.approx((2.0, 2000, 20))
    workload = tmp_path / "mid.yaml"
    workload.write_text("classes:\n  - {name: mid, prompt_len: 2000, output_len: 20}\n")
    assert main(["capacity", "--config", str(path), "--vram", "200GiB", "--rate", "3", "--workload",
                 str(workload)]) == 0
    out = capsys.readouterr().out
    assert "upstream pool remote: 3.00 requests/s routed there (on no device's load)" in out
    assert "no pool takes" not in out and "chat: offered nothing" in out


def test_a_file_of_upstream_pools_only_has_its_rate_routed_to_them_within_their_context(tmp_path, capsys):
    """No local pool: the workload goes to the upstream pools of the model they serve (it was all 'no pool
    takes'); an open route ends at the upstream's max_model_len, as the gateway's router has it."""
    path, config, _, plan = _make_config(tmp_path, [
        {"name": "near", "model": "m", "upstream": "http://127.0.0.1:9/v1", "route": {"max_prompt_tokens": 1024}},
        {"name": "far", "model": "m", "upstream": "http://127.0.0.1:9/v1", "route": {"min_prompt_tokens": 1025},
         "max_model_len": 4096}], devices=())
    mix, unrouted = workload_mix(config, plan, (_fixed("short", 300), _fixed("mid", 2000), _fixed("long", 6000)), 6.0)
    assert (mix["near"][0], mix["far"][0], unrouted) == pytest.approx((2.0, 2.0, 2.0))
    assert main(["capacity", "--config", str(path), "--rate", "3", "--workload", "chat"]) == 0
    assert "upstream pool near: 3.00 requests/s routed there" in capsys.readouterr().out


def test_the_shared_layout_of_two_devices_routes_each_prompt_to_its_split_device(tmp_path, capsys):
    """One model's pools on two devices: each device's merged pool takes the lengths its pools took (the
    same served model name, routes that do not overlap), so the shared layout plans and runs."""
    path, config, models, plan = _make_config(tmp_path, [
        {"name": "chat", "model": str(LLAMA_70B), "device": "a", "kv_share": 1.0,
         "route": {"max_prompt_tokens": 1024}, "max_model_len": 8192},
        {"name": "rag", "model": str(LLAMA_70B), "device": "b", "kv_share": 1.0,
         "route": {"min_prompt_tokens": 1025}, "max_model_len": 8192}])
    shared = shared_layout(config, plan)
    shared_plan = plan_capacity(shared, models, vram_bytes=200 << 30)
    assert [(p.name, p.device, p.route.describe(8192)) for p in shared.pools] == [
        ("shared-a", "a", "0..1024"), ("shared-b", "b", "1025..8191")]
    assert shared_plan.pools["shared-a"].max_num_seqs == plan.pools["chat"].max_num_seqs
    step = {d: RooflineStepTime(PRESETS["h100"], models[str(LLAMA_70B)], 2) for d in ("a", "b")}
    requests = make_requests((_fixed("short", 300), _fixed("long", 6000)), 2.0, duration=4.0, seed=1)
    simulate(shared, shared_plan, models, requests, step)
    assert {(r.cls, r.pool) for r in requests} == {("short", "shared-a"), ("long", "shared-b")}
    assert main(["simulate", "--config", str(path), "--vram", "200GiB", "--layout", "both", "--duration", "2",
                 "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["shared"]["pools"]) == {"shared-a", "shared-b"}


def test_the_shared_layout_refuses_devices_whose_routes_interleave(tmp_path):
    _, config, _, plan = _make_config(tmp_path, [
        {"name": "short", "model": str(LLAMA_70B), "device": "a", "kv_share": 0.5,
         "route": {"max_prompt_tokens": 1024}, "max_model_len": 8192},
        {"name": "mid", "model": str(LLAMA_70B), "device": "b", "kv_share": 1.0,
         "route": {"min_prompt_tokens": 1025, "max_prompt_tokens": 4096}, "max_model_len": 8192},
        {"name": "long", "model": str(LLAMA_70B), "device": "a", "kv_share": 0.5,
         "route": {"min_prompt_tokens": 4097}, "max_model_len": 8192}])
    with pytest.raises(SpecError, match=r"--layout shared: shared-a would take prompts 0\.\.8191 and shared-b "
                                        r"1025\.\.4096: their devices' routes interleave"):
        shared_layout(config, plan)


def test_cli_simulate_replicas_keeps_gpu_devices_apart_and_refuses_flags_it_would_ignore(capsys):
    """--replicas gives each GPU device of the file its own GPUs (two devices on GPUs 0 and 1 stay a valid
    config at 2 replicas each); a flag that would be ignored beside another is a usage error naming it."""
    import dataclasses

    from gateway.simulate_cli import _with_replicas
    from pools.config.yaml_file import load_config

    config = load_config("""
devices:
  a: {device: cuda, gpus: [0]}
  b: {device: cuda, gpus: [1]}
pools:
  - {name: chat, model: "builtin:smollm2-135m-instruct", device: a, kv_share: 1.0, route: {max_prompt_tokens: 1000}}
  - {name: rag, model: "builtin:smollm2-135m-instruct", device: b, kv_share: 1.0, route: {min_prompt_tokens: 1001}}
""", env={})
    scaled = dataclasses.replace(config, devices=_with_replicas(config.devices, 2))   # checked again
    assert [scaled.devices[d].claimed_gpus for d in ("a", "b")] == [(0, 1), (2, 3)]
    for flags, named in ((["--recommend", "--slo-ttft-p99", "1", "--sweep-rate", "1,2"], "--sweep-rate"),
                         (["--recommend", "--slo-ttft-p99", "1", "--layout", "both"], "--layout"),
                         (["--calibrate", "/tmp/never.json", "--replicas", "2"], "--replicas"),
                         (["--calibrate", "/tmp/never.json", "--swap-space", "1GiB"], "--swap-space"),
                         (["--calibrate", "/tmp/never.json", "--sweep-rate", "1,2"], "--sweep-rate"),
                         (["--calibrate", "/tmp/never.json", "--json"], "--json"),
                         (["--calibrate", "/tmp/never.json", "--step-model", "m.json"], "--step-model"),
                         (["--calibrate", "/tmp/never.json", "--request-rate", "3"], "--request-rate")):
        assert main(["simulate", *flags]) == 2
        assert capsys.readouterr().err.count(f"{named}: not with --") == 1, flags
    assert main(["simulate", "--preemption-mode", "swap", "--swap-space", "0"]) == 2   # the file's pools, made invalid
    assert "--preemption-mode and --swap-space: pool 'chat' (pools[0]) would be invalid" in capsys.readouterr().err
