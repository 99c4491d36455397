"""`cliffguard bench serve`: an open-loop load generator for any OpenAI-compatible server.

Arrivals are drawn up front: each workload class is a gamma renewal process (gaps ~ Gamma(shape=burstiness,
mean 1/rate); burstiness 1 is Poisson, below 1 burstier, above 1 more regular) seeded by `--seed`. Every
request is sent at its arrival time whatever the others are doing (open loop: a slow server makes requests
pile up, it never slows the arrivals). Arrivals stop after `--duration` s and/or `--num-requests`; then
in-flight requests get at most `--drain-timeout` s, and those still running are cancelled and reported as
`unfinished` (so are requests past their own `--timeout`). The run always ends by itself.

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
running, waiting and preemptions, and the time each scrape took.

Python API, for benchmarks that drive load in-process inside their own asyncio program:

    from bench.serve import Goodput, LoadConfig, load_workload, run_load, write_report

    config = LoadConfig(url="http://127.0.0.1:8000", model="smollm2-135m-instruct",
                        classes=load_workload("mixed"), request_rate=4.0, duration=30.0,
                        goodput=Goodput(ttft=0.5, itl=0.05))
    report = await run_load(config)              # LoadReport; never raises for a failed request
    report.summary["chat"]["ttft"]["p99"]        # seconds; None when no request of the class completed
    report.summary["chat"]["goodput"]["fraction"]
    report.totals["scrape"]["max_s"]             # slowest GET /metrics
    report.records                               # one RequestRecord per request, in arrival order
    write_report(report, "out/")                 # results.json, latency_cdf.png, server_timeline.png

Several `run_load` calls may run at once in one event loop (e.g. a steady chat load beside a flood);
each owns its session, tasks and records. Give all but one `scrape=False`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from pools.workload import (DEFAULT_WORKLOAD, ENDPOINTS, LengthDist, WorkloadClass, _check_positive, class_arrivals,
                            class_rates, gamma_arrivals, latency_stats, load_workload)
from pools.yamlcheck import SpecError, is_int, show

log = logging.getLogger("cliffguard.bench.serve")

PROBE_CLASS = "probe"
POOL_HEADER = "x-cliffguard-pool"
DONE = "[DONE]"
GOODPUT_KEYS = ("ttft", "itl", "e2e")
LATENCIES = ("ttft", "itl", "tpot", "e2e")
# Prometheus sample name -> key in ScrapeSample.pools; preemptions are summed over their `mode` label.
SCRAPED = {"cliffguard_kv_cache_usage_perc": "kv_cache_usage_perc",
           "cliffguard_num_requests_running": "num_requests_running",
           "cliffguard_num_requests_waiting": "num_requests_waiting",
           "cliffguard_num_preemptions_total": "num_preemptions_total",
           "cliffguard_computed_tokens_total": "computed_tokens_total"}
COUNTERS = ("num_preemptions_total", "computed_tokens_total")   # reported as their increase over the run
SCRAPE_TIMEOUT_S = 10.0
# Common English words that GPT-2, Llama 3 and SmolLM2 BPEs encode as one token each, alone or after a space.
WORDS = tuple("""
the of and to in is you that it he was for on are as with his they at be this have from or one had by word but
not what all were we when your can said there use an each which she do how their if will up other about out many
then them these so some her would make like him into time has look two more write go see number no way could
people my than first water been call who oil its now find long down day did get come made may part over new
sound take only little work know place year live me back give most very after thing our just name good man think
say great where help through much before line right too mean old any same tell boy follow came want show also
around form three small set put end does another well large must big even such because turn here why ask went
men read need land different home us move try kind hand picture again change off play air away animal house
point page letter mother answer found study still learn should world high every near add food between own below
country plant last school father keep tree never start city earth eye light thought head under story left few
while along might close something next hard open example begin life always those both paper together got group
often run important until children side feet car mile night walk white sea grow river four state once book stop
without second late miss idea enough eat face watch far real almost let above girl sometimes cut young talk soon
list song being leave family
""".split())


# --- workload classes and the run's configuration -----------------------------------------------------

PROBE = WorkloadClass(PROBE_CLASS, endpoint="completion", prompt_len=LengthDist("fixed", value=8),
                      output_len=LengthDist("fixed", value=2))


@dataclass(frozen=True)
class Goodput:
    """Service-level targets in seconds. A request is good when it completed and meets every target given:
    TTFT <= `ttft`, its mean TPOT ((e2e - TTFT) / (output tokens - 1), vLLM's rule) <= `itl`, e2e <= `e2e`."""

    ttft: float | None = None
    itl: float | None = None
    e2e: float | None = None

    def __post_init__(self) -> None:
        for key in GOODPUT_KEYS:
            _check_positive(key, getattr(self, key), optional=True)
        if all(getattr(self, key) is None for key in GOODPUT_KEYS):
            raise SpecError(f"goodput: give at least one target of {', '.join(GOODPUT_KEYS)}")

    @classmethod
    def parse(cls, items: Iterable[str]) -> Goodput:
        """`["ttft:500", "itl:50"]` (milliseconds; `tpot` is a synonym of `itl`) -> Goodput in seconds."""
        targets: dict[str, float] = {}
        for item in items:
            key, _, ms = item.partition(":")
            key = "itl" if key.strip() == "tpot" else key.strip()
            try:
                value = float(ms)
            except ValueError:
                value = math.nan
            if key not in GOODPUT_KEYS or not value > 0 or math.isinf(value) or key in targets:
                raise SpecError(f"goodput: expected distinct KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)} "
                                f"and MS > 0, got {item!r}")
            targets[key] = value / 1e3
        return cls(**targets)

    def is_good(self, record: RequestRecord) -> bool:
        """Whether `record` completed within every target."""
        if record.status != "ok" or record.ttft is None:
            return False
        tpot = record.tpot
        return ((self.ttft is None or record.ttft <= self.ttft)
                and (self.itl is None or tpot is None or tpot <= self.itl)
                and (self.e2e is None or record.e2e <= self.e2e))


@dataclass(frozen=True)
class LoadConfig:
    """One open-loop run. Times in seconds, rates in requests/s. Validated on construction (ValueError
    naming the field).

    `url`: the server's base URL (a trailing `/v1` is allowed). `model`: None asks GET /v1/models for the
    first. `request_rate`: split over the share classes (math.inf: all `num_requests` at t=0, classes drawn
    by share). Arrivals stop after `duration` and/or `num_requests` (one is required; probes do not count).
    `metrics_url`: None means `<url>/metrics`. `tokenizer`: a model spec (builtin:..., a folder) whose
    tokenizer makes completion prompts exactly `prompt_len` tokens long.
    """

    url: str
    model: str | None = None
    classes: tuple[WorkloadClass, ...] = DEFAULT_WORKLOAD
    request_rate: float = 1.0
    burstiness: float = 1.0
    duration: float | None = None
    num_requests: int | None = None
    seed: int = 0
    timeout: float = 120.0
    drain_timeout: float = 30.0
    api_key: str | None = field(default=None, repr=False)
    probe_rate: float = 0.0
    goodput: Goodput | None = None
    scrape: bool = True
    metrics_url: str | None = None
    scrape_interval: float = 1.0
    tokenizer: str | None = None
    progress: bool = False

    def __post_init__(self) -> None:
        for key in ("url", "metrics_url"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, str) and re.match(r"^https?://[^/\s]+", value)):
                raise SpecError(f"{key}: must be an http:// or https:// URL, got {show(value)}")
        if not isinstance(self.classes, tuple) or not self.classes or not all(
                isinstance(c, WorkloadClass) for c in self.classes):
            raise SpecError(f"classes: must be a non-empty tuple of WorkloadClass, got {show(self.classes)}")
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names) or (self.probe_rate and PROBE_CLASS in names):
            raise SpecError(f"classes: names must be unique (and not {PROBE_CLASS!r} with probes), got {names}")
        _check_positive("request_rate", self.request_rate, allow_inf=True)
        for key in ("burstiness", "timeout", "drain_timeout", "scrape_interval"):
            _check_positive(key, getattr(self, key))
        _check_positive("duration", self.duration, optional=True)
        _check_positive("probe_rate", self.probe_rate, zero=True)
        if self.num_requests is not None and (not is_int(self.num_requests) or self.num_requests < 1):
            raise SpecError(f"num_requests: must be an integer >= 1, got {show(self.num_requests)}")
        if self.duration is None and self.num_requests is None:
            raise SpecError("duration: give a duration and/or num_requests, got neither")
        if math.isinf(self.request_rate) and (self.num_requests is None or self.duration is not None
                                              or any(c.rate is not None for c in self.classes)):
            raise SpecError("request_rate: inf needs num_requests, no duration and only share classes")
        if self.goodput is not None and not isinstance(self.goodput, Goodput):
            raise SpecError(f"goodput: must be a Goodput, got {show(self.goodput)}")

    @property
    def base_url(self) -> str:
        """`url` without a trailing `/` or `/v1`."""
        return re.sub(r"/v1$", "", self.url.rstrip("/"))

    @property
    def scrape_url(self) -> str:
        return self.metrics_url or self.base_url + "/metrics"

    @property
    def class_rates(self) -> dict[str, float]:
        """Arrival rate of each class (req/s): its own rate, or its share of `request_rate`."""
        return class_rates(self.classes, self.request_rate)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


