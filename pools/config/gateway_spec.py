"""The `gateway` section of the YAML: where the gateway listens, who may call it, what one request may ask,
and how long it waits on clients and workers (`GatewaySpec`, `RequestLimits`, `Backoff`).

Frozen dataclasses validated on construction, like the rest of the schema (`pools.config.spec`); errors are
`SpecError`s naming the key. `pools.config.yaml_file` reads them from YAML.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from pools.config.checks import SpecError, check_int, check_str, is_number, show

DEFAULT_API_KEYS_ENV = "CLIFFGUARD_API_KEYS"


@dataclass(frozen=True)
class Backoff:
    """The wait before each restart of a dead device worker (YAML `gateway.restart_backoff`):
    `initial_seconds`, times `factor` after each restart that did not stay up `reset_after_seconds`,
    at most `max_seconds`."""

    initial_seconds: float = 1.0
    factor: float = 2.0
    max_seconds: float = 30.0
    reset_after_seconds: float = 60.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not is_number(value) or not math.isfinite(value):
                raise SpecError(f"restart_backoff.{f.name}: must be a finite number, got {show(value)}")
        if self.initial_seconds < 0:
            raise SpecError(f"restart_backoff.initial_seconds: must be >= 0, got {self.initial_seconds}")
        if self.factor < 1:
            raise SpecError(f"restart_backoff.factor: must be >= 1, got {self.factor}")
        if self.max_seconds < self.initial_seconds:
            raise SpecError(f"restart_backoff.max_seconds: must be >= initial_seconds ({self.initial_seconds}), "
                            f"got {self.max_seconds}")
        if self.reset_after_seconds < 0:
            raise SpecError(f"restart_backoff.reset_after_seconds: must be >= 0, got {self.reset_after_seconds}")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before restart number `attempt` (0-based) since the last reset."""
        return min(self.initial_seconds * self.factor ** min(attempt, 64), self.max_seconds)


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (YAML `gateway.limits`). The gateway answers a request over a
    limit with a 400 naming the field, before it tokenizes or reserves anything, so no single
    request can occupy the event loop or the engine for everyone else."""

    max_prompts: int = 256        # entries of a completions `prompt` list
    max_choices: int = 1024       # n x prompts: the engine requests one HTTP request may start
    max_messages: int = 2048      # entries of a chat `messages` list

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_int(f"limits.{f.name}", getattr(self, f.name), min_value=1)


@dataclass(frozen=True)
class RetentionSpec:
    """How long the Responses API's stored responses are kept (YAML `gateway.stored_responses`): a
    finished response at most `retention_days` (OpenAI keeps them 30 days), and each owner's newest
    `max_per_owner` only (`pools.store.response_store`)."""

    retention_days: float = 30.0
    max_per_owner: int = 10000

    def __post_init__(self) -> None:
        days = self.retention_days
        if not is_number(days) or not math.isfinite(days) or days <= 0:
            raise SpecError(f"stored_responses.retention_days: must be a number of days > 0, got {show(days)}")
        check_int("stored_responses.max_per_owner", self.max_per_owner, min_value=1)


@dataclass(frozen=True)
class GatewaySpec:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()       # empty: no authentication
    max_body_bytes: int = 8 << 20
    api_keys_env: str | None = DEFAULT_API_KEYS_ENV  # where extra keys came from (already in api_keys)
    restart_backoff: Backoff = field(default_factory=Backoff)   # between restarts of a dead device worker
    write_timeout: float = 30.0          # seconds a client may leave a stream unread before it is aborted
    stall_seconds: float = 10.0          # a worker whose heartbeat stops this long is restarted
    step_timeout_seconds: float = 600.0  # one step longer than this is a hang (the heartbeat still beats)
    device_wait_seconds: float = 30.0    # a request waits this long for a restarting device, then 503
    max_response_buffer_bytes: int = 1 << 20   # unsent bytes of one response before its engine request pauses
    max_buffered_bytes: int = 256 << 20  # unsent bytes of every response together, likewise
    metrics_auth: bool = False           # /metrics and the dashboard need an API key too
    limits: RequestLimits = field(default_factory=RequestLimits)
    stored_responses: RetentionSpec = field(default_factory=RetentionSpec)

    def __post_init__(self) -> None:
        check_str("host", self.host)
        check_int("port", self.port, min_value=1, max_value=65535)
        if not isinstance(self.api_keys, tuple):
            raise SpecError(f"api_keys: must be a tuple of strings, got {show(self.api_keys)}")
        for i, key in enumerate(self.api_keys):
            check_str(f"api_keys[{i}]", key)
        check_int("max_body_bytes", self.max_body_bytes, min_value=1)
        check_str("api_keys_env", self.api_keys_env, optional=True)
        if not isinstance(self.restart_backoff, Backoff):
            raise SpecError(f"restart_backoff: must be a Backoff, got {show(self.restart_backoff)}")
        for key in ("max_response_buffer_bytes", "max_buffered_bytes"):
            check_int(key, getattr(self, key), min_value=1)
        for key in ("write_timeout", "stall_seconds", "step_timeout_seconds", "device_wait_seconds"):
            value = getattr(self, key)
            if not is_number(value) or not math.isfinite(value) or value <= 0:
                raise SpecError(f"{key}: must be a number of seconds > 0, got {show(value)}")
        if not isinstance(self.metrics_auth, bool):
            raise SpecError(f"metrics_auth: must be true or false, got {show(self.metrics_auth)}")
        if not isinstance(self.limits, RequestLimits):
            raise SpecError(f"limits: must be a RequestLimits, got {show(self.limits)}")
        if not isinstance(self.stored_responses, RetentionSpec):
            raise SpecError(f"stored_responses: must be a RetentionSpec, got {show(self.stored_responses)}")
