"""The `gateway` section of the YAML: where the gateway listens, who may call it, what one request may ask,
and how long it waits on clients and workers (`GatewaySpec`, `RequestLimits`, `RetentionSpec`, `Backoff`).

Frozen msgspec models (`pools.config.checks.Spec`), like the rest of the schema (`pools.config.spec`): the
field types are the schema, `check()` the rules across fields; errors are `SpecError`s naming the key.
`pools.config.yaml_file` reads them from YAML.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from pools.config.checks import ByteSize, Count, NonNegative, Positive, Seconds, Spec, SpecError, Text

DEFAULT_API_KEYS_ENV = "CLIFFGUARD_API_KEYS"


class Backoff(Spec):
    """The wait before each restart of a dead device worker (YAML `gateway.restart_backoff`):
    `initial_seconds`, times `factor` after each restart that did not stay up `reset_after_seconds`,
    at most `max_seconds`."""

    initial_seconds: NonNegative = 1.0
    factor: Annotated[float, msgspec.Meta(ge=1)] = 2.0
    max_seconds: NonNegative = 30.0
    reset_after_seconds: NonNegative = 60.0

    def check(self) -> None:
        if self.max_seconds < self.initial_seconds:
            raise SpecError("max_seconds", f"must be >= initial_seconds ({self.initial_seconds}), "
                                           f"got {self.max_seconds}")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before restart number `attempt` (0-based) since the last reset."""
        return min(self.initial_seconds * self.factor ** min(attempt, 64), self.max_seconds)


class RequestLimits(Spec):
    """What one request may ask for (YAML `gateway.limits`). The gateway answers a request over a
    limit with a 400 naming the field, before it tokenizes or reserves anything, so no single
    request can occupy the event loop or the engine for everyone else."""

    max_prompts: Count = 256        # entries of a completions `prompt` list
    max_choices: Count = 1024       # n x prompts: the engine requests one HTTP request may start
    max_messages: Count = 2048      # entries of a chat `messages` list


class RetentionSpec(Spec):
    """How long the Responses API's stored responses are kept (YAML `gateway.stored_responses`): a
    finished response at most `retention_days` (OpenAI keeps them 30 days), and each owner's newest
    `max_per_owner` only (`pools.store.response_store`)."""

    retention_days: Positive = 30.0
    max_per_owner: Count = 10000


class GatewaySpec(Spec):
    """The `gateway` section. `api_keys`: once loaded, the YAML's keys, those of the `api_keys_env`
    variable and the tenants' keys, merged (`pools.config.yaml_file`)."""

    host: Text = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 8000
    api_keys: tuple[Text, ...] = ()      # empty: no authentication
    max_body_bytes: ByteSize = 8 << 20
    api_keys_env: Text | None = DEFAULT_API_KEYS_ENV  # where extra keys came from (already in api_keys)
    restart_backoff: Backoff = msgspec.field(default_factory=Backoff)   # between restarts of a dead worker
    write_timeout: Seconds = 30.0        # seconds a client may leave a stream unread before it is aborted
    stall_seconds: Seconds = 10.0        # a worker whose heartbeat stops this long is restarted
    step_timeout_seconds: Seconds = 600.0  # one step longer than this is a hang (the heartbeat still beats)
    device_wait_seconds: Seconds = 30.0  # a request waits this long for a restarting device, then 503
    max_response_buffer_bytes: ByteSize = 1 << 20   # unsent bytes of one response before its engine request pauses
    max_buffered_bytes: ByteSize = 256 << 20  # unsent bytes of every response together, likewise
    metrics_auth: bool = False           # /metrics and the dashboard need an API key too
    take_over: bool = False              # a Ray device's replicas of another config are replaced (else refused)
    limits: RequestLimits = msgspec.field(default_factory=RequestLimits)
    stored_responses: RetentionSpec = msgspec.field(default_factory=RetentionSpec)