# --- arrivals and prompts -------------------------------------------------------------------------------

def arrival_schedule(config: LoadConfig) -> list[tuple[float, WorkloadClass]]:
    """(arrival time, class) of every request of the run, probes included, sorted by time."""
    events = class_arrivals(config.classes, config.request_rate, burstiness=config.burstiness,
                            duration=config.duration, num_requests=config.num_requests, seed=config.seed)
    if config.probe_rate > 0:
        end = config.duration if config.duration is not None else max((e[0] for e in events), default=0.0)
        rng = np.random.default_rng([config.seed, len(config.classes)])
        probes = gamma_arrivals(config.probe_rate, 1.0, rng, duration=end) if end > 0 else []
        events += [(float(t), len(config.classes), PROBE) for t in probes]
        events.sort(key=lambda e: (e[0], e[1]))
    return [(t, cls) for t, _, cls in events]


class PromptMaker:
    """Prompt text of about N tokens: N random words of `WORDS`, one token each for typical BPEs.

    With a tokenizer (`engine.tokenizer.Tokenizer`), only the words it encodes as exactly one token are
    used, and completion prompts are corrected by encoding until they are exactly N tokens (special
    tokens included, as the server counts them). Chat prompts get N tokens of content; the chat template
    adds its own few.
    """

    def __init__(self, tokenizer: Any | None = None) -> None:
        self.tokenizer = tokenizer
        self.words = WORDS
        if tokenizer is not None:
            self.words = tuple(w for w in WORDS if len(tokenizer.encode(w, add_special_tokens=False)) == 1
                               and len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1)
            if len(self.words) < 16:
                raise ValueError(f"tokenizer: only {len(self.words)} of the prompt words are one token each")

    def make(self, rng: random.Random, n: int, *, chat: bool) -> str:
        """A prompt of `n` tokens (about, without a tokenizer or for chat) drawn with `rng`."""
        words = [rng.choice(self.words) for _ in range(max(1, n))]
        if self.tokenizer is None:
            return " ".join(words)
        count = self._counter(chat)
        for _ in range(8):
            have = count(" ".join(words))
            if have == n:
                break
            if have < n:
                words += [rng.choice(self.words) for _ in range(n - have)]
            else:
                del words[max(1, len(words) - (have - n)):]
        return " ".join(words)

    def _counter(self, chat: bool) -> Callable[[str], int]:
        return lambda text: len(self.tokenizer.encode(text, add_special_tokens=not chat))


