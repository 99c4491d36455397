"""`cliffguard bench isolation`: its pool files are valid, its arithmetic, and a `--quick` run end to end
(four servers, chat + rag loads over HTTP) with the bars that hold on any run: no chat preemption in
the split layout, and the shared pool's chat tail far above the split one. `--sweep`: its grid, runs,
seeds and pool files, the verdict's arithmetic on made-up runs, the idle check, the table and the
heat map, and a `--sweep --quick` run end to end (two servers, seven runs)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from bench.isolation.scenarios import (BARS, CHAT, RAG, Scenario, add_ratios, format_table, judge,
                                       load_config as load_config_of, pools_yaml, scenarios, summarize, verdict,
                                       verdict_text)
from bench.isolation.grid import (Grid, assemble, format_sweep_table, plan_runs, summary_line, sweep_grid,
                                  sweep_pool_files, write_heatmap)
from bench.isolation import add_arguments, pending_work
from bench.load.plan import LoadConfig
from bench.load.report import build_report
from bench.load.scrape import ScrapeSample
from bench.load.sender import RequestRecord
from gateway.cli import main
from pools.capacity_plan import plan_capacity
from pools.model_configs import resolve_model_configs
from pools.config.yaml_file import load_config
from pools.config.checks import load_yaml
from pools.workload import latency_stats
from tests.conftest import make_tiny_model

PNG = b"\x89PNG\r\n\x1a\n"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bad_times_and_rates_are_refused_before_anything_runs_with_or_without_the_sweep(capsys):
    """`--sweep` skipped the options' check: `--sweep --duration -5` ran (as 260 s); now each is refused when
    parsed, naming the option."""
    from gateway.cli import main

    for sweep in ([], ["--sweep"]):
        for bad in (["--duration", "-5"], ["--drain-timeout", "0"], ["--ttft-ms", "0"], ["--chat-rate", "nan"],
                    ["--itl-ms-sweep", "0"], ["--itl-ms-sweep", "100,abc"], ["--itl-ms-sweep", ","]):
            assert main(["bench", "isolation", *sweep, *bad]) == 2, (sweep, bad)
            assert f"argument {bad[0]}" in capsys.readouterr().err


def test_a_flag_of_the_other_mode_is_refused_not_ignored(capsys):
    """`--sweep --chat-rate 2` ran the grid's default chat rates and said nothing; each mode now refuses the
    other's flags, naming the flag, before anything starts (the scenarios' own defaults still apply)."""
    from gateway.cli import main

    for argv, named in ((["--sweep", "--chat-rate", "2"], "--chat-rate: not used by --sweep (its grid's chat rates"),
                        (["--sweep", "--quick", "--rag-rate", "0.3"], "--rag-rate: not used by --sweep"),
                        (["--sweep", "--itl-ms-sweep", "200"], "--itl-ms-sweep: not used by --sweep"),
                        (["--chat-rates", "1,2"], "--chat-rates: only with --sweep"),
                        (["--quick", "--no-shared"], "--no-shared: only with --sweep")):
        assert main(["bench", "isolation", *argv]) == 2, argv
        assert named in capsys.readouterr().err, argv
    assert [s.itl_ms for s in scenarios(_args())][4:] == [200.0, 400.0, None]
    assert [s.itl_ms for s in scenarios(_args("--itl-ms-sweep", "150"))][4:] == [150.0, None]


def test_every_scenario_writes_a_valid_pool_file():
    args = _args()
    names = [s.name for s in scenarios(args)]
    assert names[:4] == ["chat alone", "rag alone", "split", "shared"] and names[-1] == "chunk-only"
    assert "split itl 200 ms" in names and "split itl 400 ms" in names
    assert len(scenarios(_args("--quick"))) == 4
    for scenario in scenarios(args):
        config = load_config(pools_yaml(scenario, args), env={})
        pools = {p.name: p for p in config.pools}
        assert not any(p.enable_prefix_caching for p in config.pools)
        if scenario.layout == "shared":
            assert list(pools) == ["shared"] and pools["shared"].slo is None
        else:
            assert pools["rag"].slo is None
            assert (pools["chat"].slo is None) == (scenario.itl_ms is None)
            if scenario.itl_ms:
                assert pools["chat"].slo.itl_ms == scenario.itl_ms
            else:       # chunk-only opts out of any default slo
                assert load_yaml(pools_yaml(scenario, args), "pools")["pools"][0]["slo"] is None


def test_ratios_table_and_verdict():
    results = [
        {"scenario": "chat alone", "ttft_p99": 0.4, "itl_p99": 0.08, "chat_preemptions": 0, "chat_count": 120,
         "chat_device_share": 0.5},
        {"scenario": "rag alone", "rag_tokens_per_s": 100.0, "chat_preemptions": 0, "rag_device_share": 0.9},
        {"scenario": "split", "ttft_p99": 0.45, "itl_p99": 0.09, "chat_preemptions": 0, "rag_tokens_per_s": 30.0,
         "chat_count": 120, "rag_device_share": 0.25, "slo_ms": [1000, 100]},
        {"scenario": "shared", "ttft_p99": 4.0, "itl_p99": 2.0, "chat_preemptions": 0, "rag_tokens_per_s": 90.0},
    ]
    add_ratios(results)
    assert results[2]["ttft_p99_ratio"] == pytest.approx(1.125) and results[2]["itl_p99_ratio"] == pytest.approx(1.125)
    assert results[2]["rag_ratio"] == pytest.approx(0.3) and results[3]["ttft_p99_ratio"] == pytest.approx(10)
    lines = verdict(results)
    assert lines[0].startswith("verdict: met (slo ttft 1000 ms, itl 100 ms; chat alone used 50% of the device)")
    assert all(line.startswith("met") for line in lines[1:])
    results[2]["rag_device_share"] = 0.1            # under min_share 0.2
    assert verdict(results)[0].startswith("verdict: NOT met: rag share")
    table = format_table(results)
    assert "split" in table and "1.12x" in table and "0.30x" in table


def test_a_chat_request_never_answered_counts_as_its_wait_not_as_nothing():
    from bench.isolation.scenarios import chat_ttfts
    from bench.load.sender import RequestRecord

    answered = RequestRecord(0, "chat", "chat", 1.0, 10, 8, sent_s=1.0, end_s=2.0, status="ok", error=None)
    answered.chunk_s = [0.3, 0.4]
    streaming = RequestRecord(1, "chat", "chat", 2.0, 10, 8, sent_s=2.0, status="unfinished", error="in flight")
    streaming.chunk_s = [5.0]
    waiting = RequestRecord(2, "chat", "chat", 3.0, 10, 8, sent_s=3.0, status="unfinished", error="in flight")
    never_sent = RequestRecord(3, "chat", "chat", 29.0, 10, 8)
    assert chat_ttfts([answered, streaming, waiting, never_sent], run_seconds=30.0) == [0.3, 5.0, 27.0]


def _make_chat_record(index: int, chunk_s: list[float], status: str = "ok", late_s: float = 0.0) -> RequestRecord:
    """A chat request drawn at `index` s, sent `late_s` after, whose one-token chunks came `chunk_s` after."""
    r = RequestRecord(index, "chat", "chat", float(index), 60, 32, sent_s=index + late_s, status=status,
                      error=None if status == "ok" else "cut off")
    r.chunk_s, r.chunk_tokens, r.end_s = list(chunk_s), [1] * len(chunk_s), index + late_s + chunk_s[-1]
    return r


def _make_report(records: list[RequestRecord], cls=CHAT, scrapes: tuple = ()):
    config = LoadConfig(url="http://127.0.0.1:1", classes=(cls,), duration=150.0, scrape=False)
    return dataclasses.replace(build_report(config, "m", records, None, 165.0), scrapes=scrapes)


def test_chat_itl_counts_the_gaps_of_every_chat_request_sent():
    """140 streams at 20 ms a token, 10 at 1 s a token cut off at the drain, 2 failed mid-stream: the ITL
    verdict sees the slow streams' gaps (as TTFT counts every request sent); `bench serve`'s per-class
    summary stays over the completed requests, as it says."""
    records = [_make_chat_record(i, [0.2 + 0.02 * k for k in range(32)]) for i in range(140)]
    records += [_make_chat_record(140 + j, [0.2 + 1.0 * k for k in range(15)], "unfinished") for j in range(10)]
    records += [_make_chat_record(150 + j, [0.2, 0.22, 2.22], "error") for j in range(2)]
    result = summarize(Scenario("split", "split", True, False, 100.0), _make_report(records), None)
    gaps = [gap for r in records for gap in r.itl]
    assert len(result["itl_samples"]) == len(gaps) == 140 * 31 + 10 * 14 + 2 * 2
    assert result["itl_p99"] == pytest.approx(latency_stats(gaps)["p99"]) and result["itl_p99"] > 0.9
    cell = _judge(_run(0.2, 0.02), {**result, "chat_preemptions": 0, "rag_device_share": 0.5},
                  _run(rag=10.0, rag_share=0.5))
    assert cell["failed_bars"] == ["split_itl_ok"]
    assert _make_report(records).summary["chat"]["itl"]["p99"] == pytest.approx(0.02)


def test_shared_rag_tokens_subtract_chat_tokens_of_the_counter_window():
    """The first scrape failed: the counter's window is 1..11 s; chat's tokens (all before 1 s) are outside it,
    so every counted token is rag's."""
    def scrape(t: float, computed: float) -> ScrapeSample:
        return ScrapeSample(t, 0.01, {"shared": {"computed_tokens_total": computed, "num_preemptions_total": 0.0}})

    scrapes = (ScrapeSample(0.0, 10.0, {}, "TimeoutError: "), scrape(1.0, 100.0), scrape(11.0, 1100.0))
    chat = _make_report([_make_chat_record(0, [0.4 + 0.04 * k for k in range(10)])], scrapes=scrapes)
    result = summarize(Scenario("shared", "shared", True, True), chat, _make_report([], RAG))
    assert result["rag_tokens_per_s"] == pytest.approx(100.0)


