"""`bench serve` against an autoscaling gateway: replicas by state and the KV-credit queue in every scrape,
the report's `replicas_timeline`, its plot, and `--rate-phases`. No model: a fake server and fake samples."""

from __future__ import annotations

import argparse
import json
import math
from types import SimpleNamespace

import pytest
from aiohttp import web

from bench import serve
from bench.load.plan import LoadConfig
from bench.load.report import build_report, format_report, replica_summary, replicas_timeline, write_report
from bench.load.run import RatePhase, parse_rate_phases, phase_time, plan_phased, run_load
from bench.load.scrape import ScrapeSample, Scraper, parse_metrics, replica_states
from bench.load.sender import RequestRecord
from gateway.admission import AdmissionMetrics
from gateway.monitoring.metrics import GatewayMetrics
from pools.workload import LengthDist, WorkloadClass

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
URL = "http://127.0.0.1:8000"


def _fixed(name: str, output_len: int = 2, **kwargs) -> WorkloadClass:
    return WorkloadClass(name, prompt_len=LengthDist("fixed", value=8), output_len=LengthDist("fixed", value=output_len),
                         **kwargs)


def _make_metrics_text(replicas: dict[str, dict[str, float]], queued: dict[str, float]) -> str:
    """The gateway's own exposition with `cliffguard_replicas` set to `replicas` and the chat pool's
    credit queue to `queued` (tenant -> requests)."""
    metrics = GatewayMetrics()
    admission = AdmissionMetrics(metrics.registry)
    for device, states in replicas.items():
        for state, count in states.items():
            metrics.replicas.labels(device=device, state=state).set(count)
    for tenant, depth in queued.items():
        admission.queue_depth.labels(pool="chat", tenant=tenant).set(depth)
    metrics.replica_scalings.labels(device="gpu0", direction="up").inc()
    return metrics.render().decode()


def _sample(t_s: float, replicas: dict[str, dict[str, float]], error: str | None = None, **pools) -> ScrapeSample:
    return ScrapeSample(t_s, 0.01, pools, error, replicas=replicas)


def _record(index: int, sent_s: float, ttft: float | None) -> RequestRecord:
    record = RequestRecord(index, "chat", "chat", sent_s, 8, 2, sent_s=sent_s)
    if ttft is not None:
        record.status, record.error, record.end_s = "ok", None, sent_s + ttft + 0.01
        record.chunk_s, record.chunk_tokens = [ttft, ttft + 0.01], [1, 1]
    return record


def _make_report(scrapes: list[ScrapeSample], rate_phases=((2.0, 2.0), (0.0, 1.0), (4.0, 1.0))):
    config = LoadConfig(url=URL, model="fake", classes=(_fixed("chat"),), duration=4.0)
    records = [_record(i, 0.37 * i, 0.05 * (1 + i % 4) if i % 5 else None) for i in range(12)]
    scraper = SimpleNamespace(samples=scrapes, skipped=None)
    return build_report(config, "fake", records, scraper, 4.5, rate_phases=rate_phases)


FAKE_SCRAPES = [
    _sample(0.0, {"gpu0": {"ready": 1, "loading": 0, "stopped": 1}}, chat={"admission_queue_depth": 0.0}),
    _sample(1.0, {"gpu0": {"ready": 1, "loading": 1, "stopped": 0}}, chat={"admission_queue_depth": 5.0}),
    _sample(1.5, {}, "TimeoutError: slow"),
    _sample(2.0, {"gpu0": {"ready": 2, "loading": 0, "draining": 0}, "gpu1": {"ready": 1}},
            chat={"admission_queue_depth": 1.0}),
    _sample(3.0, {"gpu0": {"ready": 1, "draining": 1}, "gpu1": {"ready": 1}}, chat={"admission_queue_depth": 0.0}),
]


# --- scraping ----------------------------------------------------------------------------------------------------

def test_replicas_and_the_credit_queue_are_parsed_from_the_gateways_exposition():
    text = _make_metrics_text({"gpu0": {"ready": 2, "loading": 1, "stopped": 1}, "gpu1": {"ready": 1}},
                              {"alice": 2, "bob": 1, "batch": 4})
    assert replica_states(text) == {"gpu0": {"ready": 2.0, "loading": 1.0, "stopped": 1.0}, "gpu1": {"ready": 1.0}}
    assert parse_metrics(text)["chat"]["admission_queue_depth"] == 7.0   # summed over tenants, batch included
    other = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 3\n"
    assert replica_states(other) == {} and replica_states("") == {}