@dataclass(frozen=True)
class PlannedRequest:
    """A request decided before the run starts: when it is sent and what it asks for."""

    index: int
    arrival_s: float
    workload: WorkloadClass
    prompt: str
    prompt_len: int
    max_tokens: int


def load_tokenizer(spec: str) -> Any:
    """`engine.tokenizer.Tokenizer` of a model spec (builtin:..., a model folder, a .gguf file)."""
    from engine.tokenizer import Tokenizer
    from engine.weights import resolve_model

    return Tokenizer.from_folder(resolve_model(spec))


def plan_requests(config: LoadConfig, tokenizer: Any | None = None) -> list[PlannedRequest]:
    """Every request of the run, in arrival order; deterministic for `config.seed`. `tokenizer`: None loads
    `config.tokenizer` when one is set."""
    if tokenizer is None and config.tokenizer:
        tokenizer = load_tokenizer(config.tokenizer)
    maker = PromptMaker(tokenizer)
    plan = []
    for index, (t, cls) in enumerate(arrival_schedule(config)):
        rng = random.Random(f"{config.seed}:{index}:{cls.name}")
        prompt_len, max_tokens = cls.prompt_len.sample(rng), cls.output_len.sample(rng)
        prompt = maker.make(rng, prompt_len, chat=cls.endpoint == "chat")
        plan.append(PlannedRequest(index, t, cls, prompt, prompt_len, max_tokens))
    return plan


