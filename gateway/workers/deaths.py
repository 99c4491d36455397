"""`DeviceDeaths`: one device's recent replica deaths, each with its cause, and which of them count
against a request that was in flight at them.

A request its device worker died under runs again (`gateway.completion`); one that kills workers
itself must not run for ever, so the deaths that are its own are counted, and two make it a poison
request (500 `poison_request`; a batch line: a poison line). Whether a death is the request's own
depends on its cause (`cause_of`, and the watchdog's own verdicts):

- `failure`: the worker reported `Fatal` with a step's traceback (a step raised; the client's
  `step_failed`). Counts.
- `hang`: the watchdog killed it, one step having run past `gateway.step_timeout_seconds`. Counts.
- `loss`: the process gone without a word (a signal, the OOM killer), the connection lost or silent,
  the cluster manager's death notice, a rank of its tensor-parallel group gone (a `Fatal` with
  `group_broke`). Counts only when no other replica of the device was lost within `LOSS_WINDOW_SECONDS`
  of it, before or after.
- `stall`: the watchdog killed it, its heartbeat silent for `gateway.stall_seconds` (a process frozen
  whole). As a loss.
- `stopped`: the gateway stopped the replica (shutting down, the autoscaler removing it). Never.
- `unreadable`: the worker could not read a command the gateway sent (a `Fatal` with `unreadable`), or the
  gateway a frame the worker sent (`engine.ipc.FrameError`): a gateway and worker of other code, a corrupt
  stream. The link's doing: never.

A lone loss counts: a request can make its worker run out of memory, and the OOM killer's signal is a
loss. Replicas lost together are one fault that took them all (a node, a network, the cluster
manager), nothing in the requests on them: a one-node Ray cluster that lost its node lost both
replicas within 40 ms. So a loss's verdict is known only once the window after it has passed
(`settled_at`; at once on a device of one replica, which has no other replica to lose); before, it is
undecided, unless another loss already falls within its window.

Deaths are recorded by the device's supervisors (`gateway.workers.supervisor`: one `DeviceDeaths` is
shared by a device's replicas), once per worker client (a client is one process's, or one
connection's, life), at the moment the gateway learns of them: the watchdog's kill, or the client's
`died` (its process reaped, its connection closed). A request finds the death of the client it ran
on with `wait_for`. The last `MAX_KEPT` deaths are kept. Event-loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

FAILURE, HANG, LOSS, STALL, STOPPED, UNREADABLE = "failure", "hang", "loss", "stall", "stopped", "unreadable"
LOSS_WINDOW_SECONDS = 2.0   # losses of two replicas this close together are one fault
MAX_KEPT = 256              # deaths remembered per device


def cause_of(client: object) -> str:
    """The cause of a worker's death as its client knows it: a failed step where the worker said so
    (`AsyncEngineClient.step_failed`, from its `Fatal`), a frame either side could not read (its `Fatal` said
    so, or the gateway found one), anything else (a `Fatal` whose group broke, a process gone, a connection lost) a loss."""
    if getattr(client, "commands_unreadable", False):
        return UNREADABLE
    return FAILURE if getattr(client, "step_failed", False) else LOSS


@dataclass(frozen=True)
class Death:
    """One worker's death: its replica, when the gateway learned of it (time.monotonic()), its cause and
    the reason as the client gave it."""

    replica: int
    at: float
    cause: str
    reason: str
    client: object = field(default=None, compare=False, repr=False)   # the dead worker's client

    @property
    def is_loss(self) -> bool:
        return self.cause in (LOSS, STALL)


@dataclass(eq=False)   # each hold is itself: the gate removes its own, not an equal one
class Hold:
    """One hold of a `SuspectGate`; `crowded` once another shared hold was taken while it lasted."""

    exclusive: bool = False
    crowded: bool = False


class SuspectGate:
    """Requests a worker death counted against run together (`shared`), except one whose last such death
    came while others held the gate beside it: that one runs with no other suspect in flight (`exclusive`;
    waiting ones go first), so that a next death points at it and not at those beside it. A device's
    (`DeviceDeaths.suspects`) for HTTP requests, the batch runner's own for its lines. Event loop only."""

    def __init__(self) -> None:
        self._shared: list[Hold] = []
        self._num_waiting = 0
        self._exclusive = False
        self._changed = asyncio.Event()

    async def _wait(self, ready: Callable[[], bool]) -> None:
        while not ready():
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[Hold]:
        """Hold the gate beside others, once none waits for it alone."""
        await self._wait(lambda: not self._exclusive and not self._num_waiting)
        hold = Hold()
        for other in self._shared:
            other.crowded = hold.crowded = True
        self._shared.append(hold)
        try:
            yield hold
        finally:
            self._shared.remove(hold)
            self._notify()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[Hold]:
        """Hold the gate alone, once the holds in flight have ended."""
        self._num_waiting += 1
        try:
            await self._wait(lambda: not self._exclusive and not self._shared)
        finally:
            self._num_waiting -= 1
            self._notify()
        self._exclusive = True
        try:
            yield Hold(exclusive=True)
        finally:
            self._exclusive = False
            self._notify()