def test_shared_rag_tokens_are_never_below_zero():
    """A chat prompt is counted at its first token, which can arrive after the step that computed it (here
    before the window): the window's chat tokens then exceed the counter's increase, and rag did none."""
    def scrape(t: float, computed: float) -> ScrapeSample:
        return ScrapeSample(t, 0.01, {"shared": {"computed_tokens_total": computed, "num_preemptions_total": 0.0}})

    chat = _make_report([_make_chat_record(1, [0.5 + 0.05 * k for k in range(4)])],
                        scrapes=(scrape(1.0, 60.0), scrape(3.0, 64.0)))
    result = summarize(Scenario("shared", "shared", True, True), chat, _make_report([], RAG))
    assert result["rag_tokens_per_s"] == 0.0


def test_send_lag_makes_a_run_invalid_not_judged():
    """Requests that left 3 s late read TTFTs of 50 ms; the run carries its send lag, and the verdict calls the
    load invalid rather than met (a tenth of ttft_ms: 100 ms), at the point and in a sweep's cell."""
    late = [_make_chat_record(i, [0.05, 0.07], late_s=3.0) for i in range(150)]
    result = summarize(Scenario("split", "split", True, False, 100.0), _make_report(late), None)
    assert result["send_lag_max_s"] == pytest.approx(3.0) and result["send_lag_p99_s"] == pytest.approx(3.0)
    alone, base = _run(0.4, 0.05), _run(rag=100.0, rag_share=0.9)
    split = {**_run(0.05, 0.02, rag_share=0.3), "send_lag_max_s": result["send_lag_max_s"]}
    cell = _judge(alone, split, base)
    assert not cell["send_lag_ok"] and cell["in_scope"] and cell["cell_ok"] is None and cell["failed_bars"] == []
    assert verdict_text(cell) == "invalid: send lag over 100 ms (split 3000 ms), not judged"
    on_time = _judge(alone, {**split, "send_lag_max_s": 0.099}, {**base, "send_lag_max_s": 0.01})
    assert on_time["send_lag_ok"] and on_time["cell_ok"] is True
    assert not _judge({**alone, "send_lag_max_s": 0.2}, {**split, "send_lag_max_s": 0.0}, base)["send_lag_ok"]
    results = [{**alone, "scenario": "chat alone"}, {**base, "scenario": "rag alone"},
               {**split, "scenario": "split", "slo_ms": [1000, 100]},
               {**_run(4.0, 2.0), "scenario": "shared", "send_lag_max_s": 0.01}]
    add_ratios(results)
    lines = verdict(results)
    assert lines[0].startswith("verdict: invalid: send lag over 100 ms (split 3000 ms)")
    assert lines[1].startswith("NOT met: every request sent within 100 ms of its arrival")
    assert all(line.startswith("not judged: ") for line in lines[2:-1]) and lines[-1].startswith("met: shared")
    assert "3000" in format_table(results).splitlines()[4]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, builtin_path):
    # the builtin tokenizer's whole vocabulary (the bench's prompts are its words), a context for rag's prompts
    return make_tiny_model(tmp_path_factory.mktemp("isolation-bench") / "llama", "llama", builtin_path,
                           vocab_size=49152, max_position_embeddings=4096)