def request_body(planned: PlannedRequest, model: str) -> dict[str, Any]:
    """The JSON body of a planned request: streaming, with usage, `ignore_eos` as vLLM's extra field."""
    cls = planned.workload
    body: dict[str, Any] = {"model": model, "max_tokens": planned.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if cls.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": planned.prompt}]
    else:
        body["prompt"] = planned.prompt
    if cls.ignore_eos:
        body["ignore_eos"] = True
    if cls.temperature is not None:
        body["temperature"] = cls.temperature
    return body


# --- one request ------------------------------------------------------------------------------------------

def parse_sse_line(line: bytes | str) -> Any:
    """One line of a server-sent event stream -> the JSON value of a `data:` line, `DONE` for
    `data: [DONE]`, None for anything else (blank lines, comments, `event:`/`id:` fields). A `data:` line
    that is not JSON raises ValueError."""
    if isinstance(line, bytes):
        line = line.decode("utf-8")
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    return DONE if payload == DONE else json.loads(payload)


def error_message(payload: Any, limit: int = 300) -> str:
    """The message of an OpenAI error body (`{"error": {"message": ...}}`, a JSON text of it, or any text)."""
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except ValueError:
            return payload.strip()[:limit]
    if isinstance(payload, dict) and "error" in payload:
        payload = payload["error"]
    if isinstance(payload, dict) and isinstance(payload.get("message"), str):
        return payload["message"][:limit]
    return (payload if isinstance(payload, str) else json.dumps(payload))[:limit]


@dataclass
class RequestRecord:
    """What one request did. `*_s` times are seconds from the run's start, except `chunk_s`: the arrival of
    each content chunk, in seconds from the request's send time (so TTFT = chunk_s[0]).

    `status`: ok | error | unfinished (timed out, cancelled at the drain timeout, or never sent).
    Written only by the task that sends the request, then by the drain.
    """

    index: int
    class_name: str
    endpoint: str
    scheduled_s: float
    prompt_len: int
    max_tokens: int
    sent_s: float | None = None
    end_s: float | None = None
    status: str = "unfinished"
    error: str | None = "never sent"
    http_status: int | None = None
    pool: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None
    chunk_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)

    def add_chunk(self, chunk: Any, t: float) -> None:
        """Apply one parsed stream chunk that arrived `t` s after the request was sent."""
        if not isinstance(chunk, dict):
            raise ValueError(f"stream chunk is not a JSON object: {str(chunk)[:200]}")
        if chunk.get("error") is not None:
            self.status, self.error = "error", "error chunk: " + error_message(chunk)
            return
        tokens = 1
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            if is_int(usage.get("prompt_tokens")):
                self.prompt_tokens = usage["prompt_tokens"]
            if is_int(usage.get("completion_tokens")):
                tokens = usage["completion_tokens"] - (self.output_tokens or 0)
                self.output_tokens = usage["completion_tokens"]
        text = ""
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            text += choice.get("text") or delta.get("content") or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if text:
            self.chunk_s.append(t)
            self.chunk_tokens.append(max(1, tokens))

    @property
    def ttft(self) -> float | None:
        return self.chunk_s[0] if self.chunk_s else None

    @property
    def e2e(self) -> float | None:
        return self.end_s - self.sent_s if self.status == "ok" else None

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive content chunks, each divided by the tokens of the later chunk."""
        return [(b - a) / n for a, b, n in zip(self.chunk_s, self.chunk_s[1:], self.chunk_tokens[1:])]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens from the usage chunk, else the content chunks' count."""
        return self.output_tokens if self.output_tokens is not None else sum(self.chunk_tokens)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (e2e - TTFT) / (output tokens - 1)."""
        n = self.num_output_tokens
        if self.status != "ok" or self.ttft is None or n < 2:
            return None
        return (self.e2e - self.ttft) / (n - 1)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(ttft_s=self.ttft, tpot_s=self.tpot, e2e_s=self.e2e)
        return data


async def _read_stream(response: Any, record: RequestRecord, sent: float) -> None:
    """Feed every `data:` line of an SSE response to `record` until `data: [DONE]`."""
    buffer = b""
    async for data in response.content.iter_any():
        now = time.perf_counter() - sent
        *lines, buffer = (buffer + data).split(b"\n")
        for line in lines:
            event = parse_sse_line(line)
            if event == DONE:
                if record.status != "error":
                    record.status, record.error = "ok", None
                return
            if event is not None:
                record.add_chunk(event, now)
    if record.status != "error":
        record.status, record.error = "error", "stream ended without data: [DONE]"


async def send_request(session: Any, config: LoadConfig, model: str, planned: PlannedRequest,
                       record: RequestRecord, start: float) -> None:
    """Send one request and fill `record` as its stream arrives; failures land in the record, never raised
    (cancellation aside: the caller marks a cancelled record)."""
    import aiohttp

    url = config.base_url + ENDPOINTS[planned.workload.endpoint]
    body = request_body(planned, model)
    sent = time.perf_counter()
    record.sent_s, record.error = sent - start, "in flight"
    try:
        async with asyncio.timeout(config.timeout):
            async with session.post(url, json=body, headers=config.headers()) as response:
                record.http_status = response.status
                record.pool = response.headers.get(POOL_HEADER)
                if response.status != 200:
                    text = await response.text(errors="replace")
                    record.status, record.error = "error", f"HTTP {response.status}: {error_message(text)}"
                    return
                await _read_stream(response, record, sent)
    except TimeoutError:
        record.status, record.error = "unfinished", f"timeout: no end of stream within {config.timeout:g} s"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        record.status, record.error = "error", f"{type(exc).__name__}: {exc}"[:300]
    finally:
        record.end_s = time.perf_counter() - start


# --- /metrics -------------------------------------------------------------------------------------------------

def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text -> {pool: {kv_cache_usage_perc, num_requests_running, num_requests_waiting,
    num_preemptions_total}} (the series present; preemptions summed over modes). Uses prometheus_client's
    parser; a malformed exposition raises ValueError."""
    from prometheus_client.parser import text_string_to_metric_families

    pools: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = SCRAPED.get(sample.name)
            if key is None:
                continue
            values = pools.setdefault(sample.labels.get("pool", ""), {})
            summed = key == "num_preemptions_total"
            values[key] = values.get(key, 0.0) + sample.value if summed else sample.value
    return pools