async def test_a_scrape_keeps_replicas_by_state_and_nothing_from_another_server(aiohttp_server):
    texts = iter([_make_metrics_text({"gpu0": {"ready": 1, "loading": 1}}, {"alice": 3}),
                  "# TYPE other gauge\nother 1\n"])

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=next(texts))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    server = await aiohttp_server(app)
    config = LoadConfig(url=str(server.make_url("")), model="fake", duration=1.0)
    import aiohttp

    async with aiohttp.ClientSession() as session:
        scraper = Scraper(session, config, 0.0)
        assert await scraper.scrape_once() and await scraper.scrape_once()
    cliffguard, other = scraper.samples
    assert cliffguard.error is None and cliffguard.replicas == {"gpu0": {"ready": 1.0, "loading": 1.0}}
    assert cliffguard.pools["chat"]["admission_queue_depth"] == 3.0
    assert other.error is None and other.replicas == {} and other.pools == {}


# --- the report ---------------------------------------------------------------------------------------------------

def test_the_timeline_has_every_state_seen_and_the_summary_the_peaks():
    timeline = replicas_timeline(FAKE_SCRAPES)
    assert [(e["t_s"], e["device"]) for e in timeline] == [(0.0, "gpu0"), (1.0, "gpu0"), (2.0, "gpu0"),
                                                           (2.0, "gpu1"), (3.0, "gpu0"), (3.0, "gpu1")]
    assert all(set(e) == {"t_s", "device", "ready", "loading", "stopped", "draining"} for e in timeline)
    assert timeline[3] == {"t_s": 2.0, "device": "gpu1", "ready": 1, "loading": 0.0, "stopped": 0.0, "draining": 0.0}
    assert [e["ready"] for e in timeline if e["device"] == "gpu0"] == [1, 1, 2, 1]
    assert replica_summary(FAKE_SCRAPES) == {
        "gpu0": {"max_ready": 2, "max_loading": 1, "max_stopped": 1, "max_draining": 1},
        "gpu1": {"max_ready": 1, "max_loading": 0, "max_stopped": 0, "max_draining": 0}}
    assert replicas_timeline([_sample(0.0, {}), _sample(1.0, {"gpu0": {"ready": 1}}, "HTTP 500")]) == []


def test_the_json_report_carries_the_timeline_the_peaks_and_the_phases():
    report = _make_report(FAKE_SCRAPES)
    data = report.to_json()
    assert data["replicas_timeline"] == replicas_timeline(FAKE_SCRAPES)
    assert data["totals"]["scrape"]["replicas"]["gpu0"]["max_ready"] == 2
    assert data["totals"]["scrape"]["pools"]["chat"]["max_admission_queue_depth"] == 5.0
    assert data["config"]["rate_phases"] == [{"rate": 2.0, "duration_s": 2.0}, {"rate": 0.0, "duration_s": 1.0},
                                             {"rate": 4.0, "duration_s": 1.0}]
    assert "replicas_timeline" not in report.to_json(raw=False)
    json.dumps(data)
    table = format_report(report)
    assert "rate phases 2 req/s for 2 s, 0 req/s for 1 s, 4 req/s for 1 s" in table
    assert "device gpu0: replicas max_ready 2, max_loading 1" in table and "waiting for credits max 5" in table
    plain = _make_report([_sample(0.0, {}, chat={"num_requests_running": 1.0})], rate_phases=())
    assert "replicas_timeline" not in plain.to_json() and plain.to_json()["config"]["rate_phases"] is None
    assert plain.totals["scrape"]["replicas"] == {} and "device" not in format_report(plain)


def test_the_replicas_plot_is_written_only_when_the_server_counted_replicas(tmp_path):
    paths = write_report(_make_report(FAKE_SCRAPES), tmp_path / "scaled")
    assert [p.name for p in paths] == ["results.json", "latency_cdf.png", "server_timeline.png",
                                       "replicas_timeline.png"]
    assert paths[-1].read_bytes()[:8] == PNG_SIGNATURE and paths[-1].stat().st_size > 5000
    plain = write_report(_make_report([_sample(0.0, {})], rate_phases=()), tmp_path / "plain")
    assert [p.name for p in plain] == ["results.json", "latency_cdf.png", "server_timeline.png"]
    assert not (tmp_path / "plain" / "replicas_timeline.png").exists()


# --- rate phases -----------------------------------------------------------------------------------------------

def test_rate_phases_parse_in_order_and_refuse_bad_items():
    assert parse_rate_phases("1:30, 4.5:60,0:90") == (RatePhase(1.0, 30.0), RatePhase(4.5, 60.0),
                                                      RatePhase(0.0, 90.0))
    for text in ("1", "x:3", "-1:3", "1:0", "inf:3", "1:30,", "1:nan"):
        with pytest.raises(ValueError, match="rate_phases: expected RATE:SECONDS"):
            parse_rate_phases(text)
    with pytest.raises(ValueError, match="at least one phase with RATE > 0"):
        parse_rate_phases("0:10,0:5")


