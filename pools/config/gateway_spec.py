"""The `gateway` section of the YAML: where the gateway listens, who may call it, what one request may ask,
and how long it waits on clients and workers (`GatewaySpec`, `RequestLimits`, `RetentionSpec`, `Backoff`).

Frozen msgspec models (`pools.config.checks.Spec`), like the rest of the schema (`pools.config.spec`): the
field types are the schema, `check()` the rules across fields; errors are `SpecError`s naming the key.
`pools.config.yaml_file` reads them from YAML.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

from engine.worker import HEARTBEAT_INTERVAL
from pools.config.checks import (ENV_NAME, ByteSize, Count, NonNegative, Positive, Seconds, Spec, SpecError, Text,
                                  padded)

DEFAULT_API_KEYS_ENV = "CLIFFGUARD_API_KEYS"
MAX_BACKOFF_FACTOR = 100.0   # `restart_backoff.factor`: the third wait 10,000 times the first; more is a typo
_MAX_LOG_GROWTH = 700.0      # `Backoff.delay`: e ** 700 is a float (e ** 710 overflows)
# The watchdog hears a device worker through its heartbeat, one every HEARTBEAT_INTERVAL seconds, and sees how
# long its step runs only from those beats: a timeout of fewer than four beats takes one late beat (a loaded
# host, the gateway's loop busy a moment) for a dead or hung worker, and kills a healthy one.
MIN_WATCHDOG_SECONDS = 4 * HEARTBEAT_INTERVAL
# `write_timeout`: a client that reads may still pause this long (a round trip across the world, a busy
# machine); a shorter timeout cuts off clients that read, whenever their socket buffer is full.
MIN_WRITE_TIMEOUT = 0.5
MIN_RESTART_SECONDS = 0.1   # restarts after the first with `initial_seconds: 0` wait this long at least


class Backoff(Spec):
    """The wait before each restart of a dead device worker (YAML `gateway.restart_backoff`):
    `initial_seconds`, times `factor` after each restart that did not stay up `reset_after_seconds`,
    at most `max_seconds`."""

    initial_seconds: NonNegative = 1.0
    factor: Annotated[float, msgspec.Meta(ge=1, le=MAX_BACKOFF_FACTOR)] = 2.0
    max_seconds: NonNegative = 30.0
    reset_after_seconds: NonNegative = 60.0

    def check(self) -> None:
        if self.max_seconds < self.initial_seconds:
            raise SpecError("max_seconds", f"must be >= initial_seconds ({self.initial_seconds}), "
                                           f"got {self.max_seconds}")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before restart number `attempt` (0-based) since the last reset. Compared in log
        space first: `factor ** attempt` is only taken where it stays below max_seconds / initial_seconds,
        so no factor or attempt overflows (an OverflowError would end the replica's supervisor). With
        `initial_seconds` 0 the first restart is at once, the next ones wait from MIN_RESTART_SECONDS up (not 0
        each: a worker failing at once restarted in a tight loop, flooding the log), `max_seconds` 0 never."""
        if self.initial_seconds == 0:
            return 0.0 if attempt == 0 else self._grown(min(MIN_RESTART_SECONDS, self.max_seconds), attempt - 1)
        return self._grown(self.initial_seconds, attempt)

    def _grown(self, initial: float, attempt: int) -> float:
        if initial == 0:
            return 0.0
        growth = attempt * math.log(self.factor)   # log(factor ** attempt)
        log_delay = math.log(initial) + growth
        if log_delay >= math.log(self.max_seconds):
            return self.max_seconds
        if growth < _MAX_LOG_GROWTH:
            return min(initial * self.factor ** attempt, self.max_seconds)   # exact: 1, 2, 4, ...
        return math.exp(log_delay)   # a tiny initial_seconds: factor ** attempt alone would overflow


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
    `max_per_owner` only (`pools.store.response_store`); and how many background responses an owner may
    have queued or in progress at once (`max_background_per_owner`; one more is a 429)."""

    retention_days: Positive = 30.0
    max_per_owner: Count = 10000
    max_background_per_owner: Count = 256


class BatchLimits(Spec):
    """What the Batch API lets one owner (an API key; a tenant with `share_files`; everyone where no key is
    configured) have at once (YAML `gateway.batches`): at most
    `max_unfinished_per_owner` batches the runner still owes work (in progress, finalizing, cancelling;
    one more is a 429). Each runs up to 16 lines at a time, which wait for KV credits however long:
    this bounds what one key can queue."""

    max_unfinished_per_owner: Count = 100


class UpstreamLimits(Spec):
    """How the gateway reaches `upstream:` pools (YAML `gateway.upstream`): at most `max_connections` to one
    host at once (a request past them waits 10 s for one, then 502 `upstream_unreachable`: size it to the
    upstream's own concurrency, vLLM's `max_num_seqs`), and an answer's head (a non-streamed answer's whole
    generation) or a stream's next bytes awaited at most `read_timeout_seconds`."""

    max_connections: Count = 256
    read_timeout_seconds: Seconds = 600.0