@pytest.mark.slow   # ~25 s: four servers; the runner's pieces are tested above, the cliff by tests/gateway/test_spiral.py
def test_quick_run_end_to_end(tmp_path, capsys, tiny_model):
    """`--quick` with 1.5 s of arrivals on a tiny model (the command's path, not the builtin model's speed):
    four servers, one per scenario, their records printed and saved and the plot drawn. What the run measures
    is timing on a machine the suite shares, so it is not judged here: what makes the cliff is shown by
    tests/engine/test_isolation.py (chat behind a rag chunk, and the step composer's bound) and
    tests/gateway/test_spiral.py (the shared layout trips the spiral gauge under a load the split one does
    not), and the cliff is measured by the full bench (docs/PERF.md)."""
    argv = ["bench", "isolation", "--quick", "--duration", "1.5", "--drain-timeout", "2", "--chat-rate", "4",
            "--rag-rate", "2", "--json", "--model", str(tiny_model)]   # seeded: 8 chat and 2 rag requests
    assert main([*argv, "--out", str(tmp_path)]) == 0
    printed = {r["scenario"]: r for r in json.loads(capsys.readouterr().out)}
    saved = {r["scenario"]: r for r in json.loads((tmp_path / "isolation.json").read_text())}
    assert list(printed) == list(saved) == ["chat alone", "rag alone", "split", "shared"]
    assert (tmp_path / "isolation.png").read_bytes()[:8] == PNG
    split, shared = printed["split"], printed["shared"]
    assert all(printed[name]["chat_count"] > 0 for name in ("chat alone", "split", "shared"))
    assert split["chat_preemptions"] == 0 and split["rag_count"] > 0 and shared["rag_count"] > 0
    assert split["rag_tokens_per_s"] > 0 and printed["rag alone"]["rag_tokens_per_s"] > 0
    assert shared["ttft_p99"] > 0
    assert max(r["max_scrape_s"] for r in printed.values()) < 0.5


