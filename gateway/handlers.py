"""The endpoints: OpenAI chat and text completions, models, health, readiness and metrics.

A completion request: parse and validate (`gateway.openai.chat` / `completions`) -> count and route each prompt
(`Gateway.route_chat` / `route_prompt`) -> `gateway.completion.Completion.answer` (check the context,
forward to an upstream pool, or hold KV credits, wait for the device and answer from the local pools).
`answer` does the same for one batch line, without an HTTP request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from gateway.openai.chat import parse_chat
from gateway.openai.completions import parse_completion
from gateway.openai.errors import ApiError, check_depth
from gateway.completion import Completion
from gateway.runtime import GATEWAY, Gateway, model_not_found, num_chars
from gateway.upstream.relay import redact
from pools.pool import Pool
from pools.router import UnknownModelError

log = logging.getLogger("cliffguard.gateway")

_JSON = msgspec.json.Decoder()


BODY_READ_SECONDS = 30.0   # a request body of which no byte came for this long is a 408
MIN_BODY_BYTES_PER_SECOND = 64 << 10   # ... and one behind this pace after that grace: 30 s + received / this
T = TypeVar("T")


async def read_body(request: web.Request) -> bytes:
    """The whole request body (`read_within`)."""
    return await read_within(request, request.read())


async def read_within(request: web.Request, reading: Awaitable[T]) -> T:
    """`reading` (what reads the request's body: `request.read()`, a multipart form), or a 408 (connection
    closed) once the client has sent no byte of the body for BODY_READ_SECONDS, or more than BODY_READ_SECONDS
    + (bytes received) / MIN_BODY_BYTES_PER_SECOND have passed since it began: a body that never finishes,
    or trickles, would hold its connection, handler and what it sent so far for good. A body already whole
    (most: it came with its headers) is read at once, with no task and no watch."""
    content = request.content
    if content.is_eof():
        return await reading
    task = asyncio.ensure_future(reading)
    loop = asyncio.get_running_loop()
    start = since = loop.time()
    seen = _received(content)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=min(1.0, BODY_READ_SECONDS))
            if task.done():
                break
            now, received = loop.time(), _received(content)
            if received != seen:
                seen, since = received, now
            if now - since >= BODY_READ_SECONDS:
                raise body_timeout(f"no byte of it for {BODY_READ_SECONDS:g} s")
            if now - start > BODY_READ_SECONDS + received / MIN_BODY_BYTES_PER_SECOND:
                raise body_timeout(f"arriving slower than {MIN_BODY_BYTES_PER_SECOND >> 10} KiB/s")
        return task.result()
    finally:
        if not task.done():
            task.cancel()
        elif not task.cancelled():
            task.exception()   # retrieved: a connection lost as the handler is cancelled is no "never retrieved"


def _received(content: Any) -> int:
    """The body's bytes received so far, as sent (compressed: aiohttp >= 3.13 counts them apart)."""
    return getattr(content, "total_raw_bytes", None) or getattr(content, "total_bytes", 0)


def body_timeout(reason: str) -> ApiError:
    return ApiError(408, f"body: {reason}", param="body", code="request_timeout", headers={"Connection": "close"})


async def read_json(request: web.Request) -> Any:
    """The request body as JSON; 400 naming `body` when it is empty, invalid or nested too deeply, 408 when it
    stalls (`read_within`). msgspec decodes it (6x json's speed); a body msgspec refuses gets
    json's answer, so both take the same bodies."""
    raw = await read_body(request)
    if not raw:
        raise ApiError(400, "body: empty request body; expected a JSON object", param="body")
    try:
        return check_depth(_JSON.decode(raw), raw)
    except msgspec.DecodeError:
        pass   # refused, or what json takes and msgspec does not (NaN, 1e999, a lone surrogate): json decides
    except RecursionError:
        raise ApiError(400, "body: the JSON is nested too deeply", param="body") from None
    try:
        body = json.loads(raw)
    except ValueError as exc:   # malformed, not UTF-8, an integer over Python's digit limit
        raise ApiError(400, f"body: invalid JSON: {exc}", param="body") from None
    except RecursionError:
        raise ApiError(400, "body: the JSON is nested too deeply", param="body") from None
    return check_depth(body, raw)