class GatewaySpec(Spec):
    """The `gateway` section. `api_keys`: once loaded, the YAML's keys, those of the `api_keys_env`
    variable and the tenants' keys, merged (`pools.config.yaml_file`)."""

    host: Text = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 8000
    api_keys: tuple[Text, ...] = ()      # empty: no authentication
    allowed_hosts: tuple[Text, ...] = ()   # with no key, Host names answered over loopback beside this machine's
    max_body_bytes: ByteSize = 8 << 20
    api_keys_env: Text | None = DEFAULT_API_KEYS_ENV  # where extra keys came from (already in api_keys)
    restart_backoff: Backoff = msgspec.field(default_factory=Backoff)   # between restarts of a dead worker
    write_timeout: Seconds = 30.0        # seconds a client may leave a stream unread before it is aborted
    stall_seconds: Seconds = 10.0        # a worker whose heartbeat stops this long is restarted
    step_timeout_seconds: Seconds = 600.0  # one step longer than this is a hang (the heartbeat still beats)
    start_timeout_seconds: Seconds = 900.0   # a worker whose model has not loaded by then failed to start
    device_wait_seconds: Seconds = 30.0  # a request waits this long for a restarting device, then 503
    drain_seconds: Seconds = 25.0        # on SIGTERM / Ctrl-C, requests in flight get this long to finish
    max_response_buffer_bytes: ByteSize = 1 << 20   # unsent bytes of one response before its engine request pauses
    max_buffered_bytes: ByteSize = 256 << 20  # unsent bytes of every response together, likewise
    metrics_auth: bool = False           # /metrics needs an API key too (the dashboard's data does with any key)
    take_over: bool = False              # a Ray device's replicas of another config are replaced (else refused)
    limits: RequestLimits = msgspec.field(default_factory=RequestLimits)
    stored_responses: RetentionSpec = msgspec.field(default_factory=RetentionSpec)
    batches: BatchLimits = msgspec.field(default_factory=BatchLimits)
    upstream: UpstreamLimits = msgspec.field(default_factory=UpstreamLimits)

    def check(self) -> None:
        if padded(self.host):
            raise SpecError("host", f"must not be blank or begin or end with a space, got {self.host!r}")
        if self.api_keys_env and not ENV_NAME.fullmatch(self.api_keys_env):   # null or "": no variable read
            raise SpecError("api_keys_env", "the name of an environment variable (letters, digits and '_', not "
                            f"starting with a digit), got a string of {len(self.api_keys_env)} characters: a key "
                            "written here would be in the file (and authentication off); list keys in api_keys")
        for key in ("stall_seconds", "step_timeout_seconds"):
            if getattr(self, key) < MIN_WATCHDOG_SECONDS:
                raise SpecError(key, f"must be at least {MIN_WATCHDOG_SECONDS:g} s (4 heartbeats of the device "
                                     f"worker, one every {HEARTBEAT_INTERVAL:g} s: shorter, one late beat kills a "
                                     f"healthy worker), got {getattr(self, key)}")
        if self.write_timeout < MIN_WRITE_TIMEOUT:
            raise SpecError("write_timeout", f"must be at least {MIN_WRITE_TIMEOUT:g} s (shorter, a client that "
                                             f"reads is cut off whenever its socket buffer fills), "
                                             f"got {self.write_timeout}")