# --- --sweep ------------------------------------------------------------------------------------------------


def test_sweep_grid_runs_and_seeds():
    grid = sweep_grid(_args("--sweep"))
    assert (grid.chat_rates, grid.rag_rates, grid.rag_lens) == ((0.5, 1.0, 2.0), (0.1, 0.2, 0.4), (1500, 3000))
    assert len(grid.cells) == 18
    runs = plan_runs(grid)
    kinds = [r.kind for r in runs]
    assert [kinds.count(k) for k in ("chat alone", "rag alone", "split", "shared")] == [3, 6, 18, 18]
    assert [r.layout for r in runs] == ["split"] * 27 + ["shared"] * 18      # one server per layout, in turn
    assert len({grid.chat_seed(c) for c in grid.chat_rates} | {grid.rag_seed(r, n) for r, n in grid.rag_pairs}) == 9
    rag = grid.rag_class(3000)
    assert (rag.prompt_len.min, rag.prompt_len.max, rag.output_len.value) == (2400, 3600, 128)
    quick = sweep_grid(_args("--sweep", "--quick"))
    assert (len(quick.chat_rates), len(quick.rag_rates), len(quick.rag_lens)) == (2, 1, 1)
    assert len(plan_runs(quick)) == 7
    assert {r.kind for r in plan_runs(sweep_grid(_args("--sweep", "--no-shared")))} == {
        "chat alone", "rag alone", "split"}
    own = sweep_grid(_args("--sweep", "--quick", "--chat-rates", "1", "--rag-lens", "700", "--rag-output-tokens", "8"))
    assert own.chat_rates == (1.0,) and own.rag_lens == (700,) and own.rag_class(700).output_len.value == 8
    with pytest.raises(ValueError, match="--rag-lens"):    # 0.8 x 600 = 480 tokens would go to chat
        sweep_grid(_args("--sweep", "--rag-lens", "600"))
    with pytest.raises(ValueError, match="--chat-rates"):
        sweep_grid(_args("--sweep", "--chat-rates", "1,0"))