@dataclass(frozen=True)
class ScrapeSample:
    """One GET /metrics: when it started (s from the run's start), how long it took, what it said."""

    t_s: float
    scrape_s: float
    pools: dict[str, dict[str, float]]
    error: str | None = None


class Scraper:
    """Polls /metrics every `interval` s until `stop` is set; a 404 ends it with one warning (`skipped`)."""

    def __init__(self, session: Any, config: LoadConfig, start: float) -> None:
        self.session, self.url, self.start = session, config.scrape_url, start
        self.interval, self.headers = config.scrape_interval, config.headers()
        self.samples: list[ScrapeSample] = []
        self.skipped: str | None = None

    async def scrape_once(self) -> bool:
        """Scrape once and record it; False once the server has said there is no /metrics (404)."""
        import aiohttp

        began = time.perf_counter()
        t_s = began - self.start
        try:
            async with asyncio.timeout(SCRAPE_TIMEOUT_S):
                async with self.session.get(self.url, headers=self.headers) as response:
                    text = await response.text(errors="replace")
            elapsed = time.perf_counter() - began
            if response.status == 404:
                self.skipped = f"{self.url} answered 404"
                log.warning("bench serve: %s; not scraping metrics", self.skipped)
                return False
            if response.status != 200:
                raise ValueError(f"HTTP {response.status}: {error_message(text)}")
            self.samples.append(ScrapeSample(t_s, elapsed, parse_metrics(text)))
        except (aiohttp.ClientError, OSError, ValueError, TimeoutError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
            self.samples.append(ScrapeSample(t_s, time.perf_counter() - began, {}, error))
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Scrape on a fixed schedule (a slow scrape delays only the next one) until `stop`, then once more."""
        next_at = time.perf_counter()
        while not stop.is_set():
            if not await self.scrape_once():
                return
            next_at = max(next_at + self.interval, time.perf_counter())
            try:
                await asyncio.wait_for(stop.wait(), next_at - time.perf_counter())
            except TimeoutError:
                pass
        await self.scrape_once()


# --- the run --------------------------------------------------------------------------------------------------

async def resolve_model_name(session: Any, config: LoadConfig) -> str:
    """`config.model`, or the first model of GET /v1/models."""
    if config.model:
        return config.model
    url = config.base_url + "/v1/models"
    try:
        async with asyncio.timeout(SCRAPE_TIMEOUT_S):
            async with session.get(url, headers=config.headers()) as response:
                data = await response.json(content_type=None)
        return data["data"][0]["id"]
    except Exception as exc:  # noqa: BLE001 - any failure means: say which model
        raise RuntimeError(f"--model: not given, and GET {url} named none ({type(exc).__name__}: {exc})") from None


async def _dispatch(plan: Sequence[PlannedRequest], start: float,
                    launch: Callable[[PlannedRequest], Awaitable[None]], tasks: list[asyncio.Task]) -> None:
    """Start each request at its arrival time, whatever the earlier ones are doing (open loop)."""
    for planned in plan:
        delay = start + planned.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(launch(planned)))


async def _drain(tasks: list[asyncio.Task], records: Sequence[RequestRecord], drain_timeout: float) -> None:
    """Wait for in-flight requests at most `drain_timeout` s, then cancel the rest; they stay `unfinished`."""
    pending: set[asyncio.Task] = set()
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=drain_timeout)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for record in records:
        if record.status == "unfinished" and record.error == "in flight":
            record.error = f"cancelled: still in flight {drain_timeout:g} s after the last arrival"


def _progress_bar(config: LoadConfig, total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="bench serve", unit="req", file=sys.stderr, disable=not config.progress,
                dynamic_ncols=True)


async def run_load(config: LoadConfig, plan: list[PlannedRequest] | None = None) -> LoadReport:
    """Run the open-loop load of `config` against its server and return the measurements. Failed
    requests are counted in the report, never raised; a missing model name is a RuntimeError.

    `plan`: the requests, made beforehand with `plan_requests(config)`; several loads that run at
    once should be planned before any starts, so that making one's prompts does not stall another's
    measurements (None: planned here, in a thread)."""
    import aiohttp

    if plan is None:
        plan = await asyncio.to_thread(plan_requests, config)
    records = [RequestRecord(p.index, p.workload.name, p.workload.endpoint, p.arrival_s, p.prompt_len,
                             p.max_tokens) for p in plan]
    connector = aiohttp.TCPConnector(limit=0)  # no cap on connections: a cap would close the loop
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = await resolve_model_name(session, config)
        start = time.perf_counter()
        scraper, stop = (Scraper(session, config, start) if config.scrape else None), asyncio.Event()
        scrape_task = asyncio.create_task(scraper.run(stop)) if scraper else None
        tasks: list[asyncio.Task] = []
        bar = _progress_bar(config, len(plan))

        async def launch(planned: PlannedRequest) -> None:
            try:
                await send_request(session, config, model, planned, records[planned.index], start)
            finally:
                bar.update()

        try:
            await _dispatch(plan, start, launch, tasks)
            await _drain(tasks, records, config.drain_timeout)
            duration = time.perf_counter() - start
        finally:
            for task in tasks:
                task.cancel()
            stop.set()
            if scrape_task is not None:
                await asyncio.gather(scrape_task, return_exceptions=True)
            bar.close()
    return build_report(config, model, records, scraper, duration)


# --- summaries ---------------------------------------------------------------------------------------------

def latencies(records: Iterable[RequestRecord], metric: str) -> list[float]:
    """The completed requests' values of one of `LATENCIES` (ITL: every gap of every request)."""
    out: list[float] = []
    for r in records:
        if r.status != "ok":
            continue
        if metric == "itl":
            out += r.itl
        elif (value := getattr(r, metric)) is not None:
            out.append(value)
    return out


def class_summary(records: Sequence[RequestRecord], duration_s: float, goodput: Goodput | None) -> dict[str, Any]:
    """Counts, latency stats (s, `latency_stats` of each of LATENCIES), tokens, throughput over the run
    (completed requests and their output tokens per second of `duration_s`), the pools that answered, the
    most common errors, and goodput: good requests per second and `fraction` = good / all requests."""
    done = [r for r in records if r.status == "ok"]
    output_tokens = sum(r.num_output_tokens for r in done)
    summary: dict[str, Any] = {
        "count": len(records), "completed": len(done),
        "errors": sum(r.status == "error" for r in records),
        "unfinished": sum(r.status == "unfinished" for r in records),
        **{metric: latency_stats(latencies(done, metric)) for metric in LATENCIES},
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in done), "output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s, "output_throughput": output_tokens / duration_s,
        "goodput": None,
        "pools": dict(Counter(r.pool for r in records if r.pool is not None)),
        "error_messages": dict(Counter(r.error for r in records if r.status != "ok").most_common(5)),
    }
    if goodput is not None:
        good = sum(goodput.is_good(r) for r in records)
        summary["goodput"] = {"num_good": good, "requests_per_s": good / duration_s,
                              "fraction": good / len(records) if records else None}
    return summary


