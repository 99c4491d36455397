"""The endpoints: OpenAI chat and text completions, models, health, readiness and metrics.

A completion request: parse and validate (`gateway.openai_api`) -> count and route each prompt
(`Gateway.route_chat` / `route_prompt`) -> check that max_tokens fits the pool's context -> forward to
an upstream pool (`gateway.upstream`), or hold KV credits in the local pools' queues
(`gateway.admission`), wait for the device worker and answer from the local pools
(`gateway.responses`). `answer` does the same for one batch line, without an HTTP request.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from gateway import openai_api as api
from gateway.openai_api import ApiError, ChatRequest, CompletionRequest
from gateway.responses import ClientGone, LocalResponse
from gateway.runtime import GATEWAY, Gateway, model_not_found
from gateway.upstream import forward, redact
from pools.pool import Pool
from pools.router import UnknownModelError

log = logging.getLogger("cliffguard.gateway")

# A request the device worker died under before its client saw anything (nothing streamed yet, or not
# streamed at all) runs again this many times on the restarted worker (its client sees one answer);
# past that, or once a chunk was streamed, 503 engine_dead (or an error event).
# A request that itself kills the worker therefore kills it 1 + this many times. Batch lines are retried
# by the batch runner instead (a line that kills the worker twice is a poison line).
ENGINE_DEATH_RETRIES = 1


async def read_json(request: web.Request) -> Any:
    """The request body as JSON; 400 naming `body` when it is empty, invalid or nested too deeply."""
    raw = await request.read()
    if not raw:
        raise ApiError(400, "body: empty request body; expected a JSON object", param="body")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"body: invalid JSON: {exc}", param="body") from None
    except RecursionError:
        raise ApiError(400, "body: the JSON is nested too deeply", param="body") from None


# --- completions -----------------------------------------------------------------------------------
async def chat_completions(request: web.Request) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    received = time.perf_counter()
    body = await read_json(request)
    req = api.parse_chat(body, gateway.config.gateway.limits)
    routed = [await gateway.route_chat(req.model, req.messages)]
    tenant = gateway.admission.tenant_of(request)
    return await _serve(request, gateway, req, routed, body, "/chat/completions", received, tenant)


async def completions(request: web.Request) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    received = time.perf_counter()
    body = await read_json(request)
    req = api.parse_completion(body, gateway.config.gateway.limits)
    routed = [await gateway.route_prompt(req.model, p) for p in req.prompts]
    tenant = gateway.admission.tenant_of(request)
    return await _serve(request, gateway, req, routed, body, "/completions", received, tenant)


async def _serve(request: web.Request | None, gateway: Gateway, req: ChatRequest | CompletionRequest,
                 routed: Sequence[tuple[Pool, list[int]]], body: dict[str, Any], path: str,
                 received: float, tenant: str, background: bool = False) -> web.StreamResponse | dict[str, Any]:
    """Answer routed prompts: from the upstream pool (`path` there) or from the local pools once their
    KV credits are held. Without `request` (a batch line): the JSON body, nothing streamed. A client
    that went away (or stopped reading) gets nothing more: its closed connection is returned as is."""
    try:
        return await _answer_routed(request, gateway, req, routed, body, path, received, tenant, background)
    except ClientGone as exc:
        log.info("%s %s: %s", request.method if request is not None else "batch", path, exc)
        return web.Response(status=499)   # nginx's "client closed request"; nobody reads it


async def _answer_routed(request: web.Request | None, gateway: Gateway, req: ChatRequest | CompletionRequest,
                         routed: Sequence[tuple[Pool, list[int]]], body: dict[str, Any], path: str,
                         received: float, tenant: str, background: bool) -> web.StreamResponse | dict[str, Any]:
    for pool, ids in routed:
        gateway.metrics.routed.labels(pool=pool.name).inc()
        api.check_context(req, len(ids), pool.max_model_len, pool.name)
    upstream = [pool for pool, _ in routed if pool.is_upstream]
    if upstream:
        if len(routed) > 1:
            raise ApiError(400, "prompt: a list of prompts cannot be sent to an upstream pool; send them one "
                           "by one", param="prompt")
        response = await forward(request, gateway.session, upstream[0], path, body, req.stream, gateway.metrics,
                                 write_timeout=gateway.config.gateway.write_timeout)
        if request is None:
            if response.status >= 400:
                raise _relayed_error(response)
            return json.loads(response.body)
        return response
    admission = gateway.admission
    req = dataclasses.replace(req, priority=max(req.priority, admission.tenants.policy(tenant).min_priority))
    async with admission.admitted(routed, max_tokens=req.params.max_tokens, n=req.params.n,
                                  request_id=api.new_id("adm"), tenant=tenant, priority=req.priority,
                                  background=background, max_tokens_param=req.max_tokens_param):
        retries = 0 if background else ENGINE_DEATH_RETRIES   # the batch runner has its own policy
        for attempt in range(1 + retries):
            for pool, _ in routed:
                await gateway.wait_device(pool)
            local = LocalResponse(request, req, routed, received=received, metrics=gateway.metrics,
                                  write_timeout=gateway.config.gateway.write_timeout, tenant=tenant)
            await local.run()
            if attempt == retries or not local.retryable:
                break
            log.warning("%s: the device worker died before the client saw anything (%s); running it again on "
                        "the restarted worker", local.request_id, local.error.message)
    # The engine is done with every request: its credits are back, however slowly the client reads.
    return await (local.finish() if request is not None else local.result())


async def answer(gateway: Gateway, path: str, body: Any, *, tenant: str | None = None,
                 batch: bool = False) -> tuple[int, dict[str, Any]]:
    """One request without HTTP (a batch line): `path` is /v1/chat/completions or /v1/completions.
    Returns (status, JSON body) as an HTTP client would get them, errors in the OpenAI format; `batch`
    queues it behind interactive traffic. Streaming is refused (param `stream`)."""
    received = time.perf_counter()
    tenant = tenant or gateway.admission.tenants.resolve(None)
    try:
        if not isinstance(body, dict):
            raise ApiError(400, f"body: must be a JSON object, got {type(body).__name__}", param="body")
        if body.get("stream"):
            raise ApiError(400, "stream: a batch line cannot stream; remove stream", param="stream")
        if path == "/v1/chat/completions":
            req = api.parse_chat(body, gateway.config.gateway.limits)
            routed = [await gateway.route_chat(req.model, req.messages)]
        elif path == "/v1/completions":
            req = api.parse_completion(body, gateway.config.gateway.limits)
            routed = [await gateway.route_prompt(req.model, p) for p in req.prompts]
        else:
            raise ApiError(400, f"url: {path!r} is not served; use /v1/chat/completions or /v1/completions",
                           param="url")
        return 200, await _serve(None, gateway, req, routed, body, path.removeprefix("/v1"), received, tenant,
                                 background=batch)
    except ApiError as err:
        gateway.metrics.errors.labels(status=str(err.status)).inc()
        return err.status, err.body()


def _relayed_error(response: web.Response) -> ApiError:
    """An upstream's error response (already in the OpenAI format) as an ApiError."""
    error = json.loads(response.body).get("error") or {}
    return ApiError(response.status, error.get("message", ""), param=error.get("param"),
                    type=error.get("type", "server_error"), code=error.get("code"))


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
                planned_max_num_seqs=planned.max_num_seqs)
    worker = gateway.worker_info(pool.device)
    if worker is not None:
        allocated = worker.pools[pool.name]
        info.update(num_blocks=allocated.num_blocks, max_num_seqs=allocated.max_num_seqs,
                    block_size=worker.block_size, kv_cache_bytes=worker.pool_kv_cache_bytes(pool.name))
    return info


# --- health, readiness, metrics --------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """200 once every device worker has loaded, else 503. A pool in a death spiral still serves: the
    answer stays 200 with `status: degraded` and the pool's reason under `pools` (docs/GATEWAY.md)."""
    gateway = request.app[GATEWAY]
    ok = gateway.is_ready()
    degraded = gateway.spiral.degraded()
    pools = {name: f"degraded: {degraded[name]}" if name in degraded else "ok" for name in gateway.spiral.pools}
    status = "not ready" if not ok else "degraded" if degraded else "ready"
    return web.json_response({"status": status, "devices": gateway.device_states(), "pools": pools},
                             status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text; the device stats are the ones each worker pushed last (a scrape never waits)."""
    gateway = request.app[GATEWAY]
    for device, client in gateway.clients.items():
        info, stats = gateway.worker_info(device), client.latest_stats
        if info is None or stats is None:
            continue
        for name, pool_stats in stats.pools.items():
            gateway.metrics.update_pool(name, pool_stats, info.block_bytes)
        gateway.metrics.update_device(device, stats)
    gateway.admission.metrics.refresh(list(gateway.admission.pools.values()))
    return web.Response(body=gateway.metrics.render(), headers={"Content-Type": gateway.metrics.content_type})
