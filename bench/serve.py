"""`cliffguard bench serve`: an open-loop load generator for any OpenAI-compatible server.

Arrivals are drawn up front: each workload class is a gamma renewal process (gaps ~ Gamma(shape=burstiness,
mean 1/rate); burstiness 1 is Poisson, below 1 burstier, above 1 more regular) seeded by `--seed`. Every
request is sent at its arrival time whatever the others are doing (open loop: a slow server makes requests
pile up, it never slows the arrivals). Arrivals stop after `--duration` s and/or `--num-requests`; then
in-flight requests get at most `--drain-timeout` s, and those still running are cancelled and reported as
`unfinished` (so are requests past their own `--timeout`). The run always ends by itself. `--rate-phases
"1:30,6:60,0:90"` replaces `--request-rate` and `--duration` with a rate that changes over the run (1 req/s
for 30 s, then 6 for 60 s, then none for 90 s: an autoscaler's demo); see `bench.load.run.plan_phased`.

Workload classes come from a YAML file (`bench/workloads/*.yaml`, schema in `pools.workload.parse_workload`)
or the built-in default: per class a share of `--request-rate` (or an own `rate`), the endpoint (chat or
completion) and prompt and output length distributions in tokens. Requests stream (`stream: true`,
`stream_options.include_usage`) and send vLLM's `ignore_eos` so outputs have the asked length. Prompts are
random words from a list whose words are one token each for typical BPE tokenizers, so a prompt of N words
is about N tokens; with `--tokenizer` completion prompts hit N exactly. The words are random from the first
one, so no two prompts share a prefix and the server's prefix cache cannot flatter a run. `--probe-rate`
adds tiny Poisson probe requests (class `probe`: 8 prompt tokens, 2 output tokens): Poisson arrivals see
time averages, so their latency is how the load stalls an unrelated short request.

Measures, per request: send time, the arrival of every content chunk (TTFT = first; ITL = the gap
between consecutive content chunks divided by the tokens in the later chunk when the server tells them
(vLLM's `continuous_usage_stats`), else by 1), end of stream (e2e), prompt and output tokens from the
usage chunk, TPOT = (e2e - TTFT) / (output tokens - 1), HTTP errors and error chunks, and the pool from
the `x-cliffguard-pool` header. Per class: counts, mean/p50/p90/p99/max of TTFT, ITL, TPOT and e2e,
tokens/s and requests/s over the run, goodput against `--goodput` targets (a request is good when it
completed with TTFT <= ttft, mean TPOT <= itl and e2e <= e2e, for the targets given). Meanwhile
`/metrics` is scraped every `--scrape-interval` s with Prometheus' own parser: per pool KV usage,
running, waiting, preemptions and requests waiting for KV credits, each device's replicas by state
(`cliffguard_replicas`: the report's `replicas_timeline` and `replicas_timeline.png`, when the server
counts replicas), and the time each scrape took.

Python API (the package `bench.load`: `plan`, `sender`, `scrape`, `report`, `run`), for benchmarks
that drive load in-process inside their own asyncio program:

    from bench.load.plan import Goodput, LoadConfig
    from bench.load.report import write_report
    from bench.load.run import parse_rate_phases, run_load
    from pools.workload import load_workload

    config = LoadConfig(url="http://127.0.0.1:8000", model="smollm2-135m-instruct",
                        classes=load_workload("mixed"), request_rate=4.0, duration=30.0,
                        goodput=Goodput(ttft=0.5, itl=0.05))
    report = await run_load(config)              # LoadReport; never raises for a failed request
    report.summary["chat"]["ttft"]["p99"]        # seconds; None when no request of the class completed
    report.summary["chat"]["goodput"]["fraction"]
    report.totals["scrape"]["max_s"]             # slowest GET /metrics
    report.totals["scrape"]["replicas"]          # {device: {max_ready, max_loading, ...}} from cliffguard
    report.records                               # one RequestRecord per request, in arrival order
    write_report(report, "out/")                 # results.json, latency_cdf.png, server_timeline.png
                                                 # (+ replicas_timeline.png from a cliffguard gateway)
    phases = parse_rate_phases("1:30,6:60,0:90")
    report = await run_load(config, phases=phases)  # the rate follows the phases, not config.request_rate

Several `run_load` calls may run at once in one event loop (e.g. a steady chat load beside a flood);
each owns its session, tasks and records. Give all but one `scrape=False`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import fields

from bench.load.plan import Goodput, LoadConfig
from bench.load.report import format_report, write_report
from bench.load.run import RatePhase, parse_rate_phases, phased_config, run_load
from pools.cli_types import output_folder, seed
from pools.workload import DEFAULT_WORKLOAD, load_workload
from pools.config.checks import SpecError

# --- the command --------------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the OpenAI-compatible server "
                   "(default http://127.0.0.1:8000; a trailing /v1 is fine)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer key for the server and its /metrics")
    p.add_argument("--workload", default=None, help="workload YAML file, or a name under bench/workloads "
                   "(chat, rag, mixed); default: one chat class, ~128-token prompts, 64 output tokens")
    p.add_argument("--request-rate", type=float, default=1.0, help="arrivals per second over the share classes "
                   "(default 1; inf: all --num-requests at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 Poisson (default), "
                   "<1 burstier, >1 more regular")
    p.add_argument("--duration", type=float, default=None, help="seconds of arrivals (default 10 when "
                   "--num-requests is not given)")
    p.add_argument("--num-requests", type=int, default=None, help="stop arrivals after this many (probes apart)")
    p.add_argument("--rate-phases", default=None, metavar="RATE:S,...", help="arrivals at RATE req/s for S "
                   "seconds, phase after phase (e.g. 1:30,6:60,0:90; RATE 0: none), in place of --request-rate "
                   "and --duration; classes with their own rate and probes keep theirs")
    p.add_argument("--seed", type=seed, default=0, help="seed of arrivals, lengths and prompts")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request limit in s; later: unfinished")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="after the last arrival, wait at most this "
                   "long for in-flight requests, then cancel them (reported as unfinished)")
    p.add_argument("--probe-rate", type=float, default=0.0, help="extra tiny Poisson probe requests per second "
                   "(class 'probe': 8 prompt tokens, 2 output tokens; default 0)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="targets in ms, any of ttft:MS "
                   "itl:MS e2e:MS; a request is good when it completed, its TTFT <= ttft, its mean TPOT "
                   "((e2e - TTFT) / (output tokens - 1), as vLLM) <= itl and its e2e <= e2e")
    p.add_argument("--metrics-url", default=None, help="Prometheus endpoint to scrape (default <url>/metrics)")
    p.add_argument("--no-scrape", action="store_true", help="do not scrape metrics")
    p.add_argument("--continuous-usage", action="store_true", help="ask for vLLM's stream_options."
                   "continuous_usage_stats (cliffguard and vLLM serve it), so ITL divides each chunk's gap by the "
                   "tokens it carries; a server that does not know the option may refuse the requests")
    p.add_argument("--scrape-interval", type=float, default=1.0, help="seconds between scrapes (default 1)")
    p.add_argument("--tokenizer", default=None, help="model spec whose tokenizer makes completion prompts "
                   "exactly the asked length (e.g. builtin:smollm2-135m-instruct or a model folder)")
    p.add_argument("--out", type=output_folder, default=None,
                   help="write results.json, latency_cdf.png, server_timeline.png here "
                   "(and replicas_timeline.png when the server counts replicas)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def phases_from_args(args: argparse.Namespace) -> tuple[RatePhase, ...]:
    """The `--rate-phases` of the command line (empty without it); errors name the option."""
    try:
        return parse_rate_phases(args.rate_phases) if args.rate_phases else ()
    except SpecError as exc:
        raise SpecError(str(exc).replace("rate_phases:", "--rate-phases:", 1)) from None


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """The LoadConfig of the command line (with `--rate-phases`, their mean rate and total duration:
    `phased_config`); errors name the option."""
    classes = load_workload(args.workload) if args.workload else DEFAULT_WORKLOAD
    duration = 10.0 if args.duration is None and args.num_requests is None else args.duration
    phases = phases_from_args(args)
    if phases and args.num_requests is not None:
        raise SpecError("--rate-phases: the phases end the arrivals; leave out --num-requests")
    try:
        goodput = Goodput.parse(args.goodput) if args.goodput else None
        config = LoadConfig(
            url=args.url, model=args.model, classes=classes, request_rate=args.request_rate,
            burstiness=args.burstiness, duration=duration, num_requests=args.num_requests, seed=args.seed,
            timeout=args.timeout, drain_timeout=args.drain_timeout, api_key=args.api_key,
            probe_rate=args.probe_rate, goodput=goodput, scrape=not args.no_scrape, metrics_url=args.metrics_url,
            scrape_interval=args.scrape_interval, tokenizer=args.tokenizer, progress=not args.no_progress,
            continuous_usage=args.continuous_usage)
    except SpecError as exc:
        key, sep, rest = str(exc).partition(":")
        if sep and key in {f.name for f in fields(LoadConfig)}:
            raise SpecError(f"--{key.replace('_', '-')}:{rest}") from None
        raise
    return phased_config(config, phases) if phases else config


def run(args: argparse.Namespace) -> int:
    """`cliffguard bench serve`: 0 when at least one request completed, 1 otherwise."""
    config = config_from_args(args)
    report = asyncio.run(run_load(config, phases=phases_from_args(args)))
    paths = write_report(report, args.out) if args.out else []
    if args.json:
        print(json.dumps(report.to_json(raw=False), indent=2))
    else:
        print(format_report(report))
        for path in paths:
            print(f"wrote {path}")
    return 0 if report.totals["completed"] else 1