def scrape_summary(scraper: Scraper | None, url: str) -> dict[str, Any]:
    """How scraping went (count, failures, max/p99 scrape time) and, per pool, the peaks of the series."""
    if scraper is None:
        return {"url": url, "skipped": "disabled", "count": 0, "failed": 0, "max_s": None, "p99_s": None,
                "mean_s": None, "pools": {}, "errors": {}}
    ok = [s for s in scraper.samples if s.error is None]
    times = latency_stats([s.scrape_s for s in ok])
    pools: dict[str, dict[str, float | None]] = {}
    for name in sorted({p for s in ok for p in s.pools}):
        series = {key: [s.pools[name][key] for s in ok if key in s.pools.get(name, {})] for key in SCRAPED.values()}
        pools[name] = {f"max_{key}": max(v) if v else None for key, v in series.items() if key not in COUNTERS}
        pre = series["num_preemptions_total"]
        pools[name]["num_preemptions"] = pre[-1] - pre[0] if pre else None
        computed = series["computed_tokens_total"]
        pools[name]["computed_tokens"] = computed[-1] - computed[0] if computed else None
    errors = Counter(s.error for s in scraper.samples if s.error is not None)
    return {"url": url, "skipped": scraper.skipped, "count": len(ok), "failed": len(scraper.samples) - len(ok),
            "max_s": times["max"], "p99_s": times["p99"], "mean_s": times["mean"], "pools": pools,
            "errors": dict(errors.most_common(3))}


@dataclass(frozen=True)
class LoadReport:
    """The outcome of `run_load`: plain data, times in seconds.

    `summary[class]`: `class_summary` (the probe class too, under `probe`); `totals`: the run as a whole
    (every class) plus `scrape` (`scrape_summary`) and `send_lag_s` (how late requests left against their
    drawn arrival: the client's own overload shows here); `records`/`scrapes`: the raw measurements.
    """

    config: LoadConfig
    model: str
    summary: dict[str, dict[str, Any]]
    totals: dict[str, Any]
    records: tuple[RequestRecord, ...]
    scrapes: tuple[ScrapeSample, ...]

    def to_json(self, *, raw: bool = True) -> dict[str, Any]:
        """JSON-ready dict: config (API key hidden), model, summary, totals and, with `raw`, records and scrapes."""
        config = asdict(self.config)
        config["api_key"] = "***" if self.config.api_key else None
        if math.isinf(self.config.request_rate):
            config["request_rate"] = "inf"
        data = {"config": config, "model": self.model, "summary": self.summary, "totals": self.totals}
        if raw:
            data["requests"] = [r.to_json() for r in self.records]
            data["scrapes"] = [asdict(s) for s in self.scrapes]
        return data


