"""The endpoints: OpenAI chat and text completions, models, health, readiness and metrics.

A completion request: parse and validate (`gateway.openai_api`) -> count and route each prompt
(`Gateway.route_chat` / `route_prompt`) -> check that max_tokens fits the pool's context -> forward to
an upstream pool (`gateway.upstream`) or wait for the device worker and answer from the local pools
(`gateway.responses`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from gateway import openai_api as api
from gateway.openai_api import ApiError, ChatRequest, CompletionRequest
from gateway.responses import LocalResponse
from gateway.runtime import GATEWAY, Gateway, model_not_found
from gateway.upstream import forward
from pools.pool import Pool
from pools.router import UnknownModelError


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
    req = api.parse_chat(body)
    routed = [await gateway.route_chat(req.model, req.messages)]
    return await _serve(request, gateway, req, routed, body, "/chat/completions", received)


async def completions(request: web.Request) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    received = time.perf_counter()
    body = await read_json(request)
    req = api.parse_completion(body)
    routed = [await gateway.route_prompt(req.model, p) for p in req.prompts]
    return await _serve(request, gateway, req, routed, body, "/completions", received)


async def _serve(request: web.Request, gateway: Gateway, req: ChatRequest | CompletionRequest,
                 routed: Sequence[tuple[Pool, list[int]]], body: dict[str, Any], path: str,
                 received: float) -> web.StreamResponse:
    """Answer routed prompts: from the upstream pool (`path` there) or from the local pools."""
    for pool, ids in routed:
        gateway.metrics.routed.labels(pool=pool.name).inc()
        api.check_context(req, len(ids), pool.max_model_len, pool.name)
    upstream = [pool for pool, _ in routed if pool.is_upstream]
    if upstream:
        if len(routed) > 1:
            raise ApiError(400, "prompt: a list of prompts cannot be sent to an upstream pool; send them one "
                           "by one", param="prompt")
        return await forward(request, gateway.session, upstream[0], path, body, req.stream, gateway.metrics)
    for pool, _ in routed:
        await gateway.wait_device(pool)
    return await LocalResponse(request, req, routed, received=received, metrics=gateway.metrics).serve()


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
        info["upstream"] = pool.spec.upstream
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
    gateway = request.app[GATEWAY]
    ok = gateway.is_ready()
    return web.json_response({"status": "ready" if ok else "not ready", "devices": gateway.device_states()},
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
    return web.Response(body=gateway.metrics.render(), headers={"Content-Type": gateway.metrics.content_type})
