"""The gateway's configuration as read from YAML: devices, pools and the gateway itself.

Each YAML section is a frozen msgspec model (`pools.config.checks.Spec`): its field types and bounds are
the schema, its `check()` the rules across fields, both applied on construction. `CliffguardConfig`, a
frozen dataclass, holds them and checks the rules across pools. `pools.config.yaml_file.load_config`
turns a YAML file into a `CliffguardConfig` or raises `SpecError` naming the key path and the bad value.
A device's settings are `pools.config.device_spec.DeviceSpec`, re-exported here. Nothing that needs the
model (its context length, its KV bytes per token) is checked here: that is `pools.capacity_plan`'s job.
The schema, key by key, is in `config/README.md`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePath
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

import msgspec

import engine.config
from engine.capacity import DEFAULT_BLOCK_SIZE
from engine.config import DEFAULT_MIN_SHARE, LatencySLO, SchedulerConfig
from engine.tokenizer import TEMPLATE_FUNCTIONS   # a chat_template_kwargs key may not replace one
from pools.config.checks import (ByteSize, ByteSizeOrZero, Count, CountOrZero, Fraction, NonNegative, Spec, SpecError,
                                 Text, engine_rules, fmt_bytes, has_control_characters, is_label)
from pools.config.checks import ENV_NAME, padded
from pools.config.checks import parse_bytes as parse_bytes   # re-exported: the CLI reads --vram with it
from pools.config.device_spec import DeviceSpec
from pools.config.gateway_spec import GatewaySpec
from pools.spiral import SpiralConfig
from pools.tenants import TenantSpec

DEFAULT_CPU_MEMORY = 4 << 30   # `memory: auto` on a CPU device: the budget for weights + KV cache
# A request queued longer for KV credits gets 503 + Retry-After: 50 s answers before the 60 s read timeout
# of the proxies most often in front of a gateway (nginx's proxy_read_timeout, an AWS ALB's idle timeout),
# so the client hears "retry later" from us rather than a 504 from the proxy (config/README.md).
DEFAULT_MAX_QUEUE_SECONDS = 50.0
# A pool's CPU swap space (per rank) may not pass this: more memory than any one machine has, so a typo, and the
# worker's swap block list would fill its memory; `pools.capacity_plan` also holds it to this machine's memory.
MAX_SWAP_SPACE_BYTES = 1 << 50   # 1 PiB
MAX_MIN_SHARE = 0.9   # a throughput pool's floor (`min_share`) at most

# Where a pool's service class came from (`PoolSpec.slo_source`; set by the YAML loader, never a YAML key):
# `yaml`: an `slo` mapping; `default`: isolation by default (`default_isolation`); `opted_out`: `slo: null`;
# `absent`: no `slo` key and not defaulted.
SloSource = Literal["yaml", "default", "opted_out", "absent"]
_SLO_SOURCES_WITH_SLO = ("yaml", "default")
# The engine's choices, one definition (engine.config, kernels): the YAML accepts exactly what it runs.
BlockSize = Literal[engine.config.BLOCK_SIZES]
PreemptionMode = Literal[engine.config.PREEMPTION_MODES]
VictimPolicy = Literal[engine.config.VICTIM_POLICIES]
# The chat template's variables the gateway sets itself (`Tokenizer.apply_chat_template`'s own arguments, the
# last two from a chat request's fields of those names): neither a pool's `chat_template_kwargs` nor a request's
# may set them (gateway.openai.chat checks the request's).
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message")
# Switches the templates test with `is true` / `is false` (Qwen3's `enable_thinking`, DeepSeek's `thinking`): a
# string there is neither and leaves the switch as it was, so a pool's or a request's must be a boolean.
BOOLEAN_TEMPLATE_VARIABLES = ("enable_thinking", "thinking")


def _shown_url(url: str) -> str:
    """An upstream URL as a config error shows it (errors go to logs): no user or password, and its query and
    fragment by their length only (a key may ride in either)."""
    url = re.sub(r"//[^/?#]*@", "//", url)
    return re.sub(r"([?#])(.*)$", lambda m: f"{m[1]}<{len(m[2])} characters>", url, flags=re.DOTALL)


def template_variable_error(key: str, value: Any) -> str | None:
    """Why `chat_template_kwargs.<key>: value` cannot be taken (None: it can)."""
    if key in RESERVED_TEMPLATE_VARIABLES:
        return (f"is set by the gateway from each request (a chat request's field of that name, where it has one); "
                f"chat_template_kwargs may not set {', '.join(RESERVED_TEMPLATE_VARIABLES)}")
    if key in TEMPLATE_FUNCTIONS:
        return ("is a function the chat template calls; chat_template_kwargs may not set "
                f"{', '.join(TEMPLATE_FUNCTIONS)}")
    if key in BOOLEAN_TEMPLATE_VARIABLES and value is not None and not isinstance(value, bool):
        return f"must be true or false (or null: the template's default), got {value!r}"
    return None


class RouteSpec(Spec):
    """Prompts of `min_prompt_tokens..max_prompt_tokens` tokens (inclusive) go to the pool.

    `max_prompt_tokens=None` means up to the pool's max_model_len - 1.
    """

    min_prompt_tokens: CountOrZero = 0
    max_prompt_tokens: CountOrZero | None = None

    def check(self) -> None:
        if self.max_prompt_tokens is not None and self.min_prompt_tokens > self.max_prompt_tokens:
            raise SpecError("min_prompt_tokens", f"{self.min_prompt_tokens} is above max_prompt_tokens "
                                                 f"{self.max_prompt_tokens}; no prompt can reach this pool")

    def upper(self, max_model_len: int | None = None) -> int | None:
        """The largest admitted prompt: max_prompt_tokens, capped at max_model_len - 1 (room for one
        generated token); None when neither limit is known."""
        limits = [n for n in (self.max_prompt_tokens, None if max_model_len is None else max_model_len - 1)
                  if n is not None]
        return min(limits) if limits else None

    def admits(self, n: int, max_model_len: int | None = None) -> bool:
        """Whether a prompt of `n` tokens goes to this pool (`max_model_len`: the pool's context)."""
        upper = self.upper(max_model_len)
        return self.min_prompt_tokens <= n and (upper is None or n <= upper)

    def overlaps(self, other: RouteSpec, max_model_len: int | None = None,
                 other_max_model_len: int | None = None) -> bool:
        """Some prompt length is in both ranges, each capped by its pool's max_model_len where known (`upper`;
        an open upper end counts as unbounded)."""
        inf = float("inf")
        self_max, other_max = self.upper(max_model_len), other.upper(other_max_model_len)
        self_max, other_max = inf if self_max is None else self_max, inf if other_max is None else other_max
        return self.min_prompt_tokens <= other_max and other.min_prompt_tokens <= self_max

    def describe(self, max_model_len: int | None = None) -> str:
        """`0..4096`, `4097..` (open end); with the pool's max_model_len, its cap (`0..4095`)."""
        upper = self.upper(max_model_len)
        return f"{self.min_prompt_tokens}..{'' if upper is None else upper}"


class SloSpec(Spec):
    """YAML `slo: {ttft_ms, itl_ms}`, read into the engine's `LatencySLO` (which bounds the values)."""

    ttft_ms: float = LatencySLO.ttft_ms
    itl_ms: float = LatencySLO.itl_ms


class PoolSpec(Spec):
    """One pool: a route rule and either a block range on a local device or an upstream URL.

    Local pools set exactly one of `kv_share` / `kv_cache_bytes`. The YAML keys only one kind of pool
    takes are `LOCAL_KEYS` and `UPSTREAM_KEYS` (the loader refuses them on the other kind).
    """

    NOT_IN_YAML = ("slo_source",)
    UPSTREAM_KEYS: ClassVar[tuple[str, ...]] = ("upstream", "upstream_api_key_env", "tokenizer")
    LOCAL_KEYS: ClassVar[tuple[str, ...]] = (
        "device", "kv_share", "kv_cache_bytes", "avg_len", "block_size", "max_num_batched_tokens", "max_num_seqs",
        "long_prefill_token_threshold",
        "preemption_mode", "victim_policy", "swap_space", "enable_prefix_caching", "state_snapshots",
        "share_prefix_cache", "slo", "max_queue_seconds", "min_share", "death_spiral", "chat_template_kwargs", "generation_config")

    name: Text
    model: Text                          # builtin:..., an HF folder, a .gguf file; upstream: its model name
    route: RouteSpec = msgspec.field(default_factory=RouteSpec)
    device: Text = "default"             # a DeviceSpec name (local pools)
    upstream: Text | None = None         # base URL of an OpenAI-compatible server, e.g. http://h:8000/v1
    upstream_api_key_env: Text | None = None  # environment variable holding the upstream's API key
    tokenizer: Text | None = None        # model spec whose tokenizer counts tokens (default: `model`)
    chat_template: Text | None = None    # a Jinja file rendering its chats, in place of the model folder's
    served_model_name: Text | None = None  # the `model` clients send (default: derived from `model`)
    kv_share: Fraction | None = None     # fraction of the device's KV bytes ...
    kv_cache_bytes: ByteSize | None = None   # ... or an explicit byte budget (exactly one for local pools)
    avg_len: Count = 1024                # tokens (prompt + output) of a typical request, for max_num_seqs
    block_size: BlockSize = DEFAULT_BLOCK_SIZE
    max_model_len: Count | None = None   # None: the model's context length
    max_num_batched_tokens: Count = 2048   # this pool's token budget per step
    long_prefill_token_threshold: CountOrZero = 0   # one sequence's most prompt tokens a step (0: the budget)
    max_num_seqs: Count | None = None    # None: from the capacity formula
    preemption_mode: PreemptionMode = "recompute"
    victim_policy: VictimPolicy = "reverse_fifo"
    swap_space_bytes: ByteSizeOrZero = msgspec.field(default=0, name="swap_space")
    enable_prefix_caching: bool = True
    state_snapshots: CountOrZero | None = None   # a state model's kept prefix states; None: one a sequence; 0: none
    share_prefix_cache: bool = False     # tenants reuse each other's cached prompt blocks (else one partition each)
    slo: LatencySLO | None = None        # interactive pool: latency targets; None: throughput pool
    slo_source: SloSource | None = None  # where `slo` came from; None: built in code, not from YAML
    max_queue_seconds: NonNegative | None = DEFAULT_MAX_QUEUE_SECONDS   # queued longer: 503; None: waits; 0: 429
    # throughput pool: its floor (None: 0.2); at most 0.9: the derived SLO of the device's interactive pools
    # grows as 1 / (1 - min_share) (0.9999 asked for a TTFT past an hour, and the device failed to start)
    min_share: Annotated[float, msgspec.Meta(ge=0, le=MAX_MIN_SHARE)] | None = None
    death_spiral: SpiralConfig = msgspec.field(default_factory=SpiralConfig)   # the detector's thresholds
    chat_template_kwargs: dict[str, Any] | None = None   # template variables; a request's own win, key by key
    generation_config: Literal["auto", "none"] = "auto"   # auto: unset sampling fields take the model's advice

    def check(self) -> None:
        if not is_label(self.name):   # metric labels, URLs and the x-cliffguard-pool header
            raise SpecError("name", f"use letters, digits, '_', '.', '-' (starting with a letter or digit); "
                                    f"got {self.name!r}")
        self._check_names_and_route()
        for key in ("model", "upstream", "tokenizer", "chat_template"):   # a path or URL: a space at an end is a typo
            if (value := getattr(self, key)) is not None and padded(value):
                shown = _shown_url(value) if key == "upstream" else value
                raise SpecError(key, f"must not be blank or begin or end with a space, got {shown!r}")
        for key, value in (self.chat_template_kwargs or {}).items():
            if (reason := template_variable_error(key, value)) is not None:
                raise SpecError(f"chat_template_kwargs.{key}", reason)
        if self.is_upstream:
            try:
                url = urlsplit(self.upstream)
                url.port   # noqa: B018 - raises for a port out of range or not a number
            except ValueError as exc:
                raise SpecError("upstream", f"not a valid URL ({exc}), got {_shown_url(self.upstream)!r}") from None
            if url.scheme not in ("http", "https") or not url.hostname:
                raise SpecError("upstream", f"must be an http:// or https:// URL with a host, got "
                                            f"{_shown_url(self.upstream)!r}")
            if "?" in self.upstream or "#" in self.upstream:   # the request's path is added at the URL's end
                raise SpecError("upstream", f"must have no query (?) or fragment (#): the request's path "
                                            f"(/chat/completions) is added after it; got {_shown_url(self.upstream)!r}")
            if self.upstream_api_key_env is not None and not ENV_NAME.fullmatch(self.upstream_api_key_env):
                raise SpecError("upstream_api_key_env", "the name of an environment variable (letters, digits and "
                                f"'_', not starting with a digit), got a string of {len(self.upstream_api_key_env)} "
                                "characters: a key written here would be in the file; set a variable to it, name that")
            return
        if self.kv_share is not None and self.kv_cache_bytes is not None:
            raise SpecError("kv_share", f"set kv_share or kv_cache_bytes, not both (got kv_share {self.kv_share} "
                                        f"and kv_cache_bytes {self.kv_cache_bytes})")
        if self.kv_share is None and self.kv_cache_bytes is None:
            raise SpecError("kv_share", "a local pool needs kv_share (a fraction of its device's KV bytes) or "
                                        "kv_cache_bytes; got neither")
        if self.swap_space_bytes > MAX_SWAP_SPACE_BYTES:
            raise SpecError("swap_space", f"must be at most {MAX_SWAP_SPACE_BYTES} bytes (1 PiB, more than one "
                                          f"machine's memory), got {self.swap_space_bytes}")
        with engine_rules({"swap_space_bytes": "swap_space"}):   # the engine's rules: swap needs swap_space
            self.scheduler_config(self.max_num_seqs or 1, self.max_model_len or 0)
        if self.slo_source is not None and (self.slo is not None) != (self.slo_source in _SLO_SOURCES_WITH_SLO):
            raise SpecError("slo_source", f"{self.slo_source!r} needs "
                                          f"{'an slo' if self.slo is None else 'slo None'}, got slo {self.slo!r}")
        if self.min_share is not None and self.slo is not None:
            why = (" (isolation by default made it interactive; `slo: null` keeps it a throughput pool)"
                   if self.slo_source == "default" else "")
            raise SpecError("min_share", f"only for throughput pools; this pool has an slo{why}, "
                                         f"got min_share {self.min_share}")

    def _check_names_and_route(self) -> None:
        """The name clients send, and a route some prompt can take where max_model_len is known here (the
        capacity plan checks it again against the model's context)."""
        if self.served_model_name is not None and (not self.served_model_name.strip()
                                                   or has_control_characters(self.served_model_name)):
            raise SpecError("served_model_name", f"the model name clients send: not blank and no control "
                                                 f"characters (a newline, a tab), got {self.served_model_name!r}")
        if self.max_model_len is not None and self.route.min_prompt_tokens >= self.max_model_len:
            raise SpecError("route.min_prompt_tokens", f"{self.route.min_prompt_tokens} must be below max_model_len "
                                                       f"{self.max_model_len}; no prompt can reach this pool")
        top = self.route.max_prompt_tokens   # a local pool's: the capacity plan's, against the model's context too
        if self.is_upstream and self.max_model_len is not None and top is not None and top >= self.max_model_len:
            raise SpecError("route.max_prompt_tokens", f"{top} must be below max_model_len {self.max_model_len}: a "
                                                       f"prompt needs room for one generated token, so the route's "
                                                       f"tail is unreachable")

    def scheduler_config(self, max_num_seqs: int, max_model_len: int) -> SchedulerConfig:
        """The engine's limits for this pool, given the two numbers the capacity plan derives."""
        return SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            long_prefill_token_threshold=self.long_prefill_token_threshold, max_model_len=max_model_len,
            preemption_mode=self.preemption_mode, victim_policy=self.victim_policy,
            swap_space_bytes=self.swap_space_bytes, enable_prefix_caching=self.enable_prefix_caching,
            state_snapshots=self.state_snapshots)

    @property
    def is_upstream(self) -> bool:
        return self.upstream is not None

    @property
    def uses_swap(self) -> bool:
        """A local pool whose victims may be swapped to its CPU swap space (preemption_mode swap or auto)."""
        return not self.is_upstream and self.preemption_mode in ("swap", "auto")

    @property
    def engine_min_share(self) -> float:
        """The engine's `PoolConfig.min_share`: the YAML's, or `DEFAULT_MIN_SHARE` for a throughput pool
        (an interactive pool has none: it is the pool the others yield to)."""
        if self.slo is not None:
            return 0.0
        return DEFAULT_MIN_SHARE if self.min_share is None else float(self.min_share)

    @property
    def service_class(self) -> str:
        """`interactive` (an SLO: the step composer protects its latency) or `throughput`."""
        return "interactive" if self.slo is not None else "throughput"

    def describe_service_class(self) -> str:
        """`interactive (slo ttft 800 ms, itl 60 ms)`, `interactive (slo from the device's measured step at start;
        default: no slo in the YAML)`, `throughput`, `throughput (slo: null)`: the class, its targets and,
        where the YAML did not state it, why (the device worker derives that SLO when it starts:
        engine.calibration.derive_slo, logged by the gateway)."""
        if self.slo is None:
            return "throughput (slo: null)" if self.slo_source == "opted_out" else "throughput"
        if self.slo_source == "default":
            return "interactive (slo from the device's measured step at start; default: no slo in the YAML)"
        return f"interactive (slo ttft {self.slo.ttft_ms:g} ms, itl {self.slo.itl_ms:g} ms)"

    @property
    def model_name(self) -> str:
        """The `model` clients send: served_model_name, else derived from `model` (`builtin:` stripped;
        for a path its last component without `.gguf`; an upstream's model as is)."""
        if self.served_model_name:
            return self.served_model_name
        if self.is_upstream:
            return self.model
        if self.model.startswith("builtin:"):
            return self.model.removeprefix("builtin:")
        name = PurePath(self.model.rstrip("/\\")).name or self.model
        return name[:-len(".gguf")] if name.lower().endswith(".gguf") else name


