"""`Gateway`: everything a running gateway holds — config, capacity plan, pools, router, device
workers and their readiness, metrics, the tokenizer thread pool and the `UpstreamClient`.

`Gateway.from_config` does everything that can fail before a socket opens (models resolved,
tokenizers loaded, the capacity plan computed); `start` spawns the device workers, one per replica of
each device, which load in the background, each under a `gateway.workers.supervisor.DeviceSupervisor` that
restarts it if it dies, and starts the `SpiralWatch` (death-spiral detection per local pool and
replica). The app's `cleanup_ctx` (gateway.app) calls `start` and `stop` and owns the upstream client. All
methods run on the event loop; only `Router.route` (via `route_chat` / `route_prompt`) and the tokenizers
it calls may run on the tokenizer thread.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from engine.config import EngineConfig
from engine.stats import STATS_INTERVAL, PoolStats, WorkerInfo
from engine import structured
from engine.structured import StructuredOutput
from engine.tokenizer import Tokenizer
from gateway.openai.tool_specs import MAX_CACHED_REASON_CHARS, Tool
from gateway.openai.chat_prompt import prompt_ids
from engine.client import AsyncEngineClient
from gateway.admission import AdmissionControl
from gateway.workers.autoscaler import Autoscaler
from gateway.monitoring.metrics import GatewayMetrics
from gateway.openai.errors import DRAIN_CUT, ApiError, named_error, renamed_field
from gateway.monitoring.overload import OverloadWatch
from gateway.workers.deaths import DeviceDeaths, SuspectGate
from gateway.workers.device_wait import wait_for_replica
from gateway.workers.supervisor import DeviceSupervisor
from gateway.ticker import Ticker
from gateway.upstream.connection import UpstreamClient
from pools.capacity_plan import CapacityPlan, plan_capacity, replica_engine_configs
from pools.model_configs import pool_tokenizer, resolve_model_configs, upstream_context
from pools.pool import Pool
from pools.router import NoRouteError, Router, UnknownModelError
from pools.config.gateway_spec import Backoff
from pools.config.spec import CliffguardConfig
from pools.spiral import SpiralDetector
from pools.tenants import Tenants
from pools.tokencount import TokenCounter

log = logging.getLogger("cliffguard.gateway")

# Prompts longer than this (characters) are rendered and counted in a worker thread.
INLINE_TOKENIZE_CHARS = 2048
MESSAGE_OVERHEAD_CHARS = 32   # what each message adds to the rendered text (role and template markers), about
MAX_CACHED_GRAMMAR_CHECKS = 1024   # distinct schemas whose check the gateway remembers
SPIRAL_INTERVAL = STATS_INTERVAL   # seconds between death-spiral checks: as often as a busy worker pushes stats


class SpiralWatch:
    """Death-spiral detection for the local pools: one `pools.spiral.SpiralDetector` per pool whose
    `death_spiral` is enabled, fed every `SPIRAL_INTERVAL` seconds from the stats its device worker
    last pushed (`AsyncEngineClient.latest_stats`), so nothing here waits on a model step.

    A report is fed once, at the gateway's monotonic time when it is first seen (within a check of when
    it was taken; never by the worker's wall clock, which may step back). While a pool's last report
    shows it idle (nothing running, waiting or swapped) its totals cannot move, so they are fed again at
    the current time: an idle pool's detector keeps judging, and clears. A busy pool whose report is late (a long step)
    is not extrapolated; the detector waits for the next report.

    When a pool trips: `cliffguard_death_spiral{pool}` 1, a WARNING naming the pool and the numbers,
    and `/ready` lists the pool as degraded with the reason; when it clears: 0 and an INFO line.
    Event-loop only.
    """

    def __init__(self, pools: dict[str, Pool], metrics: GatewayMetrics) -> None:
        self.pools = {name: pool for name, pool in pools.items() if not pool.is_upstream}
        # one detector per pool and replica: each replica's engine can spiral on its own
        self.detectors = {(name, r): SpiralDetector(pool.spec.death_spiral) for name, pool in self.pools.items()
                          if pool.spec.death_spiral.enabled for r in range(pool.num_replicas)}
        self.metrics = metrics
        self._seen: dict[tuple[str, int], float] = {}   # (pool, replica) -> `taken_at` of the report fed last
        self._ticker = Ticker("cliffguard-spiral", SPIRAL_INTERVAL, lambda: self.check(time.monotonic()), log,
                              "death-spiral check failed")
        for name, replica in self.detectors:
            metrics.death_spiral.labels(pool=name, replica=str(replica)).set(0)   # exported from the start

    def start(self) -> None:
        """Start the ticker (idempotent; needs a running loop)."""
        self._ticker.start()

    async def stop(self) -> None:
        await self._ticker.stop()

    def degraded(self) -> dict[str, str]:
        """The pools in a death spiral now (on any replica), each with its reason (one line with the numbers)."""
        out: dict[str, str] = {}
        for (name, replica), d in self.detectors.items():
            if d.tripped:
                where = f"replica {replica}: " if self.pools[name].num_replicas > 1 else ""
                out[name] = "; ".join(filter(None, (out.get(name), where + d.state.reason)))
        return out

    def check(self, now: float) -> None:
        """Feed each watched pool's latest report, new since the last check, at `now` (the gateway's
        `time.monotonic()`): a report is timed when the gateway first sees it, within a check of when the
        worker took it, so a step of either machine's wall clock (`taken_at`'s) never stalls the detector."""
        for (name, replica), detector in self.detectors.items():
            client = self.pools[name].clients[replica]
            stats = client.latest_stats if client is not None and client.is_alive else None
            key = (name, replica)
            if stats is None or name not in stats.pools:   # its worker dead, or not heard from yet: none spirals
                if detector.tripped:   # a busy pool's last report is never fed again: it held the alert for good
                    self.detectors[key] = SpiralDetector(self.pools[name].spec.death_spiral)
                    self._seen.pop(key, None)
                    self.metrics.death_spiral.labels(pool=name, replica=str(replica)).set(0)
                    log.info("%s: death spiral cleared: its worker is not running", self._where(name, replica))
                continue
            pool_stats = stats.pools[name]
            if self._seen.get(key) == stats.taken_at and not _is_idle(pool_stats):
                continue   # busy, and no new report: not extrapolated
            self._seen[key] = stats.taken_at
            state = detector.observe(now, pool_stats.num_preemptions, pool_stats.num_generated_tokens)
            if not state.changed:
                continue
            self.metrics.death_spiral.labels(pool=name, replica=str(replica)).set(1 if state.tripped else 0)
            (log.warning if state.tripped else log.info)("%s: %s", self._where(name, replica), state.reason)

    def _where(self, name: str, replica: int) -> str:
        return f"pool {name}" + (f" replica {replica}" if self.pools[name].num_replicas > 1 else "")


def _is_idle(stats: PoolStats) -> bool:
    return not (stats.num_running or stats.num_waiting or stats.num_swapped)


@dataclass
class Gateway:
    """Everything a running gateway holds. Built once, before the server starts."""

    config: CliffguardConfig
    plan: CapacityPlan
    engines: dict[str, list[EngineConfig]]   # device -> what each replica's worker runs: the plan's numbers
    pools: dict[str, Pool]
    router: Router
    supervisors: dict[str, list[DeviceSupervisor]] = field(default_factory=dict)   # device -> each replica's life
    backoff: Backoff = field(default_factory=Backoff)   # between restarts of a dead device worker (YAML)
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(2, "cliffguard-tok"))
    upstream: UpstreamClient | None = None   # forwards to `upstream:` pools (gateway.upstream.relay)
    admission: AdmissionControl | None = None   # KV credits of the local pools, tenants (gateway.admission)
    spiral: SpiralWatch | None = None           # death-spiral detection of the local pools
    overload: OverloadWatch | None = None       # each device's offered load against its capacity
    autoscaler: Autoscaler | None = None        # replicas added and removed (autoscaled devices), their states
    clusters: dict[str, Any] = field(default_factory=dict)   # Ray address -> gateway.workers.ray_cluster.RayCluster
    # constraint key -> the grammar library's objection ("" when it can enforce it); LRU, event-loop only
    grammar_checks: OrderedDict[str, str] = field(default_factory=OrderedDict)
    cuttable: set[asyncio.Task] = field(default_factory=set)   # HTTP requests waiting or running: `cut_in_flight`
    # device -> the requests waiting for any of its replicas to be ready (`wait_device`), each since when
    device_waits: dict[str, dict[object, float]] = field(default_factory=dict)
    drain_over: bool = False

    @classmethod
    def from_config(cls, config: CliffguardConfig, *, vram_bytes: int | None = None) -> Gateway:
        """Resolve models and tokenizers, plan capacity, turn the plan into engine configs (which checks
        that each device exists on this machine), build the pools; ConfigError on any problem."""
        _check_placements(config)
        folders: dict[str, Path] = {}
        model_configs = resolve_model_configs(config, folders=folders)
        plan = plan_capacity(config, model_configs, vram_bytes=vram_bytes)
        engines = replica_engine_configs(config, plan)
        tokenizers: dict[tuple[str, str | None], tuple[Tokenizer, TokenCounter, list[int], list[int]]] = {}
        pools: dict[str, Pool] = {}
        for i, spec in enumerate(config.pools):
            tok_spec = (spec.tokenizer or spec.model, spec.chat_template)
            if tok_spec not in tokenizers:
                tokenizer = pool_tokenizer(spec, i, folders)
                tokenizers[tok_spec] = (tokenizer, TokenCounter(tokenizer), *map(list, tokenizer.special_ids_around))
            if spec.is_upstream:
                max_model_len, replicas = spec.max_model_len or upstream_context(spec, folders, i), 1
            else:
                max_model_len, replicas = plan.pools[spec.name].max_model_len, config.devices[spec.device].replicas
            tokenizer, counter, prefix_ids, suffix_ids = tokenizers[tok_spec]
            vocab = tokenizer.vocab_size if spec.is_upstream else min(tokenizer.vocab_size,   # the engine's rows too
                                                                      model_configs[spec.model].vocab_size)
            pools[spec.name] = Pool(spec, tokenizer, counter, prefix_ids, max_model_len=max_model_len,
                                    suffix_ids=suffix_ids, num_replicas=replicas, vocab_size=vocab)
        gateway = cls(config=config, plan=plan, engines=engines, pools=pools, router=Router(list(pools.values())),
                      backoff=config.gateway.restart_backoff)
        credits = {name: p.num_blocks * p.block_size for name, p in plan.pools.items()}
        max_num_seqs = {name: p.max_num_seqs for name, p in plan.pools.items()}
        gateway.admission = AdmissionControl.build(Tenants(config.tenants), list(pools.values()),
                                                   gateway.metrics.registry, credits, max_num_seqs,
                                                   keys_checked=bool(config.gateway.api_keys),
                                                   state_pools=frozenset(n for n, p in plan.pools.items()
                                                                         if p.state_bytes_per_seq))
        gateway.spiral = SpiralWatch(pools, gateway.metrics)
        gateway.overload = OverloadWatch(pools, max_num_seqs, gateway.metrics)
        return gateway

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn one device worker per replica of each device that has local pools, each under a
        `DeviceSupervisor` (restarted with back-off if it dies); loading continues in the background."""
        for device, configs in self.engines.items():
            pools = [pool for pool in self.pools.values() if pool.device == device]
            links = self._links(device, configs)
            watchdog = self.config.gateway
            deaths = DeviceDeaths(device, len(configs))   # one record of the device's replicas' deaths
            supervisors = [DeviceSupervisor(device, config, pools, self.metrics, self.backoff,
                                            stall_seconds=watchdog.stall_seconds, replica=r, link=link,
                                            step_timeout_seconds=watchdog.step_timeout_seconds, deaths=deaths,
                                            start_seconds=watchdog.start_timeout_seconds)
                           for r, (config, link) in enumerate(zip(configs, links))]
            self.supervisors[device] = supervisors
            for pool in pools:
                pool.admission.is_up = lambda replica, s=supervisors: s[replica].is_ready and not s[replica].draining
                pool.admission.on_down = lambda patient, pool=pool: self.wait_device(pool, patient)
            for supervisor in supervisors[:self.config.devices[device].initial_replicas]:
                supervisor.start()   # an autoscaled device starts at its min; the other slots are parked
        self.admission.start()
        self.spiral.start()
        self.overload.start(self.supervisors)
        self.autoscaler = Autoscaler(self.config.devices, self.supervisors, self.pools, self.metrics,
                                     overloaded=self.overload.short_of_replicas, device_wait=self.device_wait,
                                     offered=self.overload.offered_replicas)
        self.autoscaler.start()

    def _links(self, device: str, configs: list[EngineConfig]) -> list:
        """Where each replica of `device` runs: None (a local worker process) or its Ray actor's link."""
        spec = self.config.devices[device]
        if spec.placement != "ray":
            return [None] * len(configs)
        from gateway.workers.ray_cluster import RayCluster, RayReplica

        address = spec.resolved_ray_address(os.environ)
        cluster = self.clusters.setdefault(address, RayCluster(address, take_over=self.config.gateway.take_over))
        links: list[RayReplica] = []
        links += [RayReplica(cluster, device, r, config, links) for r, config in enumerate(configs)]
        return links

    async def begin_drain(self) -> None:
        """The app's shutdown began (the listener closed, the drain under way): the autoscaler decides no more."""
        if self.autoscaler is not None:
            await self.autoscaler.freeze()

    async def stop(self) -> None:
        if self.autoscaler is not None:
            await self.autoscaler.stop()
        await self.admission.stop()
        await self.spiral.stop()
        await self.overload.stop()
        await asyncio.gather(*(s.stop() for s in self.all_supervisors), return_exceptions=True)
        await asyncio.gather(*(c.release_claims() for c in self.clusters.values()), return_exceptions=True)
        self.executor.shutdown(wait=False, cancel_futures=True)

    @property
    def all_supervisors(self) -> list[DeviceSupervisor]:
        return [s for replicas in self.supervisors.values() for s in replicas]

    @property
    def clients(self) -> dict[str, list[AsyncEngineClient]]:
        """Each device's current worker clients, one per replica that has one (a new one after each
        restart); empty before `start`."""
        return {device: [s.client for s in replicas if s.client is not None]
                for device, replicas in self.supervisors.items()}

    # --- readiness -------------------------------------------------------------------------------
    def device_states(self) -> dict[str, str]:
        """Each device: `loading`, `ready`, `restarting: <reason>` or `failed: <reason>` (a replicated
        device: `ready` when all its replicas are, `degraded: k of N replicas ready` when some are, else
        its first replica's state)."""
        states = {}
        for device, slots in self.supervisors.items():
            replicas = [s for s in slots if s.state != "stopped"] or slots   # an autoscaled device's started ones
            ready = sum(s.is_ready for s in replicas)
            if len(replicas) == 1 or ready == 0:
                states[device] = replicas[0].state
            else:
                states[device] = "ready" if ready == len(replicas) else \
                    f"degraded: {ready} of {len(replicas)} replicas ready"
        return states

    def replica_states(self) -> dict[str, list[str]]:
        """Each device's replicas' states, in replica order."""
        return {device: [s.state for s in replicas] for device, replicas in self.supervisors.items()}

    def is_ready(self) -> bool:
        """Every device has a replica ready: every local pool can serve."""
        return all(any(s.is_ready for s in replicas) for replicas in self.supervisors.values())

    def worker_info(self, device: str | None, replica: int = 0) -> WorkerInfo | None:
        """What a replica's worker loaded; None while it loads or restarts, if it failed, or for no device."""
        replicas = self.supervisors.get(device) if device is not None else None
        return replicas[replica].info if replicas else None

    def cut_in_flight(self) -> int:
        """At the end of the drain (`gateway.signals`): cut every HTTP request still waiting or running, each
        answered 503 `server_shutting_down` (a stream: that error event, then `[DONE]`); how many."""
        self.drain_over = True   # one that reaches its run later is answered so at once
        for task in list(self.cuttable):
            task.cancel(DRAIN_CUT)
        return len(self.cuttable)

    def suspect_gates(self, pools: Iterable[Pool]) -> list[SuspectGate]:
        """The `SuspectGate` of each local pool's device, in device order (one order: no two requests
        holding some wait on each other)."""
        devices = sorted({pool.device for pool in pools if pool.device in self.supervisors})
        return [self.supervisors[device][0].deaths.suspects for device in devices]

    async def wait_device(self, pool: Pool, patient: bool = False, spent: float = 0.0) -> None:
        """Wait until a replica of the pool's device has loaded (at once when one is up), holding nothing (no
        KV credits: taken after); 503 if every replica started failed to start, or with `Retry-After` if none
        is ready within `gateway.device_wait_seconds` (or the pool's `max_queue_seconds`, when smaller and not
        0; `patient`: however long), `spent` of them gone already (its waits for its other pools' devices: one
        deadline); the 503 names each replica's state: loading, placing on a cluster, restarting."""
        limit = None if patient else device_wait_limit(self.config, [pool])
        waiting, key = self.device_waits.setdefault(pool.device, {}), object()
        if not patient:   # a patient one waits by design: no sign of a replica short (`device_wait`)
            waiting[key] = time.monotonic()
        try:
            await wait_for_replica(self.supervisors[pool.device], pool.name, pool.device, limit, spent)
        finally:
            waiting.pop(key, None)

    def device_wait(self, device: str, now: float) -> float:
        """The longest a request (not a patient one) has now waited for a replica of `device` to be ready: the
        autoscaler's sign that none serves (one crash-looping, a lost node) and a parked slot should start."""
        return max((now - since for since in self.device_waits.get(device, {}).values()), default=0.0)

    async def check_grammar(self, constraint: StructuredOutput | None, param: str) -> None:
        """400 naming `param` when the grammar library cannot enforce `constraint`; checked on the tokenizer
        thread (a large schema takes milliseconds), each distinct constraint once (a reason over
        MAX_CACHED_REASON_CHARS, which may quote the schema, each time: what is remembered stays small)."""
        if constraint is None:
            return
        if (error := self.grammar_checks.get(constraint.key)) is None:
            error = await asyncio.get_running_loop().run_in_executor(self.executor, _grammar_error, constraint)
            if len(error) <= MAX_CACHED_REASON_CHARS:
                self.grammar_checks[constraint.key] = error
            while len(self.grammar_checks) > MAX_CACHED_GRAMMAR_CHECKS:
                self.grammar_checks.popitem(last=False)
        else:
            self.grammar_checks.move_to_end(constraint.key)
        if error:
            raise ApiError(400, f"{param}: the grammar library cannot enforce it: {error}", param=param)

    # --- tokenization and routing ----------------------------------------------------------------
    async def route_chat(self, model: str, messages: list[dict[str, Any]], tools: list[Tool] | None = None,
                         template_kwargs: dict[str, Any] | None = None, calls: bool = True) -> tuple[Pool, list[int]]:
        """Render each candidate pool's chat template (with the tools offered, `calls` False for tool_choice
        "none", and the request's `chat_template_kwargs` over the pool's; `add_generation_prompt` and
        `continue_final_message` among them are the renderer's flags, as `gateway.openai.chat` sets them),
        count exactly, take the first pool that admits it. Tokenized inline only when every string the template
        may write (contents, reasoning, tool calls' arguments, the tools, the variables) is short."""
        kwargs = template_kwargs or {}
        size = MESSAGE_OVERHEAD_CHARS * (len(messages) + len(tools or ())) + num_chars(
            [messages, [t.as_template_dict() for t in tools or ()], kwargs], INLINE_TOKENIZE_CHARS)

        def variables(pool: Pool) -> dict[str, Any]:
            return {**(pool.spec.chat_template_kwargs or {}), **kwargs}

        def rendering(pool: Pool) -> tuple[int, str]:   # pools of one tokenizer render alike with the same variables
            return id(pool.counter), json.dumps(variables(pool), sort_keys=True, default=repr)

        return await self._route(model, "messages", size, self._timed(
            lambda pool: _render_and_count(pool, messages, tools, variables(pool), calls)), rendering)

    async def route_prompts(self, model: str, prompts: list[str | list[int]]) -> list[tuple[Pool, list[int]]]:
        """Each prompt of a completion routed (`route_prompt`); errors name `prompt[i]` where there are several."""
        return [await self.route_prompt(model, p, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
                for i, p in enumerate(prompts)]

    async def route_prompt(self, model: str, prompt: str | list[int], param: str = "prompt",
                           around: bool = True) -> tuple[Pool, list[int]]:
        """Count a completion prompt (text between what the tokenizer adds around it, `around` False: the text's
        own ids alone; or token ids, each in the pool's vocabulary as vLLM checks them) and route it; errors name
        `param`."""
        if isinstance(prompt, list):   # a long one is checked off the event loop too (a few MB of ids: seconds)
            return await self._route(model, param, len(prompt), lambda pool: _known_ids(pool, prompt, param))
        return await self._route(model, param, len(prompt), self._timed(
            lambda pool: pool.prompt_ids(prompt) if around else pool.counter.encode(prompt)))

    async def _route(self, model: str, param: str, size: int, tokenize: Callable[[Pool], list[int]],
                     key: Callable[[Pool], Hashable] | None = None) -> tuple[Pool, list[int]]:
        """`Router.route` (`key`: when two pools' ids are the same, by default when they share a
        tokenizer), on the tokenizer thread when the prompt has over INLINE_TOKENIZE_CHARS characters;
        its errors as ApiError (`param` names the prompt's field; a chat template's error says what the
        template said)."""
        route = functools.partial(self.router.route, model, tokenize, **({"key": key} if key else {}))
        try:
            if size <= INLINE_TOKENIZE_CHARS:
                return route()
            return await asyncio.get_running_loop().run_in_executor(self.executor, route)
        except UnknownModelError as exc:
            raise model_not_found(exc) from None
        except NoRouteError as exc:
            raise ApiError(400, f"{param}: {exc}", param=param, code="context_length_exceeded") from None
        except ValueError as exc:  # bad messages or a template error, named by the tokenizer
            if str(exc).startswith("chat template"):   # the template's error on this request (or there is none)
                raise ApiError(400, f"{param}: {exc}", param=param) from None
            raise named_error(renamed_field(str(exc), {"prompt": param})) from None   # `prompt[i]` of several
        except TypeError as exc:  # JSON may carry text the tokenizer refuses, e.g. "\ud800"
            raise ApiError(400, f"{param}: the text cannot be tokenized ({exc}); it must be valid "
                           "Unicode (no lone surrogates)", param=param) from None

    def _timed(self, tokenize: Callable[[Pool], list[int]]) -> Callable[[Pool], list[int]]:
        """`tokenize`, observed in the `tokenizer_seconds` histogram by the pool's counting backend."""
        def timed(pool: Pool) -> list[int]:
            started = time.perf_counter()
            ids = tokenize(pool)
            self.metrics.tokenizer_seconds(pool.counter.backend).observe(time.perf_counter() - started)
            return ids
        return timed


GATEWAY = web.AppKey("gateway", Gateway)


def device_wait_limit(config: CliffguardConfig, pools: Iterable[Pool]) -> float:
    """How long a client's request waits for its devices: `gateway.device_wait_seconds`, or the least
    `max_queue_seconds` (not 0: refused at once instead; not None: no limit) of its pools when smaller."""
    return min([config.gateway.device_wait_seconds, *(p.spec.max_queue_seconds for p in pools
                                                      if p.spec.max_queue_seconds)])


def model_not_found(exc: UnknownModelError) -> ApiError:
    """404 `model_not_found` naming the model and those served."""
    return ApiError(404, str(exc), param="model", code="model_not_found")


def _grammar_error(constraint: StructuredOutput) -> str:
    try:
        structured.check(constraint)
    except ValueError as exc:
        return str(exc) or "invalid"
    return ""


def _render_and_count(pool: Pool, messages: list[dict[str, Any]], tools: list[Tool] | None,
                      template_kwargs: dict[str, Any], calls: bool = True) -> list[int]:
    """The ids of the chat prompt a pool renders; `template_kwargs` holds the renderer's flags too."""
    variables = dict(template_kwargs)
    flags = {"add_generation_prompt": variables.pop("add_generation_prompt", True),
             "continue_final_message": variables.pop("continue_final_message", False)}
    return prompt_ids(pool.tokenizer, pool.counter, messages, tools, variables, flags, calls)


def num_chars(value: Any, limit: int) -> int:
    """The characters of every string in `value` (JSON: keys and values, at any depth; 8 for another
    scalar, 2 for a container: a schema of empty ones, `{"anyOf": [{}, {}, ...]}`, counted nothing and was
    compiled on the event loop), counted until past `limit`: a bound on what a template writes of it, in time
    that does not grow with a long string."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, (dict, list, tuple)):
            total += 2
            stack.extend([*item, *item.values()] if isinstance(item, dict) else item)   # a dict: its keys, values
        else:
            total += 8
    return total


def _check_placements(config: CliffguardConfig) -> None:
    """A device placed on Ray needs Ray installed and a cluster address (SpecError naming the key)."""
    from pools.config.spec import SpecError

    for name, device in config.devices.items():
        if device.placement != "ray" or not any(p.device == name for p in config.local_pools):
            continue
        try:
            import ray  # noqa: F401 - only a device placed on Ray pays for importing it
        except ImportError:
            raise SpecError(f"devices.{name}.placement: ray, and Ray is not installed: pip install -e '.[ray]'") \
                from None
        device.resolved_ray_address(os.environ)


def _known_ids(pool: Pool, ids: list[int], param: str) -> list[int]:
    """A token-id prompt's ids, each in `pool`'s vocabulary; else a ValueError naming the id's path."""
    size = pool.vocab_size or pool.tokenizer.vocab_size
    if ids and max(ids) >= size:   # then the first one past it, for its path
        j = next(j for j, token in enumerate(ids) if token >= size)
        raise ValueError(f"{param}[{j}]: token id {ids[j]} is not in the vocabulary (0..{size - 1})")
    return list(ids)