def test_a_rag_alone_baseline_runs_as_long_as_the_cells_it_is_compared_with(monkeypatch):
    """Its rag arrivals (the seed of its rag pair) cover the longest of its cells' runs: it ran 30 s (three
    rag requests at 0.1/s) beside cells whose chat rate of 0.5/s sends rag for 260 s."""
    import asyncio

    import bench.isolation as isolation
    from bench.isolation.grid import Run

    durations: dict[str, list[float]] = {}

    async def run_loads(configs, tokenizer):
        durations[kind] = [c.duration for c in configs]
        raise RuntimeError("stop here: the loads are all this test reads")

    monkeypatch.setattr(isolation, "run_loads", run_loads)
    args = _args("--sweep")
    grid = sweep_grid(args)
    for kind, run in (("rag alone", Run("rag alone", "split", rag_rate=0.1, rag_len=1500)),
                      ("split", Run("split", "split", 0.5, 0.1, 1500)),
                      ("fast split", Run("split", "split", 2.0, 0.1, 1500))):
        with pytest.raises(RuntimeError, match="stop here"):
            asyncio.run(isolation.execute(run, grid, "http://127.0.0.1:1", args, tokenizer=None))
    assert durations["rag alone"] == [durations["split"][-1]] and durations["split"][-1] > durations["fast split"][-1]
    kind, alone = "one cell again", durations["rag alone"]   # `--cells`: the baseline the whole grid had
    some = sweep_grid(_args("--sweep", "--cells", "2,0.1,1500"))
    with pytest.raises(RuntimeError, match="stop here"):
        asyncio.run(isolation.execute(Run("rag alone", "split", rag_rate=0.1, rag_len=1500), some,
                                      "http://127.0.0.1:1", args, tokenizer=None))
    assert durations["one cell again"] == alone


def test_the_bench_counts_itl_per_token():
    """Its loads ask for the usage in every chunk, so a chunk that carries two tokens (a token held back
    until its character is whole) is two gaps of half its wait, not one gap twice as long."""
    config = load_config_of("http://127.0.0.1:1", CHAT, 1.0, seed=0, scrape=False, duration=5.0, drain_timeout=1.0)
    assert config.continuous_usage


def test_sweep_cells_run_again_with_the_arrivals_of_the_whole_grid():
    whole = sweep_grid(_args("--sweep", "--chat-rates", "0.75,1,1.25"))
    some = sweep_grid(_args("--sweep", "--chat-rates", "0.75,1,1.25", "--cells", "1.25,0.2,3000; 0.75,0.4,1500"))
    assert some.cells == [(0.75, 0.4, 1500), (1.25, 0.2, 3000)]
    assert [(r.kind, r.chat_rate, r.rag_rate, r.rag_len) for r in plan_runs(some) if r.layout == "split"] == [
        ("chat alone", 0.75, None, None), ("chat alone", 1.25, None, None), ("rag alone", None, 0.2, 3000),
        ("rag alone", None, 0.4, 1500), ("split", 0.75, 0.4, 1500), ("split", 1.25, 0.2, 3000)]
    for c, r, n in some.cells:
        assert (some.chat_seed(c), some.rag_seed(r, n)) == (whole.chat_seed(c), whole.rag_seed(r, n))
    for bad in ("2,0.2,3000", "1.25,0.2", "1.25,x,3000", "1.25,0.2,0"):
        with pytest.raises(ValueError, match="--cells"):
            sweep_grid(_args("--sweep", "--chat-rates", "0.75,1,1.25", "--cells", bad))


@pytest.mark.parametrize("argv", [(), ("--no-slo",), ("--rag-lens", "3400", "--rag-output-tokens", "200"),
                                  ("--chat-kv-share", "0.3")])