def build_report(config: LoadConfig, model: str, records: Sequence[RequestRecord], scraper: Scraper | None,
                 duration_s: float) -> LoadReport:
    """Summaries per class and for the whole run from the raw records."""
    names = [c.name for c in config.classes] + ([PROBE_CLASS] if config.probe_rate > 0 else [])
    summary = {name: class_summary([r for r in records if r.class_name == name], duration_s, config.goodput)
               for name in names}
    whole = class_summary(records, duration_s, None)
    totals = {key: whole[key] for key in ("count", "completed", "errors", "unfinished", "output_tokens",
                                          "request_throughput", "output_throughput")}
    totals.update(duration_s=duration_s, last_arrival_s=max((r.scheduled_s for r in records), default=0.0),
                  send_lag_s=latency_stats([r.sent_s - r.scheduled_s for r in records if r.sent_s is not None]),
                  scrape=scrape_summary(scraper, config.scrape_url))
    return LoadReport(config, model, summary, totals, tuple(records), tuple(scraper.samples if scraper else ()))


# --- files and plots -----------------------------------------------------------------------------------------

def write_report(report: LoadReport, out_dir: str | Path) -> list[Path]:
    """Write results.json, latency_cdf.png and server_timeline.png into `out_dir` (created); their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.json"
    results.write_text(json.dumps(report.to_json(), indent=1) + "\n", encoding="utf-8")
    paths = [results, out / "latency_cdf.png", out / "server_timeline.png"]
    plot_latency_cdf(report, paths[1])
    plot_server_timeline(report, paths[2])
    return paths


def plot_latency_cdf(report: LoadReport, path: Path) -> None:
    """TTFT, ITL and e2e CDFs, one line per class, log x axis."""
    from matplotlib.figure import Figure  # lazily: only runs that write plots pay for matplotlib

    fig = Figure(figsize=(15, 4.5), layout="constrained")
    for ax, metric in zip(fig.subplots(1, 3), ("ttft", "itl", "e2e")):
        for name in report.summary:
            values = np.sort([v for v in latencies((r for r in report.records if r.class_name == name), metric)
                              if v > 0])
            if len(values):  # from 0 at the first value, so that a single value still draws a step
                ax.step(np.r_[values[0], values], np.r_[0.0, np.arange(1, len(values) + 1) / len(values)],
                        where="post", marker="." if len(values) < 20 else None, label=f"{name} (n={len(values)})")
        if ax.lines:
            ax.set_xscale("log")
            ax.legend(loc="lower right", fontsize="small")
        else:
            ax.text(0.5, 0.5, "no completed requests", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(f"{metric.upper()} (s)")
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"bench serve: {report.model}, {report.totals['count']} requests")
    fig.savefig(path, dpi=100)


_TIMELINE_LABELS = ("KV cache usage (%)", "running (solid) / waiting (dashed)", "preemptions since start",
                    "GET /metrics time (ms)")


def plot_server_timeline(report: LoadReport, path: Path) -> None:
    """KV usage, running/waiting, preemptions per pool and scrape time over the run; a note if no scrape."""
    from matplotlib.figure import Figure

    ok = [s for s in report.scrapes if s.error is None]
    if not ok:
        fig = Figure(figsize=(8, 3), layout="constrained")
        ax = fig.subplots()
        ax.axis("off")
        reason = report.totals["scrape"].get("skipped") or "no successful scrape"
        ax.text(0.5, 0.5, f"no /metrics data ({reason})", ha="center", va="center", transform=ax.transAxes)
        fig.savefig(path, dpi=100)
        return
    fig = Figure(figsize=(11, 11), layout="constrained")
    axes = fig.subplots(len(_TIMELINE_LABELS), 1, sharex=True)
    pools = sorted({p for s in ok for p in s.pools})
    for pool in pools:
        def series(key: str) -> tuple[list[float], list[float]]:
            pts = [(s.t_s, s.pools[pool][key]) for s in ok if key in s.pools.get(pool, {})]
            return [t for t, _ in pts], [v for _, v in pts]

        t, kv = series("kv_cache_usage_perc")
        axes[0].plot(t, [100 * v for v in kv], label=pool)
        line = axes[1].plot(*series("num_requests_running"), label=f"{pool} running")[0]
        axes[1].plot(*series("num_requests_waiting"), linestyle="--", color=line.get_color(), label=f"{pool} waiting")
        t, pre = series("num_preemptions_total")
        axes[2].plot(t, [v - pre[0] for v in pre], label=pool)
    axes[3].plot([s.t_s for s in ok], [1e3 * s.scrape_s for s in ok], marker=".", label="scrape")
    for ax, label in zip(axes, _TIMELINE_LABELS):
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(loc="upper left", fontsize="small")
    axes[-1].set_xlabel("time since start (s)")
    fig.suptitle(f"server timeline: {report.totals['scrape']['url']}")
    fig.savefig(path, dpi=100)


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
    p.add_argument("--seed", type=int, default=0, help="seed of arrivals, lengths and prompts")
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
    p.add_argument("--scrape-interval", type=float, default=1.0, help="seconds between scrapes (default 1)")
    p.add_argument("--tokenizer", default=None, help="model spec whose tokenizer makes completion prompts "
                   "exactly the asked length (e.g. builtin:smollm2-135m-instruct or a model folder)")
    p.add_argument("--out", default=None, help="write results.json, latency_cdf.png, server_timeline.png here")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """The LoadConfig of the command line; errors name the option."""
    classes = load_workload(args.workload) if args.workload else DEFAULT_WORKLOAD
    duration = 10.0 if args.duration is None and args.num_requests is None else args.duration
    try:
        goodput = Goodput.parse(args.goodput) if args.goodput else None
        return LoadConfig(
            url=args.url, model=args.model, classes=classes, request_rate=args.request_rate,
            burstiness=args.burstiness, duration=duration, num_requests=args.num_requests, seed=args.seed,
            timeout=args.timeout, drain_timeout=args.drain_timeout, api_key=args.api_key,
            probe_rate=args.probe_rate, goodput=goodput, scrape=not args.no_scrape, metrics_url=args.metrics_url,
            scrape_interval=args.scrape_interval, tokenizer=args.tokenizer, progress=not args.no_progress)
    except SpecError as exc:
        key, sep, rest = str(exc).partition(":")
        if sep and key in {f.name for f in fields(LoadConfig)}:
            raise SpecError(f"--{key.replace('_', '-')}:{rest}") from None
        raise


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def format_report(report: LoadReport) -> str:
    """A readable table per class, then the run's totals and what /metrics said."""
    c, t = report.config, report.totals
    rate = "all at once" if math.isinf(c.request_rate) else f"{c.request_rate:g} req/s, burstiness {c.burstiness:g}"
    lines = [f"bench serve: {c.base_url}, model {report.model}, {rate}, seed {c.seed}",
             f"ran {t['duration_s']:.1f} s: {t['count']} requests, {t['completed']} completed, {t['errors']} errors, "
             f"{t['unfinished']} unfinished; {t['request_throughput']:.2f} req/s, "
             f"{t['output_throughput']:.1f} output tok/s; send lag max {_ms(t['send_lag_s']['max'])} ms"]
    for name, s in report.summary.items():
        pools = ", ".join(f"{pool} {n}" for pool, n in s["pools"].items()) or "-"
        lines += ["", f"{name}: {s['count']} requests, {s['completed']} completed, {s['errors']} errors, "
                  f"{s['unfinished']} unfinished; pools: {pools}",
                  f"  {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s"
                  + ("" if s["goodput"] is None else f"; goodput {s['goodput']['requests_per_s']:.2f} req/s "
                     f"({100 * (s['goodput']['fraction'] or 0):.1f}% of requests good)"),
                  f"  {'ms':<6}" + "".join(f"{k:>10}" for k in ("mean", "p50", "p90", "p99", "max"))]
        for metric in LATENCIES:
            lines.append(f"  {metric.upper():<6}" + "".join(f"{_ms(s[metric][k]):>10}"
                                                           for k in ("mean", "p50", "p90", "p99", "max")))
        lines += [f"  {n}x {message}" for message, n in s["error_messages"].items()]
    sc = t["scrape"]
    lines.append("")
    if sc["skipped"]:
        lines.append(f"metrics: not scraped ({sc['skipped']})")
    else:
        lines.append(f"metrics: {sc['count']} scrapes of {sc['url']} ({sc['failed']} failed); scrape time max "
                     f"{_ms(sc['max_s'])} ms, p99 {_ms(sc['p99_s'])} ms")
        lines += [f"  {n}x {message}" for message, n in sc["errors"].items()]
    for pool, p in sc["pools"].items():
        kv = "-" if p["max_kv_cache_usage_perc"] is None else f"{100 * p['max_kv_cache_usage_perc']:.1f}%"
        lines.append(f"  pool {pool}: KV usage max {kv}, running max {_count(p['max_num_requests_running'])}, "
                     f"waiting max {_count(p['max_num_requests_waiting'])}, "
                     f"preemptions {_count(p['num_preemptions'])}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """`cliffguard bench serve`: 0 when at least one request completed, 1 otherwise."""
    config = config_from_args(args)
    report = asyncio.run(run_load(config))
    paths = write_report(report, args.out) if args.out else []
    if args.json:
        print(json.dumps(report.to_json(raw=False), indent=2))
    else:
        print(format_report(report))
        for path in paths:
            print(f"wrote {path}")
    return 0 if report.totals["completed"] else 1