# Tools of fewer characters are read inline: checking a schema compiles it (about 1.6 us a character on a
# 2-core CPU when it is new, nothing once remembered), so at most ~25 ms; larger ones take seconds.
INLINE_TOOLS_CHARS = 16384


async def parsed(gateway: Gateway, parse: Callable[..., T], body: Any, *args: Any) -> T:
    """`parse(body, *args)` (a chat or Responses body read into its request); on the tokenizer thread where
    the body's tools are large: each tool's schema is compiled to be checked (`gateway.openai.tool_specs`),
    seconds for a body of large ones, which the event loop must not wait for."""
    tools = [body.get("tools"), body.get("functions")] if isinstance(body, dict) else []
    if num_chars(tools, INLINE_TOOLS_CHARS) > INLINE_TOOLS_CHARS:
        return await asyncio.get_running_loop().run_in_executor(gateway.executor, parse, body, *args)
    return parse(body, *args)


# --- completions -----------------------------------------------------------------------------------
async def chat_completions(request: web.Request) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    received = time.perf_counter()
    body = await read_json(request)
    req = await parsed(gateway, parse_chat, body, gateway.config.gateway.limits)
    routed = [await gateway.route_chat(req.model, req.messages, req.tools, req.chat_template_kwargs, req.offers_calls)]
    tenant = gateway.admission.tenant_of(request)
    return await Completion(gateway, req, routed, body, "/chat/completions", received, tenant, http=request).answer()


async def completions(request: web.Request) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    received = time.perf_counter()
    body = await read_json(request)
    req = parse_completion(body, gateway.config.gateway.limits)
    routed = await gateway.route_prompts(req.model, req.prompts)
    tenant = gateway.admission.tenant_of(request)
    return await Completion(gateway, req, routed, body, "/completions", received, tenant, http=request).answer()


async def answer(gateway: Gateway, path: str, body: Any, *, tenant: str | None = None,
                 batch: bool = False) -> tuple[int, dict[str, Any]]:
    """One request without HTTP (a batch line): `path` is /v1/chat/completions or /v1/completions.
    Returns (status, JSON body) as an HTTP client would get them, errors in the OpenAI format; `batch`
    queues it behind interactive traffic, and leaves counting its error to the batch runner (a try it
    runs again is no answer). Streaming is refused (param `stream`)."""
    received = time.perf_counter()
    tenant = tenant or gateway.admission.tenants.resolve(None)
    try:
        if not isinstance(body, dict):
            raise ApiError(400, f"body: must be a JSON object, got {type(body).__name__}", param="body")
        check_depth(body)
        if body.get("stream"):
            raise ApiError(400, "stream: a batch line cannot stream; remove stream", param="stream")
        if path == "/v1/chat/completions":
            req = await parsed(gateway, parse_chat, body, gateway.config.gateway.limits)
            routed = [await gateway.route_chat(req.model, req.messages, req.tools, req.chat_template_kwargs,
                                               req.offers_calls)]
        elif path == "/v1/completions":
            req = parse_completion(body, gateway.config.gateway.limits)
            routed = await gateway.route_prompts(req.model, req.prompts)
        else:
            raise ApiError(400, f"url: {path!r} is not served; use /v1/chat/completions or /v1/completions",
                           param="url")
        completion = Completion(gateway, req, routed, body, path.removeprefix("/v1"), received, tenant,
                                background=batch)
        return 200, await completion.answer()
    except ApiError as err:
        if not batch:
            gateway.metrics.errors.labels(status=str(err.status)).inc()
        return err.status, err.body()


# --- models ----------------------------------------------------------------------------------------
async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": list(_model_entries(request.app[GATEWAY]).values())})


async def retrieve_model(request: web.Request) -> web.Response:
    """`GET /v1/models/{model}`: the model's entry of `/v1/models`; 404 model_not_found if not served."""
    gateway, name = request.app[GATEWAY], request.match_info["model"]
    try:
        gateway.router.candidates(name)
    except UnknownModelError as exc:
        raise model_not_found(exc) from None
    return web.json_response(_model_entries(gateway)[name])