class DeviceDeaths:
    """The recent deaths of `device`'s replicas (`num_replicas` of them), and their verdicts."""

    def __init__(self, device: str, num_replicas: int = 1, window: float = LOSS_WINDOW_SECONDS) -> None:
        self.device = device
        self.num_replicas = num_replicas
        self.window = window
        self.deaths: deque[Death] = deque(maxlen=MAX_KEPT)
        self.suspects = SuspectGate()   # the device's HTTP requests a death counted against
        self._recorded = asyncio.Event()   # replaced after each record: wakes `wait_for`

    def record(self, client: object, replica: int, reason: str, cause: str | None = None,
               at: float | None = None) -> Death:
        """The death of `client`'s worker (`cause`: by default `cause_of(client)`), once: a client already
        recorded keeps its first record, which is returned."""
        known = self.of(client)
        if known is not None:
            return known
        death = Death(replica, time.monotonic() if at is None else at, cause or cause_of(client), reason, client)
        self.deaths.append(death)
        self._recorded.set()
        self._recorded = asyncio.Event()
        return death

    def of(self, client: object) -> Death | None:
        """The recorded death of `client`'s worker, if any."""
        return next((d for d in reversed(self.deaths) if d.client is client), None)

    async def wait_for(self, client: object, timeout: float) -> Death | None:
        """The death of `client`'s worker once recorded; None if it is not within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (death := self.of(client)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self._recorded.wait(), left)
            except TimeoutError:
                return None
        return death

    def settled_at(self, death: Death) -> float:
        """When `death`'s verdict is final: a loss's once the window after it has passed (on a device of
        several replicas), any other's at once."""
        return death.at + self.window if death.is_loss and self.num_replicas > 1 else death.at

    def counts(self, death: Death, now: float | None = None) -> bool | None:
        """Whether `death` counts against the requests that were in flight at it (the module docstring);
        None while undecided (a loss whose window is still open, no other loss within it yet)."""
        if death.cause in (FAILURE, HANG):
            return True
        if not death.is_loss:
            return False
        if any(d.is_loss and d.replica != death.replica and abs(d.at - death.at) <= self.window for d in self.deaths):
            return False
        return True if (time.monotonic() if now is None else now) >= self.settled_at(death) else None


@dataclass
class DeathsUnder:
    """The worker deaths one request was in flight at, each with its device's record, in order."""

    seen: list[tuple[DeviceDeaths, Death]] = field(default_factory=list)

    def add(self, record: DeviceDeaths, death: Death) -> None:
        self.seen.append((record, death))

    def __len__(self) -> int:
        return len(self.seen)

    def verdicts(self, since: int = 0, now: float | None = None) -> list[bool | None]:
        """`counts` of each death from the `since`-th on."""
        return [record.counts(death, now) for record, death in self.seen[since:]]

    async def settle(self, since: int = 0) -> None:
        """Wait (holding nothing) until the verdict of every death from the `since`-th on is final."""
        wait = max((record.settled_at(death) for record, death in self.seen[since:]), default=0.0) - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)

    def describe(self) -> str:
        """`replica 0: loss (…); replica 1: loss (…)`, for logs and error messages."""
        return "; ".join(f"{record.device} replica {d.replica}: {d.cause} ({last_line(d.reason)})"
                         for record, d in self.seen)


def last_line(reason: str, limit: int = 160) -> str:
    """A reason's last non-empty line (a traceback's exception), at most `limit` characters."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    return lines[-1][:limit] if lines else ""
