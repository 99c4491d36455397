"""`run_load`: one open-loop load against a server, from its plan to its report (arrivals sent at
their times whatever the earlier requests are doing, a drain, the scraper beside them)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from bench.load.sender import RequestRecord, send_request
from bench.load.plan import LoadConfig, PlannedRequest, plan_requests
from bench.load.report import LoadReport, build_report
from bench.load.scrape import SCRAPE_TIMEOUT_S, Scraper

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
            duration = time.perf_counter() - start
        finally:
            for task in tasks:
                task.cancel()
            stop.set()
            if scrape_task is not None:
                await asyncio.gather(scrape_task, return_exceptions=True)
            bar.close()
    return build_report(config, model, records, scraper, duration)