def _model_entries(gateway: Gateway) -> dict[str, dict[str, Any]]:
    """One OpenAI model object per served model name, with each of its pools."""
    data: dict[str, dict[str, Any]] = {}
    for pool in gateway.pools.values():
        entry = data.setdefault(pool.model_name, {
            "id": pool.model_name, "object": "model", "created": 0, "owned_by": "cliffguard",
            "max_model_len": 0, "pools": []})
        entry["max_model_len"] = max(entry["max_model_len"], pool.max_model_len)
        entry["pools"].append(_pool_entry(gateway, pool))
    return data


def _pool_entry(gateway: Gateway, pool: Pool) -> dict[str, Any]:
    """A pool's route, its planned capacity and (once its device loaded) what was allocated."""
    info: dict[str, Any] = {"name": pool.name, "min_prompt_tokens": pool.min_prompt_tokens,
                            "max_prompt_tokens": pool.max_prompt_tokens, "max_model_len": pool.max_model_len}
    if pool.is_upstream:
        info["upstream"] = redact(pool.spec.upstream)
        return info
    planned = gateway.plan.pools[pool.name]
    info.update(device=pool.device, planned_num_blocks=planned.num_blocks,
                planned_max_num_seqs=planned.max_num_seqs, replicas=pool.num_replicas)
    workers = [gateway.worker_info(pool.device, r) for r in range(pool.num_replicas)]
    worker = next((w for w in workers if w is not None), None)
    if worker is not None:   # every replica allocates the same
        allocated = worker.pools[pool.name]
        info.update(num_blocks=allocated.num_blocks, max_num_seqs=allocated.max_num_seqs,
                    block_size=worker.block_size, kv_cache_bytes=worker.pool_kv_cache_bytes(pool.name),
                    tensor_parallel_size=worker.tensor_parallel_size,
                    replicas_ready=sum(w is not None for w in workers))
    return info


# --- health, readiness, metrics --------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """200 once every device has a replica loaded, else 503. A pool in a death spiral, an overloaded
    device, or a device with a replica down still serves: the answer stays 200 with `status: degraded`,
    the pool's reason under `pools`, each overloaded device's reason under `overloaded` and each
    replica's state under `replicas` (docs/GATEWAY.md)."""
    gateway = request.app[GATEWAY]
    ok = gateway.is_ready()
    degraded = gateway.spiral.degraded()
    overloaded = gateway.overload.overloaded()
    pools = {name: f"degraded: {degraded[name]}" if name in degraded else "ok" for name in gateway.spiral.pools}
    devices = gateway.device_states()
    replicas = gateway.replica_states()
    # down: a replica the device counts that does not serve (an autoscaled device's parked slots, `stopped`,
    # and one it is removing, `draining`, are at rest, not down)
    some_down = any(state not in ("ready", "draining", "stopped") for states in replicas.values() for state in states)
    status = "not ready" if not ok else "degraded" if degraded or some_down or overloaded else "ready"
    return web.json_response({"status": status, "devices": devices, "replicas": replicas, "pools": pools,
                              "overloaded": overloaded}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text; the device stats are the ones each worker pushed last (a scrape never waits). Written
    on a thread: thousands of tenants' series take a second to render, which the event loop's streams would
    wait for."""
    gateway = request.app[GATEWAY]
    refresh_metrics(gateway)
    body = await asyncio.to_thread(gateway.metrics.render)
    return web.Response(body=body, headers={"Content-Type": gateway.metrics.content_type})


def refresh_metrics(gateway: Gateway) -> None:
    """Bring the registry's device and credit series up to the stats each worker pushed last; a replica
    not ready reads 0 for what it runs and ages its stats (`GatewayMetrics.update_replica`)."""
    if gateway.autoscaler is not None:
        gateway.autoscaler.export()
    parked = set()
    for device, supervisors in gateway.supervisors.items():
        for replica, supervisor in enumerate(supervisors):
            stopped = supervisor.state == "stopped"
            if stopped:
                parked.add((device, replica))
            gateway.metrics.update_replica(device, replica, supervisor.client, supervisor.is_ready, parked=stopped)
    gateway.admission.metrics.refresh(list(gateway.admission.pools.values()), parked)
