"""`RemoteEngineClient`: the gateway's client of a replica served over the network (`engine.remote`).

The same client as for a local worker (`engine.client.AsyncEngineClient`: the same messages, streams,
back-pressure and death handling), over an authenticated TCP connection instead of a socket pair to a
child process. What places the replica and says where it is, is a `ReplicaLink` (on Ray:
`gateway.workers.ray_cluster.RayReplica`): it gives the endpoint (waiting while the replica is placed or
restarted), restarts a replica the watchdog finds stalled, and may report its death before the
connection's loss shows (`lost`).

A client is one connection's life: the connection dropping, the link's death notice, `kill`, or a
connection silent for `engine.remote.SILENCE_SECONDS` (not even a heartbeat: a partition, or a peer
that stopped forwarding, or a replica frozen: its link restarts it unless it answers the cluster manager)
ends it, and whatever was in flight fails with `EngineDeadError`; the supervisor then makes a new client, which connects to the (restarted) replica. While it lives the
client sends a `Keepalive` every `engine.remote.KEEPALIVE_SECONDS`, so that the replica, which judges
the gateway by the same rule, never takes an idle gateway for a lost one.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

from engine import remote
from engine.client import AsyncEngineClient, EngineDeadError
from engine.config import EngineConfig
from engine.ipc import Channel
from engine.messages import Keepalive


class ReplicaLink(Protocol):
    """Where a remote replica is, as its cluster manager says."""

    name: str

    async def endpoint(self, timeout: float) -> tuple[str, int, bytes]:
        """(host, port, key) once the replica is placed; TimeoutError past `timeout`."""

    async def watch(self) -> str:
        """The reason, once the cluster manager says the replica's process died or restarts (never, where it
        does not tell)."""

    def restart(self, reason: str) -> None:
        """Have the cluster manager kill the replica's process and start it again."""

    async def restart_unless_responsive(self, reason: str, loading_hangs: bool = False) -> None:
        """(Optional.) Restart the replica unless its process answers the cluster manager: a connection
        that went silent may be a partition between this gateway and a healthy replica. `loading_hangs`
        (a start past its limit): an answer that it still loads is a hung load, restarted too."""

    async def removed(self) -> bool:
        """(Optional.) Whether the replica is gone for good (removed, not restarting): a replica that a
        drain ended (another gateway's autoscaler removed it)."""

    async def remove(self) -> None:
        """(Optional.) Remove the replica from the cluster (its process and what it holds there)."""


class RemoteEngineClient(AsyncEngineClient):
    """`AsyncEngineClient` over a network connection to a replica that `link` locates."""

    def __init__(self, config: EngineConfig, link: ReplicaLink) -> None:
        super().__init__(config)
        self.kill_unreadable = False   # a frame that does not decode drops this link, not the replica others share
        self.link = link
        self.address: tuple[str, int] | None = None
        self._lost_reason: str | None = None
        self._keepalive: asyncio.Task | None = None
        self._checking: asyncio.Future | None = None   # a stalled connection's replica being asked (`kill`)
        self._watch: asyncio.Future | None = None      # the cluster manager's death notice (`ReplicaLink.watch`)

    async def _launch(self, timeout: float) -> Channel:
        host, port, key = await self.link.endpoint(timeout)
        sock, keys = await remote.connect(host, port, key, min(timeout, 30.0))
        self.address = (host, port)
        self._process = self.link   # a client is alive while its connection is
        self._keepalive = asyncio.ensure_future(self._keep_alive())
        # From the connection on, loading too: a replica silent while it loads is judged by this notice alone.
        self._watch = asyncio.ensure_future(self.link.watch())
        self._watch.add_done_callback(lambda w: w.cancelled() or w.exception() or self.lost(w.result()))
        return Channel(sock, keys)

    async def _keep_alive(self) -> None:
        """Every `KEEPALIVE_SECONDS`: end the connection if the loaded replica said nothing for
        `SILENCE_SECONDS`, else send a `Keepalive`. Ends with the connection. A silence is what the
        supervisor's watchdog calls a stall (`gateway.stall_seconds`, which may be the longer), so it is
        judged as one: the replica is restarted unless it answers its cluster manager (a frozen process
        refuses every new connection's handshake too: only a restart serves again)."""
        while self.is_alive:
            await asyncio.sleep(remote.KEEPALIVE_SECONDS)
            silent = self.silent_seconds()
            if silent >= remote.SILENCE_SECONDS:
                self._lost_reason = f"{self._exit_reason()}: nothing received for {silent:.1f} s"
                self.kill(self._lost_reason, unless_responsive=True)
                return
            if self.is_alive:
                with contextlib.suppress(EngineDeadError):
                    self._send(Keepalive())

    async def start(self, timeout: float = 900.0):
        info = await super().start(timeout)
        self.pid = info.pid
        return info

    def lost(self, reason: str) -> None:
        """The cluster manager says the replica died (before, or without, the connection's loss)."""
        if self._process is not None and self._reaper is None:
            self._lost_reason = reason
            self._on_readable()   # what it sent before it died is its word all the same (outputs, its Fatal)
            self._on_exit(reason)

    def kill(self, reason: str, *, unless_responsive: bool = False) -> None:
        """Drop the connection at once and have the replica restarted (a hung one: `gateway.workers.supervisor`).
        `unless_responsive` (a silent connection): restart it only if it does not answer its cluster manager
        either (`ReplicaLink.restart_unless_responsive`); one that answers lost only this gateway's
        connection (a partition), and other gateways it serves keep it: this one connects again."""
        if self._process is None or self._reaper is not None:
            return
        self._on_exit(reason)   # first: a restart that raises must not leave the connection up (judged again)
        check = getattr(self.link, "restart_unless_responsive", None)
        if unless_responsive and check is not None:
            self._checking = asyncio.ensure_future(check(reason))
        else:
            self.link.restart(reason)

    async def _reap(self, grace: float) -> None:
        if self._lost_reason is None and self._dead is None:
            await asyncio.sleep(0)   # a death notice racing the connection's loss may name the cause
        self._die(self._exit_reason())
        self._channel.close()
        for task in (self._keepalive, self._watch):
            if task is not None:
                task.cancel()
        if not self.died.done():
            self.died.set_result(self._dead)

    def _exit_reason(self) -> str:
        where = f" at {self.address[0]}:{self.address[1]}" if self.address else ""
        return self._lost_reason or f"replica {self.link.name}{where}: connection lost"
