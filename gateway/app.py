"""The aiohttp application: OpenAI-compatible endpoints in front of the pools.

`Gateway.from_config` does everything that can fail before a socket opens (models resolved,
tokenizers loaded, the capacity plan computed and turned into engine configs); `create_app` builds
the aiohttp app whose `cleanup_ctx` owns the device workers and the upstream `ClientSession`.
Workers load in the background: `/health` answers at once, `/ready` once every pool is loaded, and
requests that arrive earlier wait for their pool instead of being refused.

Request flow: parse and validate (`gateway.openai_api`) -> render the chat template and count the
prompt's tokens with the pool's tokenizer (in a thread for long prompts, so the event loop never
waits) -> `pools.router` picks the pool -> stream from the device worker (or forward to the
upstream) -> SSE or JSON. Leaving a stream early (client disconnect) aborts the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from engine.config import ConfigError, ModelConfig
from engine.outputs import RequestDelta
from engine.tokenizer import Tokenizer
from engine.weights import resolve_model
from engine.worker import AsyncEngineClient, EngineDeadError
from gateway import openai_api as api
from gateway.metrics import GatewayMetrics
from gateway.openai_api import ApiError
from pools.capacity import CapacityPlan, engine_configs, plan_capacity
from pools.router import NoRouteError, RouteTarget, Router, UnknownModelError
from pools.spec import CliffguardConfig, PoolSpec
from pools.tokencount import TokenCounter

log = logging.getLogger("cliffguard.gateway")

# Prompts longer than this (characters) are rendered and counted in a worker thread.
INLINE_TOKENIZE_CHARS = 2048


@dataclass
class PoolRuntime:
    """One pool as the gateway serves it: its route, tokenizer and where its requests go."""

    spec: PoolSpec
    target: RouteTarget
    tokenizer: Tokenizer            # chat template, token texts for logprobs
    counter: TokenCounter           # exact ids and counts (tiktoken where identical)
    prefix_ids: list[int]           # what the tokenizer adds to a completion prompt (e.g. BOS)
    client: AsyncEngineClient | None = None   # local pools: the device worker
    device: str | None = None
    _token_texts: dict[int, str] = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    def token_text(self, token_id: int) -> str:
        """The text of one token, as logprobs report it (special tokens included)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