@dataclass(frozen=True)
class CliffguardConfig:
    """The whole file. Pool-to-pool rules are checked here; errors name pools by index and name."""

    gateway: GatewaySpec
    devices: dict[str, DeviceSpec]
    pools: tuple[PoolSpec, ...]
    tenants: dict[str, TenantSpec] = field(default_factory=dict)   # pools.tenants: names, keys, shares

    def __post_init__(self) -> None:
        if not self.pools:
            raise SpecError("pools: at least one pool is required, got none")
        for name, device in self.devices.items():
            if device.name != name:
                raise SpecError(f"devices.{name}: the DeviceSpec is named {device.name!r}")
        first_by_name: dict[str, int] = {}
        for i, pool in enumerate(self.pools):
            if pool.name in first_by_name:
                raise SpecError(f"pools[{i}].name: duplicate pool name {pool.name!r} "
                                f"(also pools[{first_by_name[pool.name]}])")
            first_by_name[pool.name] = i
            if not pool.is_upstream and pool.device not in self.devices:
                raise SpecError(f"pools[{i}].device: unknown device {pool.device!r}; declared devices: "
                                f"{', '.join(self.devices) or 'none'}")
        for name in self.devices:
            self._check_device_pools(name)
        self._check_gpu_claims()
        self._check_routes()

    def _check_gpu_claims(self) -> None:
        """No GPU serves two devices (or two ranks): each rank allocates its KV cache from 0.9 of its GPU."""
        owner: dict[int, str] = {}
        for name, device in self.devices.items():
            if not any(p.device == name and not p.is_upstream for p in self.pools):
                continue   # declared but unused: it starts nothing
            for gpu in device.claimed_gpus:
                if gpu in owner:
                    raise SpecError(f"devices.{name}: GPU {gpu} is also device {owner[gpu]!r}'s; a GPU runs one "
                                    "device (give this one other GPUs with `gpus`, or other `device: cuda:N`)")
                owner[gpu] = name

    def _check_device_pools(self, device: str) -> None:
        members = [(i, p) for i, p in enumerate(self.pools) if not p.is_upstream and p.device == device]
        if not members:
            return
        i0, p0 = members[0]
        for i, pool in members[1:]:
            for key in ("model", "block_size"):
                if getattr(pool, key) != getattr(p0, key):
                    raise SpecError(
                        f"pools[{i}].{key}: {getattr(pool, key)!r} differs from pools[{i0}] {p0.name!r} "
                        f"({getattr(p0, key)!r}) on device {device!r}; pools on one device share one copy of "
                        f"the weights and one KV tensor: give this pool its own device")
        total = 0.0
        for i, pool in members:
            if pool.kv_share is None:
                continue
            total += pool.kv_share
            if total > 1 + 1e-9:
                shares = " + ".join(f"{p.name} {p.kv_share}" for _, p in members if p.kv_share is not None)
                raise SpecError(f"pools[{i}].kv_share: the shares of device {device!r} sum to "
                                f"{round(total, 6)} > 1 ({shares})")

    def _check_routes(self) -> None:
        for j, b in enumerate(self.pools):
            for i, a in enumerate(self.pools[:j]):
                if a.model_name == b.model_name and a.route.overlaps(b.route, a.max_model_len, b.max_model_len):
                    raise SpecError(
                        f"pools[{j}].route: {b.route.describe(b.max_model_len)} overlaps pools[{i}] {a.name!r} "
                        f"route {a.route.describe(a.max_model_len)}; both serve model {a.model_name!r} ({b.name!r} "
                        f"and {a.name!r}), so a prompt length must pick exactly one")

    def check_upstream_keys(self, env: Mapping[str, str]) -> None:
        """`serve`'s check: each upstream pool's `upstream_api_key_env` is set and not blank in `env` (unset, every
        request would go without the key the upstream asks for, and be answered 502: a process never gains the
        variable later), unless its URL holds credentials (sent without a key). Not at load: `capacity` and
        `simulate` need no secret."""
        for i, pool in enumerate(self.pools):
            name = pool.upstream_api_key_env
            if name is not None and not env.get(name, "").strip() and urlsplit(pool.upstream).username is None:
                raise SpecError(f"pools[{i}].upstream_api_key_env: the variable {name} is not set (or blank): pool "
                                f"{pool.name!r} would send its upstream no key; set it, or leave the key out")

    @property
    def local_pools(self) -> tuple[PoolSpec, ...]:
        return tuple(p for p in self.pools if not p.is_upstream)

    @property
    def runs_workers_here(self) -> bool:
        """Some pool runs on a device whose workers are processes of this machine (placement local)."""
        return any(self.devices[p.device].placement == "local" for p in self.local_pools)

    def host_swaps(self) -> list[tuple[int, PoolSpec, int]]:
        """(index, pool, ranks) of each pool whose swap_space this machine holds: a swapping pool of a local
        device, once on each of its ranks (replicas x tensor_parallel_size; a Ray device's run elsewhere)."""
        return [(i, pool, device.replicas * device.tensor_parallel_size) for i, pool in enumerate(self.pools)
                if pool.uses_swap and (device := self.devices[pool.device]).placement != "ray"]

    def swap_past_memory(self, host_bytes: int | None) -> str | None:
        """Why the CPU swap spaces of the devices one machine runs cannot fit its memory (`host_bytes`; None:
        unknown), naming the first `pools[i].swap_space` past it; None when they fit. Each rank of each
        replica of a local device holds its swapping pools' swap_space in that machine's memory (a Ray
        device's replicas run on the cluster's nodes: not counted)."""
        if host_bytes is None:
            return None
        total = 0
        for i, pool, ranks in self.host_swaps():
            total += ranks * pool.swap_space_bytes
            if total > host_bytes:
                return (f"pools[{i}].swap_space: {fmt_bytes(pool.swap_space_bytes)} for each of the {ranks} ranks "
                        f"of device {pool.device!r} (replicas x tensor_parallel_size) brings the swap spaces of this "
                        f"machine's devices to {fmt_bytes(total)}, past its {fmt_bytes(host_bytes)} of memory")
        return None

    def describe_service_classes(self) -> list[str]:
        """One line per device with local pools, what `cliffguard serve` logs at start: `device default:
        chat interactive (slo from the device's measured step at start; default: no slo in the YAML), rag throughput, min_share
        0.2` (`device default (2 replicas, tensor parallel 4): ...` for a replicated, tensor-parallel one,
        `(1..8 replicas, autoscaled, on Ray)` for an autoscaled one on a Ray cluster).
        A device whose pools are all throughput pools says that nothing protects any pool's latency."""
        lines = []
        for device in self.devices:
            members = [p for p in self.local_pools if p.device == device]
            if not members:
                continue
            spec = self.devices[device]
            shape = ", ".join(part for part in (
                f"{spec.min_replicas}..{spec.replicas} replicas, autoscaled" if spec.autoscaled
                else f"{spec.replicas} replicas" if spec.replicas > 1 else "",
                f"tensor parallel {spec.tensor_parallel_size}" if spec.tensor_parallel_size > 1 else "",
                "on Ray" if spec.placement == "ray" else "") if part)
            guarded = any(p.slo is not None for p in members)   # throughput pools keep min_share beside it

            def describe(p: PoolSpec) -> str:
                share = f", min_share {p.engine_min_share:g}" if guarded and p.slo is None else ""
                return f"{p.name} {p.describe_service_class()}{share}"

            line = f"device {device}{f' ({shape})' if shape else ''}: " + ", ".join(describe(p) for p in members)
            if len(members) > 1 and all(p.slo is None for p in members):
                line += " (no interactive pool: no compute isolation between them; see `slo` in config/README.md)"
            lines.append(line)
        return lines

    def pool(self, name: str) -> PoolSpec:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(f"pools: no pool named {name!r}; pools: {', '.join(p.name for p in self.pools)}")