def test_the_command_line_takes_rate_phases_in_place_of_rate_and_duration():
    config = serve.config_from_args(_parse(["--rate-phases", "2:5,0:5", "--request-rate", "9", "--duration", "3"]))
    assert config.request_rate == 1.0 and config.duration == 10.0 and config.num_requests is None
    assert serve.phases_from_args(_parse(["--rate-phases", "2:5,0:5"])) == (RatePhase(2.0, 5.0), RatePhase(0.0, 5.0))
    assert serve.phases_from_args(_parse([])) == ()
    with pytest.raises(ValueError, match="--rate-phases: expected RATE:SECONDS"):
        serve.config_from_args(_parse(["--rate-phases", "2-5"]))
    with pytest.raises(ValueError, match="--rate-phases: the phases end the arrivals"):
        serve.config_from_args(_parse(["--rate-phases", "2:5", "--num-requests", "4"]))


def test_phase_time_maps_the_mean_rate_run_onto_the_phases():
    phases = (RatePhase(1.0, 10.0), RatePhase(0.0, 10.0), RatePhase(3.0, 10.0))   # mean 4/3 req/s over 30 s
    assert phase_time(phases, 0.0) == 0.0
    assert phase_time(phases, 6.0) == pytest.approx(8.0)             # 8 arrivals expected: 8 s at 1 req/s
    assert phase_time(phases, 7.5 + 1e-9) == pytest.approx(20.0)     # past phase 1's 10: the idle phase skipped
    assert phase_time(phases, 15.0) == pytest.approx(20.0 + 10.0 / 3.0)
    assert phase_time(phases, 30.0) == pytest.approx(30.0)


def test_phased_arrivals_follow_the_rate_of_each_phase():
    phases = parse_rate_phases("2:50,0:20,8:30")
    config = LoadConfig(url=URL, model="fake", classes=(_fixed("chat"), _fixed("own", rate=1.0)), seed=7,
                        duration=1.0, probe_rate=0.5)
    plan = plan_phased(config, phases)
    assert [p.index for p in plan] == list(range(len(plan)))
    assert [p.arrival_s for p in plan] == sorted(p.arrival_s for p in plan)
    assert [(p.arrival_s, p.prompt) for p in plan] == [(p.arrival_s, p.prompt) for p in plan_phased(config, phases)]
    bounds = [(0.0, 50.0), (50.0, 70.0), (70.0, 100.0)]
    for name, rates in (("chat", (2.0, 0.0, 8.0)), ("own", (1.0, 1.0, 1.0)), ("probe", (0.5, 0.5, 0.5))):
        for (start, end), rate in zip(bounds, rates):
            count = sum(p.workload.name == name and start <= p.arrival_s < end for p in plan)
            expected = rate * (end - start)
            assert abs(count - expected) <= 4 * math.sqrt(expected) + 1, (name, start, count, expected)
    assert not any(p.workload.name == "chat" and 50.0 <= p.arrival_s < 70.0 for p in plan)
    assert max(p.arrival_s for p in plan) < 100.0


# --- end to end ----------------------------------------------------------------------------------------------------

async def test_a_phased_run_against_a_scaling_server_writes_the_timeline(aiohttp_server, tmp_path):
    state = {"scrapes": 0}

    async def completions(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(2):
            chunk = {"choices": [{"index": 0, "text": f" w{i}", "finish_reason": "length" if i else None}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def metrics(request: web.Request) -> web.Response:
        state["scrapes"] += 1
        ready = 1 + (state["scrapes"] > 3)
        return web.Response(text=_make_metrics_text({"gpu0": {"ready": ready, "loading": 2 - ready}}, {"a": 1}))

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    server = await aiohttp_server(app)
    config = LoadConfig(url=str(server.make_url("")), model="fake", classes=(_fixed("c", endpoint="completion"),),
                        duration=1.0, scrape_interval=0.1, drain_timeout=5.0)
    report = await run_load(config, phases=parse_rate_phases("30:0.4,0:0.3,30:0.3"))
    assert report.config.duration == pytest.approx(1.0) and report.config.request_rate == pytest.approx(21.0)
    assert report.totals["completed"] == report.totals["count"] > 0
    assert not [r for r in report.records if 0.4 <= r.scheduled_s < 0.7]
    paths = write_report(report, tmp_path)
    data = json.loads(paths[0].read_text())
    assert data["replicas_timeline"][0]["ready"] == 1 and data["totals"]["scrape"]["replicas"]["gpu0"]["max_ready"] == 2
    assert data["config"]["rate_phases"][1] == {"rate": 0.0, "duration_s": 0.3}
    assert paths[-1].name == "replicas_timeline.png" and paths[-1].read_bytes()[:8] == PNG_SIGNATURE


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)