@dataclass
class Gateway:
    """Everything a running gateway holds. Built once, before the server starts."""

    config: CliffguardConfig
    plan: CapacityPlan
    pools: dict[str, PoolRuntime]
    router: Router
    clients: dict[str, AsyncEngineClient] = field(default_factory=dict)
    device_ready: dict[str, asyncio.Future] = field(default_factory=dict)
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(2, "cliffguard-tok"))
    session: aiohttp.ClientSession | None = None

    @classmethod
    def from_config(cls, config: CliffguardConfig, *, vram_bytes: int | None = None) -> "Gateway":
        """Resolve models and tokenizers, plan capacity, build engine configs; ConfigError on any problem."""
        folders: dict[str, Path] = {}

        def folder(spec: str, key: str) -> Path:
            if spec not in folders:
                try:
                    folders[spec] = resolve_model(spec)
                except (FileNotFoundError, ValueError) as exc:
                    raise ConfigError(f"{key}: {exc}") from exc
            return folders[spec]

        model_configs: dict[str, ModelConfig] = {}
        for i, pool in enumerate(config.pools):
            if not pool.is_upstream and pool.model not in model_configs:
                model_configs[pool.model] = ModelConfig.from_folder(folder(pool.model, f"pools[{i}].model"))
        plan = plan_capacity(config, model_configs, vram_bytes=vram_bytes)
        tokenizers: dict[str, tuple[Tokenizer, TokenCounter, list[int]]] = {}
        runtimes: dict[str, PoolRuntime] = {}
        for i, pool in enumerate(config.pools):
            tok_spec = pool.tokenizer or pool.model
            key = f"pools[{i}].tokenizer" if pool.tokenizer else f"pools[{i}].model"
            if tok_spec not in tokenizers:
                path = folder(tok_spec, key)
                tokenizer = Tokenizer.from_folder(path)
                tokenizers[tok_spec] = (tokenizer, TokenCounter(tokenizer),
                                        tokenizer.encode("", add_special_tokens=True))
            tokenizer, counter, prefix = tokenizers[tok_spec]
            if pool.is_upstream:
                max_model_len = pool.max_model_len or _upstream_max_len(pool, folders)
            else:
                max_model_len = plan.pools[pool.name].max_model_len
            target = RouteTarget(pool.name, pool.model_name, pool.route, max_model_len)
            runtimes[pool.name] = PoolRuntime(pool, target, tokenizer, counter, prefix,
                                              device=None if pool.is_upstream else pool.device)
        return cls(config=config, plan=plan, pools=runtimes, router=Router([r.target for r in runtimes.values()]))

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn one device worker per device that has local pools; loading continues in the background."""
        loop = asyncio.get_running_loop()
        for device, config in engine_configs(self.config, self.plan).items():
            client = AsyncEngineClient(config)
            self.clients[device] = client
            ready = loop.create_future()
            self.device_ready[device] = ready
            for pool in self.pools.values():
                if pool.device == device:
                    pool.client = client
            task = loop.create_task(self._start_device(device, client, ready))
            task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    async def _start_device(self, device: str, client: AsyncEngineClient, ready: asyncio.Future) -> None:
        try:
            info = await client.start()
        except BaseException as exc:  # noqa: BLE001 - requests to this device get the reason
            log.error("device %s failed to start: %s", device, exc)
            if not ready.done():
                ready.set_exception(EngineDeadError(f"device {device!r} failed to start: {exc}"))
                ready.exception()  # mark retrieved
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        log.info("device %s ready: %s", device, info)
        if not ready.done():
            ready.set_result(info)

    async def stop(self) -> None:
        await asyncio.gather(*(c.shutdown() for c in self.clients.values()), return_exceptions=True)
        self.executor.shutdown(wait=False, cancel_futures=True)

    def is_ready(self) -> bool:
        return all(f.done() and not f.exception() for f in self.device_ready.values())

    async def wait_device(self, pool: PoolRuntime) -> dict[str, Any]:
        try:
            return await asyncio.shield(self.device_ready[pool.device])
        except EngineDeadError as exc:
            raise ApiError(503, str(exc), type="server_error", code="pool_unavailable") from None

    # --- tokenization and routing ----------------------------------------------------------------
    async def _off_loop(self, size: int, fn: Callable[[], Any]) -> Any:
        if size <= INLINE_TOKENIZE_CHARS:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    async def route_chat(self, model: str, messages: list[dict[str, str]]) -> tuple[PoolRuntime, list[int]]:
        """Render each candidate pool's chat template, count exactly, and take the first pool that admits it."""
        size = sum(len(m["content"]) for m in messages)
        return await self._route(model, "messages", size,
                                 lambda pool: _render_and_count(pool, messages))

    async def route_prompt(self, model: str, prompt: str | list[int]) -> tuple[PoolRuntime, list[int]]:
        """Count a completion prompt (text with the tokenizer's prefix, or token ids) and route it."""
        if isinstance(prompt, list):
            return await self._route(model, "prompt", 0, lambda pool: list(prompt), timed=False)
        return await self._route(model, "prompt", len(prompt),
                                 lambda pool: pool.prefix_ids + pool.counter.encode(prompt))

    async def _route(self, model: str, param: str, size: int, tokenize: Callable[[PoolRuntime], list[int]],
                     *, timed: bool = True) -> tuple[PoolRuntime, list[int]]:
        """The first candidate pool whose route admits the prompt's exact count (tokenized once per
        distinct tokenizer, off the event loop when `size` is large); 400 when no pool admits it."""
        seen: dict[int, list[int]] = {}
        for pool in self._candidates(model):
            if id(pool.counter) not in seen:
                started = time.perf_counter()
                try:
                    seen[id(pool.counter)] = await self._off_loop(size, functools.partial(tokenize, pool))
                except ValueError as exc:  # bad messages or a template error, named by the tokenizer
                    message = str(exc)
                    raise ApiError(400, message, param=message.split(":", 1)[0]) from None
                except TypeError as exc:  # JSON may carry text the tokenizer refuses, e.g. "\ud800"
                    raise ApiError(400, f"{param}: the text cannot be tokenized ({exc}); it must be valid "
                                   "Unicode (no lone surrogates)", param=param) from None
                if timed:
                    self.metrics.tokenizer_time.labels(backend=pool.counter.backend).observe(
                        time.perf_counter() - started)
            ids = seen[id(pool.counter)]
            if pool.target.admits(len(ids)):
                return pool, ids
        num_tokens = len(next(iter(seen.values())))
        try:
            self.router.route(model, num_tokens)
        except NoRouteError as exc:
            raise ApiError(400, f"{param}: {str(exc).removeprefix('prompt: ')}", param=param,
                           code="context_length_exceeded") from None
        raise AssertionError("a pool admits the prompt after all")

    def _candidates(self, model: str) -> list[PoolRuntime]:
        try:
            return [self.pools[t.name] for t in self.router.candidates(model)]
        except UnknownModelError as exc:
            raise ApiError(404, str(exc), param="model", code="model_not_found") from None


