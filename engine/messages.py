"""The messages between the gateway and a device worker, one frozen dataclass each.

They travel as typed MessagePack frames (`engine.wire`) over the socket of `engine.ipc.Channel`; `engine.worker` (the worker
process) and `engine.client` (the gateway's `AsyncEngineClient`) match on their types.

Gateway -> worker: `AddRequest`, `AbortRequest`, `ReportWaiting` (requests of an interactive pool
waiting at the gateway: the step composer's pressure), `StatsQuery`, `Shutdown`.
Worker -> gateway: `Ready` (once loaded), `StartupError`, `Outputs` (each step's deltas, and now and
then the engine's counters), `Rejected` (a request the engine refused), `StatsReply`, `Fatal`.
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


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class ReportWaiting:
    pool: str
    count: int


@dataclass(frozen=True)
class StatsQuery:
    """Fresh counters, after the allocators' integrity check."""


@dataclass(frozen=True)
class Shutdown:
    pass


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


@dataclass(frozen=True)
class StatsReply:
    stats: EngineStats


@dataclass(frozen=True)
class Fatal:
    traceback: str