def test_sweep_pool_files(argv):
    args = _args("--sweep", *argv)
    grid = sweep_grid(args)
    files = sweep_pool_files(args, grid)
    for layout, text in files.items():
        raw = load_yaml(text, "pools")
        assert all(p["enable_prefix_caching"] is False for p in raw["pools"])
        config = load_config(text, env={})
        plan = plan_capacity(config, resolve_model_configs(config))     # raises if a pool cannot hold its context
        longest = round(1.2 * max(grid.rag_lens)) + grid.rag_output_tokens
        rag_pool = "shared" if layout == "shared" else "rag"
        assert plan.pools[rag_pool].max_model_len >= longest
        if layout == "shared":
            assert [p["name"] for p in raw["pools"]] == ["shared"] and "slo" not in raw["pools"][0]
            continue
        chat, rag = raw["pools"]
        assert chat["route"]["max_prompt_tokens"] < round(0.8 * min(grid.rag_lens)) and \
            rag["route"]["min_prompt_tokens"] == chat["route"]["max_prompt_tokens"] + 1
        shares = (0.3, 0.7) if "--chat-kv-share" in argv else (0.4, 0.6)
        assert (chat["kv_share"], rag["kv_share"]) == shares and "slo" not in rag
        if "--no-slo" in argv:
            assert "slo" not in chat       # the defaults of a device with several pools apply
        else:
            assert chat["slo"] == {"ttft_ms": 1000, "itl_ms": 100}


def test_sweep_pool_files_on_another_device_and_model():
    args = _args("--sweep", "--device", "cuda", "--model", "/models/smollm2")
    for text in sweep_pool_files(args, sweep_grid(args)).values():
        raw = load_yaml(text, "pools")
        assert raw["devices"] == {"dev": {"device": "cuda", "memory": "1GiB", "dtype": "bfloat16"}}
        assert {p["model"] for p in raw["pools"]} == {"/models/smollm2"}
    args = _args("--sweep", "--device", "cuda", "--dtype", "float16")
    assert all("dtype: float16" in text for text in sweep_pool_files(args, sweep_grid(args)).values())


def _run(ttft=None, itl=None, preempt=0, rag=None, chat_share=0.5, rag_share=None, count=120, overloaded=None):
    return {"ttft_p99": ttft, "itl_p99": itl, "chat_preemptions": preempt, "rag_tokens_per_s": rag,
            "chat_device_share": chat_share, "rag_device_share": rag_share, "chat_count": count,
            "overloaded_first_s": overloaded}


def _judge(alone, split, rag_alone):
    return judge(alone, split, rag_alone, ttft_ms=1000, itl_ms=100, min_share=0.2)


def test_verdict_bars():
    alone, base = _run(0.4, 0.05), _run(rag=100.0, rag_share=0.9)
    ok = _judge(alone, _run(0.6, 0.1, rag=30.0, rag_share=0.2), base)
    assert all(ok[b] for b in BARS) and ok["in_scope"] and ok["cell_ok"] is True and ok["failed_bars"] == []
    assert ok["split_ttft_bound_s"] == pytest.approx(0.625) and ok["split_ttft_slo_ratio"] == pytest.approx(0.6)
    assert ok["rag_ratio"] == pytest.approx(0.3) and verdict_text(ok) == "met" and not ok["overloaded"]
    # TTFT: within the SLO but above 1.25 x (alone + itl_ms); then above the SLO though alone is slow
    assert _judge(alone, _run(0.63, 0.05, rag_share=0.3), base)["failed_bars"] == ["split_ttft_ok"]
    slow = _judge(_run(0.9, 0.05), _run(1.01, 0.05, rag_share=0.3), base)
    assert slow["failed_bars"] == ["split_ttft_ok"] and slow["split_ttft_bound_s"] == 1.0
    # ITL: the SLO itself; no completed chat request is no ITL, a miss
    assert _judge(alone, _run(0.5, 0.101, rag_share=0.3), base)["failed_bars"] == ["split_itl_ok"]
    assert _judge(alone, _run(0.5, None, rag_share=0.3), base)["failed_bars"] == ["split_itl_ok"]
    # preemptions, or none measured
    assert _judge(alone, _run(0.5, 0.1, preempt=1, rag_share=0.3), base)["failed_bars"] == ["split_no_preemption"]
    assert not _judge(alone, _run(0.5, 0.1, preempt=None, rag_share=0.3), base)["split_no_preemption"]
    # rag's device share: min_share, or rag alone's when that is less
    starved = _judge(alone, _run(0.5, 0.1, rag_share=0.19), base)
    assert starved["failed_bars"] == ["rag_share_ok"] and starved["cell_ok"] is False
    assert verdict_text(starved) == "NOT met: rag share" and starved["rag_device_share_owed"] == 0.2
    light = _judge(alone, _run(0.5, 0.1, rag_share=0.1), _run(rag=10.0, rag_share=0.1))
    assert light["rag_share_ok"] and light["rag_device_share_owed"] == 0.1
    # a small share, but all the tokens/s rag computes alone: it was owed nothing more; a hair less is starved
    served = _judge(alone, _run(0.5, 0.1, rag=100.0, rag_share=0.17), base)
    assert served["rag_share_ok"] and served["cell_ok"] and served["rag_ratio"] == pytest.approx(1.0)
    assert not _judge(alone, _run(0.5, 0.1, rag=99.0, rag_share=0.17), base)["rag_share_ok"]
    # fewer than 100 chat requests: not met; overloaded: marked, still judged
    few = _judge(alone, _run(0.5, 0.1, rag_share=0.3, count=60), base)
    assert few["failed_bars"] == ["enough_samples"] and verdict_text(few) == "NOT met: < 100 chat requests"
    marked = _judge(alone, _run(0.5, 0.1, rag_share=0.3, overloaded=12.0), base)
    assert marked["overloaded"] and marked["cell_ok"] and verdict_text(marked) == "met [overloaded]"
    # out of scope by load: chat alone used more than 1 - min_share of the device; not judged
    for alone_out in (_run(0.4, 0.05, chat_share=0.85), _run(0.4, 0.05, chat_share=None)):
        out = _judge(alone_out, _run(5.0, 1.0, preempt=3, rag_share=0.0), base)
        assert not out["in_scope"] and out["cell_ok"] is None and out["failed_bars"] == []
        assert verdict_text(out).startswith("out of scope (chat alone uses ")