def _render_and_count(pool: PoolRuntime, messages: list[dict[str, str]]) -> list[int]:
    text = pool.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return pool.counter.encode(text)


def _upstream_max_len(pool: PoolSpec, folders: dict[str, Path]) -> int:
    """An upstream pool's context length: its `max_model_len`, else its tokenizer model's config, else 2^31."""
    path = folders.get(pool.tokenizer or pool.model)
    if path is not None and (path / "config.json").is_file():
        try:
            return ModelConfig.from_folder(path).max_position_embeddings
        except (ConfigError, ValueError):
            pass
    return 2**31 - 1


# --- the aiohttp app -------------------------------------------------------------------------------
GATEWAY = web.AppKey("gateway", Gateway)


def create_app(gateway: Gateway) -> web.Application:
    app = web.Application(client_max_size=gateway.config.gateway.max_body_bytes,
                          middlewares=[_error_middleware, _auth_middleware])
    app[GATEWAY] = gateway
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    gateway = app[GATEWAY]
    gateway.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
    await gateway.start()
    yield
    await gateway.session.close()
    await gateway.stop()


def _error_json(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


@web.middleware
async def _error_middleware(request: web.Request, handler) -> web.StreamResponse:
    metrics = request.app[GATEWAY].metrics
    try:
        return await handler(request)
    except ApiError as err:
        metrics.errors.labels(status=str(err.status)).inc()
        return _error_json(err)
    except web.HTTPRequestEntityTooLarge as exc:
        metrics.errors.labels(status="413").inc()
        return _error_json(ApiError(413, f"body: request body is too large ({exc.text.strip()})",
                                    param="body", code="request_too_large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        metrics.errors.labels(status=str(exc.status)).inc()
        return _error_json(ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}",
                                    type="invalid_request_error" if exc.status < 500 else "server_error"))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:  # noqa: BLE001 - a bug must not take the server down
        log.exception("unhandled error on %s %s", request.method, request.path)
        metrics.errors.labels(status="500").inc()
        return _error_json(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))


_OPEN_PATHS = {"/health", "/ready", "/metrics"}


@web.middleware
async def _auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    keys = request.app[GATEWAY].config.gateway.api_keys
    if keys and request.path not in _OPEN_PATHS:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.strip().encode(), k.encode())
                                                 for k in keys):
            raise ApiError(401, "invalid API key", code="invalid_api_key")
    return await handler(request)


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        raise ApiError(400, "body: empty request body; expected a JSON object", param="body")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"body: invalid JSON: {exc}", param="body") from None


