"""`run_load`: one open-loop load against a server, from its plan to its report (arrivals sent at
their times whatever the earlier requests are doing, a drain, the scraper beside them); `RatePhase`:
a load whose rate changes over the run (`plan_phased`)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

from bench.load.sender import RequestRecord, send_request
from bench.load.plan import PROBE, LoadConfig, PlannedRequest, plan_requests
from bench.load.report import LoadReport, build_report
from bench.load.scrape import SCRAPE_TIMEOUT_S, Scraper
from pools.config.checks import SpecError

# --- rate phases ----------------------------------------------------------------------------------------------

class RatePhase(NamedTuple):
    """A stretch of a phased run: arrivals at `rate` req/s over the share classes (0: none) for `duration_s`."""

    rate: float
    duration_s: float


def parse_rate_phases(text: str) -> tuple[RatePhase, ...]:
    """`"1:30,4:60,0:90"` (RATE:SECONDS, in order) -> the phases; SpecError naming `rate_phases` and the item."""
    phases = []
    for item in text.split(","):
        rate, _, seconds = item.partition(":")
        try:
            phase = RatePhase(float(rate), float(seconds))
        except ValueError:
            phase = RatePhase(math.nan, math.nan)
        if not (0 <= phase.rate < math.inf and 0 < phase.duration_s < math.inf):
            raise SpecError(f"rate_phases: expected RATE:SECONDS,... with RATE >= 0 req/s and SECONDS > 0, "
                            f"got {item.strip()!r}")
        phases.append(phase)
    if not any(phase.rate > 0 for phase in phases):
        raise SpecError(f"rate_phases: give at least one phase with RATE > 0, got {text!r}")
    return tuple(phases)


def phased_config(config: LoadConfig, phases: Sequence[RatePhase]) -> LoadConfig:
    """`config` with the phases' total as `duration` and their mean rate (arrivals / seconds) as
    `request_rate`: the plan that `plan_phased` bends to the phases. The phases end the arrivals, so
    `num_requests` is refused."""
    if config.num_requests is not None:
        raise SpecError("rate_phases: the phases end the arrivals; give no num_requests")
    duration = sum(p.duration_s for p in phases)
    return dataclasses.replace(config, request_rate=sum(p.rate * p.duration_s for p in phases) / duration,
                               duration=duration)


def phase_time(phases: Sequence[RatePhase], t: float) -> float:
    """Where an arrival at `t` s of a run at the phases' mean rate lands when the rate follows the phases:
    the time by which the phases expect as many arrivals as the mean rate by `t`."""
    mean = sum(p.rate * p.duration_s for p in phases) / sum(p.duration_s for p in phases)
    expected, start = mean * t, 0.0
    for phase in phases:
        if phase.rate > 0 and expected < phase.rate * phase.duration_s:
            return start + expected / phase.rate
        expected -= phase.rate * phase.duration_s
        start += phase.duration_s
    return start


def plan_phased(config: LoadConfig, phases: Sequence[RatePhase] = (), tokenizer: Any | None = None
                ) -> list[PlannedRequest]:
    """`plan_requests(config)`, or with phases the requests of `phased_config(config, phases)` with each
    share class's arrivals moved by `phase_time`: drawn at the mean rate, time stretched where a phase is
    slower and squeezed where it is faster, so the rate follows the phases (a gamma process keeps its
    burstiness within each phase). Classes with their own `rate` and the probes keep their times.
    Deterministic for the seed; indexes follow the new arrival order."""
    if not phases:
        return plan_requests(config, tokenizer)
    plan = plan_requests(phased_config(config, phases), tokenizer)
    moved = sorted((p if p.workload.rate is not None or p.workload is PROBE else
                    dataclasses.replace(p, arrival_s=phase_time(phases, p.arrival_s)) for p in plan),
                   key=lambda p: p.arrival_s)
    return [dataclasses.replace(p, index=index) for index, p in enumerate(moved)]


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


async def run_load(config: LoadConfig, plan: list[PlannedRequest] | None = None, *,
                   phases: Sequence[RatePhase] = ()) -> LoadReport:
    """Run the open-loop load of `config` against its server and return the measurements. Failed
    requests are counted in the report, never raised; a missing model name is a RuntimeError.

    `plan`: the requests, made beforehand with `plan_phased(config, phases)`; several loads that run at
    once should be planned before any starts, so that making one's prompts does not stall another's
    measurements (None: planned here, in a thread). `phases`: a rate that changes over the run, in
    place of `config.request_rate` and `config.duration` (`phased_config`)."""
    import aiohttp

    if phases:
        config = phased_config(config, phases)
    if plan is None:
        plan = await asyncio.to_thread(plan_phased, config, phases)
    records = [RequestRecord(p.index, p.workload.name, p.workload.endpoint, p.arrival_s, p.prompt_len,
                             p.max_tokens, prefix=p.prefix) for p in plan]
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
            if phases:   # the scraper watches the last phases to their end, quiet ones too (a scale-down)
                await asyncio.sleep(max(0.0, start + config.duration - time.perf_counter()))
            duration = time.perf_counter() - start
        finally:
            for task in tasks:
                task.cancel()
            stop.set()
            if scrape_task is not None:
                await asyncio.gather(scrape_task, return_exceptions=True)
            bar.close()
    return build_report(config, model, records, scraper, duration, rate_phases=tuple(phases))