def _made_up_runs(grid: Grid) -> list:
    """Results of every run of `grid` as `run_all` returns them: chat at 2/s alone uses 90% of the device;
    the 0.4/s rag flood with long prompts pushes split chat past its TTFT bar and overloads the device."""
    results = []
    for run in plan_runs(grid):
        r = {"server_url": f"http://127.0.0.1:{1 if run.layout == 'split' else 2}", "wall_s": 30.0,
             "idle_wait_s": 0.5, "idle_before": True, "chat_preemptions": 0, "overloaded_first_s": None}
        flood = run.rag_rate == 0.4 and run.rag_len == 3000
        r["send_lag_max_s"] = 0.25 if (run.kind, run.chat_rate, run.rag_rate, run.rag_len) == (
            "split", 0.5, 0.1, 1500) else 0.002      # the client fell behind in one split run
        if run.chat_rate:
            ttft = 0.3 + (0.5 if run.kind == "split" and flood else 0)
            r.update(ttft_p99=8.0 if run.kind == "shared" else ttft, chat_count=120,
                     itl_p99=0.3 if run.kind == "shared" else 0.05, chat_device_share=0.45 * run.chat_rate)
        if run.rag_rate:
            r.update(rag_tokens_per_s=100.0 if run.kind == "rag alone" else 40.0,
                     rag_device_share=0.9 if run.kind == "rag alone" else 0.25)
            if flood and run.kind == "split":
                r["overloaded_first_s"] = 9.5
        results.append((run, r))
    return results


def test_sweep_table_summary_and_heatmap(tmp_path):
    args = _args("--sweep")
    grid = sweep_grid(args)
    data = assemble(grid, _made_up_runs(grid), args)
    cells = data["cells"]
    assert len(cells) == 18 and len(data["baselines"]["chat_alone"]) == 3 and len(data["baselines"]["rag_alone"]) == 6
    assert data["summary"] == {"cells": 18, "in_scope": 12, "met": 9, "invalid": 1, "overloaded": 3, "runs": 45,
                               "servers": 2, "runs_s": 45 * 30.5}
    assert [c["verdict"] for c in cells if c["in_scope"] and c["cell_ok"] is False] == [
        "NOT met: ttft [overloaded]"] * 2
    assert [c["verdict"] for c in cells if c["in_scope"] and c["cell_ok"] is None] == [
        "invalid: send lag over 100 ms (split 250 ms), not judged"]
    assert summary_line(data) == ("cells in scope: 12 of 18 (the rest: chat alone uses more than 1 - min_share of the "
                                  "device); met: 9 of 12; invalid (a run's requests sent too late, not judged): 1; "
                                  "overloaded (the gauge said so): 3")
    table = format_sweep_table(data)
    assert len(table.splitlines()) == 19 and "out of scope" in table and "NOT met: ttft" in table
    assert "invalid: send lag" in table
    write_heatmap(data, tmp_path / "sweep.png", 1000)
    assert (tmp_path / "sweep.png").read_bytes()[:8] == PNG