# --- simple endpoints ------------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    devices = {}
    for name, fut in gateway.device_ready.items():
        if not fut.done():
            devices[name] = "loading"
        elif fut.exception() is not None:
            devices[name] = f"failed: {fut.exception()}"
        else:
            devices[name] = "ready"
    ok = gateway.is_ready()
    return web.json_response({"status": "ready" if ok else "not ready", "devices": devices},
                             status=200 if ok else 503)


async def models(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    data: dict[str, dict[str, Any]] = {}
    for pool in gateway.pools.values():
        entry = data.setdefault(pool.target.model_name, {
            "id": pool.target.model_name, "object": "model", "created": 0, "owned_by": "cliffguard",
            "max_model_len": 0, "pools": []})
        entry["max_model_len"] = max(entry["max_model_len"], pool.target.max_model_len)
        info: dict[str, Any] = {"name": pool.name, "min_prompt_tokens": pool.target.min_tokens,
                                "max_prompt_tokens": pool.target.max_tokens,
                                "max_model_len": pool.target.max_model_len}
        if pool.spec.is_upstream:
            info["upstream"] = pool.spec.upstream
        else:
            planned = gateway.plan.pools[pool.name]
            info.update(device=pool.device, planned_num_blocks=planned.num_blocks,
                        planned_max_num_seqs=planned.max_num_seqs)
            fut = gateway.device_ready.get(pool.device)
            if fut is not None and fut.done() and fut.exception() is None:
                allocated = fut.result()["pools"][pool.name]
                info.update(num_blocks=allocated["num_blocks"], max_num_seqs=allocated["max_num_seqs"],
                            block_size=fut.result()["block_size"],
                            kv_cache_bytes=allocated["num_blocks"] * fut.result()["block_size"]
                            * fut.result()["kv_bytes_per_token"])
        entry["pools"].append(info)
    return web.json_response({"object": "list", "data": list(data.values())})


async def metrics(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    for device, client in gateway.clients.items():
        fut = gateway.device_ready[device]
        if not (fut.done() and fut.exception() is None):
            continue
        info, stats = fut.result(), client.latest_stats   # pushed by the worker: never wait for a step
        if stats is None:
            continue
        block_bytes = info["block_size"] * info["kv_bytes_per_token"]
        for name, pool_stats in stats["pools"].items():
            gateway.metrics.update_pool(name, pool_stats, block_bytes)
        gateway.metrics.update_device(device, stats)
    return web.Response(body=gateway.metrics.render(),
                        headers={"Content-Type": gateway.metrics.content_type})


# --- completions -------------------------------------------------------------------------------------
async def chat_completions(request: web.Request) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    received = time.perf_counter()
    body = await _read_json(request)
    req = api.parse_chat(body)
    pool, ids = await gateway.route_chat(req.model, req.messages)
    gateway.metrics.routed.labels(pool=pool.name).inc()
    if pool.spec.is_upstream:
        from gateway.upstream import forward

        return await forward(request, gateway, pool, "/chat/completions", body, req.stream)
    return await _serve_local(request, gateway, [(pool, ids)], req.params, req.priority, req.stream,
                              req.include_usage, req.model, chat=True, received=received)


async def completions(request: web.Request) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    received = time.perf_counter()
    body = await _read_json(request)
    req = api.parse_completion(body)
    routed = [await gateway.route_prompt(req.model, p) for p in req.prompts]
    for pool, _ in routed:
        gateway.metrics.routed.labels(pool=pool.name).inc()
    upstream = [pool for pool, _ in routed if pool.spec.is_upstream]
    if upstream:
        if len(routed) > 1:
            raise ApiError(400, "prompt: a list of prompts cannot be sent to an upstream pool; send them one "
                           "by one", param="prompt")
        from gateway.upstream import forward

        return await forward(request, gateway, upstream[0], "/completions", body, req.stream)
    return await _serve_local(request, gateway, routed, req.params, req.priority, req.stream,
                              req.include_usage, req.model, chat=False, received=received)


@dataclass
class _Choice:
    """The running state of one choice (prompt i, sample j) of a response."""

    index: int
    pool: PoolRuntime
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    sent_role: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


async def _merged(gateway: Gateway, routed: Sequence[tuple[PoolRuntime, list[int]]], params, priority: int,
                  request_id: str) -> AsyncIterator[tuple[int, RequestDelta]]:
    """(prompt index, output) from every prompt's engine request, as they arrive."""
    for pool, _ in routed:
        await gateway.wait_device(pool)
    if len(routed) == 1:
        pool, ids = routed[0]
        async with contextlib.aclosing(pool.client.generate(ids, params, request_id=request_id,
                                                            priority=priority, pool=pool.name)) as stream:
            async for out in stream:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, pool: PoolRuntime, ids: list[int]) -> None:
        try:
            async with contextlib.aclosing(pool.client.generate(ids, params, request_id=f"{request_id}-{i}",
                                                                priority=priority, pool=pool.name)) as stream:
                async for out in stream:
                    queue.put_nowait((i, out))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))
            if isinstance(exc, asyncio.CancelledError):
                raise

    tasks = [asyncio.create_task(pump(i, pool, ids)) for i, (pool, ids) in enumerate(routed)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                remaining -= 1
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _engine_error(exc: Exception) -> ApiError:
    if isinstance(exc, EngineDeadError):
        return ApiError(503, f"engine unavailable: {exc}", type="server_error", code="engine_dead")
    message = str(exc)
    return ApiError(400, message, param=message.split(":", 1)[0] if ":" in message else None)


async def _serve_local(request: web.Request, gateway: Gateway, routed: list[tuple[PoolRuntime, list[int]]],
                       params, priority: int, stream: bool, include_usage: bool, model: str, *, chat: bool,
                       received: float) -> web.StreamResponse:
    n = params.n
    request_id = api.new_id("chatcmpl" if chat else "cmpl")
    created = int(time.time())
    choices = {i * n + j: _Choice(i * n + j, pool) for i, (pool, _) in enumerate(routed) for j in range(n)}
    prompt_tokens = sum(len(ids) for _, ids in routed)
    pool_header = ",".join(dict.fromkeys(pool.name for pool, _ in routed))
    metrics = gateway.metrics
    for pool, ids in routed:
        metrics.prompt_tokens.labels(pool=pool.name).inc(len(ids))
    want_logprobs = params.logprobs is not None

    events = _merged(gateway, routed, params, priority, request_id)
    response: web.StreamResponse | None = None
    first_at: dict[int, float] = {}
    last_at: dict[int, float] = {}
    try:
        async with contextlib.aclosing(events):
            async for i, out in events:
                now = time.perf_counter()
                pool = routed[i][0]
                new_tokens = sum(len(c.delta_token_ids) for c in out.outputs)
                if new_tokens:
                    if i not in first_at:
                        first_at[i] = now
                        metrics.ttft.labels(pool=pool.name).observe(now - received)
                    else:
                        metrics.itl.labels(pool=pool.name).observe((now - last_at[i]) / new_tokens)
                    last_at[i] = now
                    metrics.generation_tokens.labels(pool=pool.name).inc(new_tokens)
                if out.finished:
                    metrics.e2e.labels(pool=pool.name).observe(now - received)
                    if "queue_time" in out.metrics:
                        metrics.queue_time.labels(pool=pool.name).observe(out.metrics["queue_time"])
                chunk_choices = []
                for c in out.outputs:
                    choice = choices[i * n + c.index]
                    delta_lp = None
                    if want_logprobs and c.delta_token_ids:
                        delta_lp = (c.delta_token_ids, c.delta_logprobs or [], c.delta_top_logprobs or [])
                    text_offset = len(choice.text)
                    choice.text += c.delta_text
                    choice.num_tokens = c.num_tokens
                    if want_logprobs:
                        choice.token_ids.extend(c.delta_token_ids)
                        choice.logprobs.extend(c.delta_logprobs or [])
                        choice.top_logprobs.extend(c.delta_top_logprobs or [])
                    if c.finish_reason is not None and choice.finish_reason is None:
                        choice.finish_reason = c.finish_reason
                        metrics.request_success.labels(pool=pool.name, finished_reason=c.finish_reason).inc()
                    if stream and (c.delta_text or c.finish_reason or delta_lp):
                        chunk_choices.append(_stream_choice(choice, c, delta_lp, chat, text_offset))
                if stream and chunk_choices:
                    if response is None:
                        response = await _start_sse(request, pool_header)
                    make = api.chat_chunk if chat else api.completion_chunk
                    await _send(response, make(request_id, model, created, chunk_choices, include_usage))
    except ApiError:
        raise
    except (EngineDeadError, ValueError) as exc:
        err = _engine_error(exc)
        if response is None:
            raise err from None
        await _send(response, err.body())
        await response.write(b"data: [DONE]\n\n")
        return response

    completion_tokens = sum(c.num_tokens for c in choices.values())
    if stream:
        if response is None:
            response = await _start_sse(request, pool_header)
        if include_usage:
            obj = "chat.completion.chunk" if chat else "text_completion"
            await _send(response, api.usage_chunk(request_id, model, created, obj, prompt_tokens,
                                                  completion_tokens))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    body_choices = []
    for index in sorted(choices):
        choice = choices[index]
        lp = None
        if want_logprobs:
            lp = (api.chat_logprobs if chat else api.completion_logprobs)(
                choice.token_ids, choice.logprobs, choice.top_logprobs, choice.pool.token_text)
        if chat:
            body_choices.append({"index": index, "message": {"role": "assistant", "content": choice.text},
                                 "logprobs": lp, "finish_reason": choice.finish_reason})
        else:
            body_choices.append({"index": index, "text": choice.text, "logprobs": lp,
                                 "finish_reason": choice.finish_reason})
    make = api.chat_response if chat else api.completion_response
    return web.json_response(make(request_id, model, body_choices, prompt_tokens, completion_tokens),
                             headers={"x-cliffguard-pool": pool_header})


def _stream_choice(choice: _Choice, c, delta_lp, chat: bool, text_offset: int) -> dict[str, Any]:
    lp = None
    if delta_lp is not None:
        ids, lps, tops = delta_lp
        lp = (api.chat_logprobs(ids, lps, tops, choice.pool.token_text) if chat else
              api.completion_logprobs(ids, lps, tops, choice.pool.token_text, text_offset))
    if chat:
        delta: dict[str, Any] = {}
        if not choice.sent_role:
            delta["role"] = "assistant"
            choice.sent_role = True
        delta["content"] = c.delta_text
        return {"index": choice.index, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason}
    return {"index": choice.index, "text": c.delta_text, "logprobs": lp, "finish_reason": c.finish_reason}


async def _start_sse(request: web.Request, pool_header: str) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "x-cliffguard-pool": pool_header})
    await response.prepare(request)
    return response


async def _send(response: web.StreamResponse, obj: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")


def run(config: CliffguardConfig, *, host: str | None = None, port: int | None = None,
        vram_bytes: int | None = None) -> None:
    """`cliffguard serve`: validate and plan everything, then serve until interrupted."""
    gateway = Gateway.from_config(config, vram_bytes=vram_bytes)
    host = host or config.gateway.host
    port = config.gateway.port if port is None else port
    app = create_app(gateway)

    def announce(runner_site_port: int) -> None:
        print(f"cliffguard: serving on http://{host}:{runner_site_port} (pools: "
              f"{', '.join(gateway.pools)})", file=sys.stderr, flush=True)

    async def main() -> None:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        announce(runner.addresses[0][1])
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
