"""The messages between the gateway and a device worker, one frozen dataclass each.

They travel as typed MessagePack frames (`engine.wire`) over the socket of `engine.ipc.Channel`; `engine.worker` (the worker
process) and `engine.client` (the gateway's `AsyncEngineClient`) match on their types.

Gateway -> worker: `AddRequest`, `AbortRequest`, `PauseRequest` (a response whose client reads too slowly: its
sequences keep their blocks but are not stepped until resumed), `ReportWaiting` (requests of a pool waiting at
the gateway: the step composer's pressure, and a shared replica's lease demand), `StatsQuery`, `Shutdown`,
`Keepalive` (over a network only: the gateway is there; `engine.remote`), `LeaseAck`.
Worker -> gateway: `Ready` (once loaded), `StartupError`, `Outputs` (each step's deltas, and now and
then the engine's counters), `Rejected` (a request the engine refused, or whose handling failed),
`StatsReply`, `Heartbeat` (the worker is alive, from a thread of its own), `Fatal`, `Lease` (a replica
served over a network: this gateway's share of a pool's KV credits, `engine.sessions`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.outputs import RequestDelta
from engine.sampling import SamplingParams
from engine.stats import EngineStats, WorkerInfo


# --- gateway -> worker ------------------------------------------------------------------------------

@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0
    pool: str | None = None
    cache_salt: str | None = None     # the prefix-cache partition (`LLMEngine.add_request`)
    credits: int = 0                  # KV credits the gateway holds for it (a replica counts them: `engine.sessions`)
    background: bool = False          # a batch line's: queued after the others (a shared replica counts its credits
    # as batch demand)


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class PauseRequest:
    """`paused` True: stop stepping the request (its blocks stay); False: step it again."""
    request_id: str
    paused: bool


@dataclass(frozen=True)
class ReportWaiting:
    """The pool's queue at the gateway: `count` interactive requests waiting (the step composer's
    pressure); for a replica shared by several gateways (`engine.sessions`) also its demand on the
    replica's credits: `queued`, what its waiting interactive requests ask for, `queued_batch`, what its
    waiting batch lines ask for, and the request first in line, `head` credits on this replica after
    `head_waited` seconds of waiting (0 and 0.0: none waits), `head_background` if it is a batch line."""
    pool: str
    count: int
    queued: int = 0
    queued_batch: int = 0
    head: int = 0
    head_waited: float = 0.0
    head_background: bool = False


@dataclass(frozen=True)
class StatsQuery:
    """Fresh counters; `check`: after the allocators' integrity check (tests: it walks every block, and a
    failure ends the worker)."""

    check: bool = False


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class LeaseAck:
    """The gateway honours a `Lease`: it admits within `tokens` on `pool` from now on, and what it holds
    there is within it (`engine.sessions`)."""
    pool: str
    tokens: int
    epoch: int


@dataclass(frozen=True)
class Keepalive:
    """The gateway is still there: sent every `engine.remote.KEEPALIVE_SECONDS` on a network connection; a
    replica drops a connection that has carried nothing for `engine.remote.SILENCE_SECONDS`. Never reaches
    the worker loop (`engine.remote.ReplicaChannel` consumes it)."""


# --- worker -> gateway ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ready:
    info: WorkerInfo


@dataclass(frozen=True)
class StartupError:
    reason: str


@dataclass(frozen=True)
class Outputs:
    deltas: list[RequestDelta]
    stats: EngineStats | None = None


@dataclass(frozen=True)
class Rejected:
    request_id: str
    reason: str
    server_error: bool = False   # the request's handling failed in the worker (500), not its input (400)


@dataclass(frozen=True)
class Lease:
    """The KV credits of `pool` this gateway may hold on the replica from now on (`engine.sessions`):
    a share that shrinks counts once the gateway acknowledges it (`LeaseAck`); `epoch` numbers them."""
    pool: str
    tokens: int
    epoch: int


@dataclass(frozen=True)
class Heartbeat:
    """Sent every `interval` seconds by a thread beside the step loop; `step_seconds`: how long the loop
    has been inside its current step (0 between steps)."""
    step_seconds: float = 0.0


@dataclass(frozen=True)
class StatsReply:
    stats: EngineStats


@dataclass(frozen=True)
class Fatal:
    """The worker ends: a step failed (`traceback`), or its tensor-parallel group lost a rank
    (`group_broke`: the process's loss, not the requests' doing), or it could not read a command
    (`unreadable`: the gateway's doing, nobody else's)."""

    traceback: str
    group_broke: bool = False
    unreadable: bool = False