def test_pending_work_reads_the_metrics():
    busy = "\n".join([
        'cliffguard_num_requests_running{pool="chat"} 0.0', 'cliffguard_num_requests_running{pool="rag"} 1.0',
        'cliffguard_num_requests_waiting{pool="rag"} 2.0', 'cliffguard_num_requests_swapped{pool="rag"} 0.0',
        'cliffguard_admission_queue_depth{pool="rag",tenant="default"} 3.0',
        'cliffguard_kv_credits{pool="rag"} 5568.0', 'cliffguard_kv_credits_free{pool="rag"} 1568.0',
        'cliffguard_kv_credits{pool="chat"} 3712.0', 'cliffguard_kv_credits_free{pool="chat"} 3712.0', ""])
    assert pending_work(busy) == ["rag: 1 running", "rag: 2 waiting", "rag: 3 queued for KV credits",
                                  "rag: 4000 KV credits held"]
    idle = busy.replace("1.0", "0.0").replace("2.0", "0.0").replace("3.0", "0.0").replace("1568.0", "5568.0")
    assert pending_work(idle) == []
    assert pending_work(idle + 'cliffguard_device_overloaded{device="dev"} 1.0\n') == [
        "the device still says it is overloaded"]


@pytest.mark.slow   # ~45 s; the quick single run above covers the same runner (slow too)
def test_sweep_quick_end_to_end(tmp_path, capsys):
    # the quick grid cut to one cell and 5 s of arrivals (the suite's time): chat alone, rag alone, split
    # on one server, shared on another
    argv = ["bench", "isolation", "--sweep", "--quick", "--chat-rates", "2", "--duration", "5", "--drain-timeout", "3"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "cells in scope:" in printed and "chat/s" in printed
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert (tmp_path / "sweep.png").read_bytes()[:8] == PNG
    assert {"args", "commit", "date", "grid", "baselines", "cells", "summary", "duration_s"} <= set(data)
    assert data["args"]["sweep"] and data["duration_s"] == 5.0 and data["slo_in_pool_file"]
    assert data["grid"]["chat_rates"] == [2.0] and data["grid"]["rag_lens"] == [1500]
    alone = {r["chat_rate"]: r for r in data["baselines"]["chat_alone"]}
    (rag_alone,) = data["baselines"]["rag_alone"]
    assert set(alone) == {2.0} and rag_alone["rag_len"] == 1500 and rag_alone["rag_tokens_per_s"] is not None
    runs = [*alone.values(), rag_alone] + [c["runs"][k] for c in data["cells"] for k in ("split", "shared")]
    assert len(runs) == data["summary"]["runs"] == 4 and all(r["idle_before"] for r in runs)
    split_urls = {r["server_url"] for r in runs if r["layout"] == "split"}
    shared_urls = {r["server_url"] for r in runs if r["layout"] == "shared"}
    assert len(split_urls) == len(shared_urls) == 1 and split_urls != shared_urls      # one server per layout
    assert {data["servers"][layout]["url"] for layout in ("split", "shared")} == split_urls | shared_urls
    assert len(data["cells"]) == data["summary"]["cells"] == 1
    for cell in data["cells"]:
        split, shared = cell["runs"]["split"], cell["runs"]["shared"]
        base = alone[cell["chat_rate"]]
        assert all(isinstance(cell[b], bool) for b in BARS) and cell["cell_ok"] in (True, False, None)
        judged = cell["in_scope"] and cell["send_lag_ok"]
        assert (cell["cell_ok"] is None) == (not judged)
        assert "enough_samples" in cell["failed_bars"] or not judged     # --quick: too few to judge
        # the same chat arrivals alone, split and shared; the same rag arrivals alone and in the cell
        assert base["chat_seed"] == split["chat_seed"] == shared["chat_seed"] == cell["chat_seed"]
        assert base["chat_count"] == split["chat_count"] == shared["chat_count"] > 0
        assert rag_alone["rag_seed"] == split["rag_seed"] == shared["rag_seed"] == cell["rag_seed"]
        assert cell["ttft_p99_split"] == split["ttft_p99"] and cell["ttft_p99_alone"] == base["ttft_p99"]
        assert split["chat_preemptions"] == 0 == cell["split_chat_preemptions"]
        assert 0 <= base["chat_device_share"] <= 1 and 0 <= split["rag_device_share"] <= 1 and cell["verdict"]
