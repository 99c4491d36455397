"""A device replica served over TCP: the worker loop of `engine.worker`, reached across a network.

A `ReplicaServer` lives in a process that a cluster manager placed (a Ray actor: `ReplicaActor`, and
`gateway.workers.ray_cluster` on the gateway's side). It binds a listening socket at once and runs two
threads. The **accept thread** starts a thread per connection that takes it through the handshake
(`engine.wire.Handshake`: nothing of a message is read from a peer that does not prove the key; a silent
peer holds only its own thread, for `HANDSHAKE_SECONDS`) and hands it to the **engine thread**, which
loads the engine, then serves every gateway connected, at once, with the same messages, the same loop,
the same heartbeat thread and the same back-pressure as a local worker (`engine.worker._serve`, over an
`engine.sessions.SessionHub`: the gateway's watchdog judges a replica as it judges a local worker). The
engine is only ever touched by the engine thread (its CUDA device and streams are that thread's).

**Several gateways, one replica.** Each authenticated connection is a session; sessions come and go
while the engine serves on. Each gateway holds a lease on a share of every pool's KV credits, and the
replica never leases more than it has (`engine.sessions`). When a session ends (the gateway closed it,
was killed, or went silent), what it had in flight is aborted, its blocks freed, and its share offered
to the others at once. A gateway that restarted, or came back after a partition, is served at once
beside its old session, which ends within `SILENCE_SECONDS`.

**A silent link is dropped within `SILENCE_SECONDS`**, on both ends. Over the connection the replica
sends a `Heartbeat` every half second and the gateway a `Keepalive` every `KEEPALIVE_SECONDS`, so in a
healthy link neither direction is ever quiet that long. The replica's loop reads a connection that
carried nothing for `SILENCE_SECONDS` as closed (`ReplicaChannel`); the gateway's client does the same
(`engine.remote_client`). Beneath those rules the kernel bounds what the peer leaves unacknowledged
(`TCP_USER_TIMEOUT`, which also counts a receive window the peer keeps closed): on the replica's socket
`SILENCE_SECONDS`, since the gateway reads whenever data comes; on the gateway's, `UNREAD_SECONDS`, since a
replica reads between steps only and a healthy step may last minutes. TCP keepalive probes
(`TCP_KEEPALIVE`) watch a direction with nothing to send (`keep_alive`).

The key is made here, at random, and handed out only through the cluster's control plane
(`ReplicaActor.endpoint`). A step that fails ends the process (`os._exit`): the cluster manager
restarts the replica, the gateway sees the connection drop and the actor's death, and retries what
had sent no token elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time

from engine.config import EngineConfig
from engine.messages import Keepalive, StartupError
from engine.wire import KEY_BYTES, SILENCE_SECONDS, FrameKeys, Handshake
from engine.worker import WorkerChannel

log = logging.getLogger("cliffguard.engine")

__all__ = ["ReplicaServer", "ReplicaActor", "ReplicaChannel", "HANDSHAKE_SECONDS", "SILENCE_SECONDS",
           "KEEPALIVE_SECONDS", "UNREAD_SECONDS", "connect", "placed_config"]

HANDSHAKE_SECONDS = 10.0   # a peer that has not finished the handshake by then is dropped
MAX_HANDSHAKES = 64        # connections proving the key at once, each on its own thread; a new one past it drops the
# oldest (a gateway's handshake takes milliseconds: the oldest are silent peers), so no flood of them locks gateways out
MESSAGE_SECONDS = 120.0    # the replica's end: bytes of one unfinished message count as heard this long at most
KEEPALIVE_SECONDS = 2.0    # between the gateway's `Keepalive` frames
BUSY_SECONDS = 1.0         # a replica's turn this long without reading (a long step) is not the gateway's silence
UNREAD_SECONDS = 600.0     # the gateway's socket: how long a replica may leave its data unread (a step; as
                           # gateway.step_timeout_seconds' default), then the kernel drops the connection
TCP_KEEPALIVE = (5, 5, 3)  # TCP keepalive of a quiet direction: idle seconds, probe interval, probes
BUNDLE_GPU_SECONDS = 60.0  # how long a replica waits to learn the GPUs of its group's other bundles


def keep_alive(sock: socket.socket, user_timeout: float) -> None:
    """Nagle off; `TCP_USER_TIMEOUT` so data the peer leaves unacknowledged (or unread, its window closed)
    for `user_timeout` seconds ends the connection (Linux); TCP keepalive probes so a quiet direction
    behind a dead link (no FIN, no RST) is noticed too."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = TCP_KEEPALIVE
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count),
                        ("TCP_USER_TIMEOUT", int(user_timeout * 1000))):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class ReplicaChannel(WorkerChannel):
    """The replica's end of one gateway connection. It reads as closed (`eof`) once the gateway has said
    nothing for `silence_seconds` (the gateway's `Keepalive` frames keep a healthy idle connection talking;
    they are consumed here, never returned), or once another thread called `end`. Saying something is a
    whole message, its MAC checked, or bytes of one still arriving, for at most `message_seconds` after
    the last whole one: a large message on a slow link is heard, a frame whose length header was changed
    in transit (its body never ends, keepalives pile up behind it) is not for long. `wait` never sleeps
    past the silence deadline. Neither clock runs while the replica does not read (a step of `BUSY_SECONDS` or
    more between two `receive`s, outside `wait`: a first compile, a long prefill) when bytes came meanwhile (up
    to `message_seconds` since the last whole message), so a large message the gateway sent then is not cut for
    the replica's own time; a turn after which nothing came is the gateway's silence. `end_reason` says why it ended, when it was
    not the peer closing. Thread rules: `WorkerChannel`'s; `end` from any thread."""

    def __init__(self, sock: socket.socket, keys: FrameKeys, peer: object, silence_seconds: float,
                 message_seconds: float = MESSAGE_SECONDS) -> None:
        super().__init__(sock, keys)
        self.peer = peer
        self.silence_seconds, self.message_seconds = silence_seconds, message_seconds
        self.last_heard = self.last_whole = self._read_at = time.monotonic()
        self._waited = 0.0   # seconds in `wait` since the last `receive`: listening
        self._credited = 0.0   # the replica's own time credited to the clocks since the last whole message

    def receive(self) -> list[object]:
        num_bytes = self.num_received_bytes
        received = super().receive()
        now = time.monotonic()
        busy = now - self._read_at - self._waited   # the replica's own turn, not reading: bytes that came meanwhile
        if busy >= BUSY_SECONDS and self.num_received_bytes != num_bytes:   # count from its end (at most
            credit = min(busy, max(0.0, self.message_seconds - self._credited))   # `message_seconds` a message)
            self.last_heard, self.last_whole, self._credited = (self.last_heard + credit, self.last_whole + credit,
                                                                self._credited + credit)
        self._read_at, self._waited = now, 0.0
        if received:
            self._credited = 0.0
            self.last_heard = self.last_whole = now
        elif self.num_received_bytes != num_bytes and now - self.last_whole < self.message_seconds:
            self.last_heard = now
        elif not self.eof and now - self.last_heard >= self.silence_seconds:
            self.end_reason = (f"no whole message from the gateway for {now - self.last_whole:.1f} s"
                               if self.num_received_bytes != num_bytes else
                               f"nothing from the gateway for {now - self.last_heard:.1f} s")
            self.eof = True
        return [msg for msg in received if not isinstance(msg, Keepalive)]

    def wait(self, timeout: float | None = None) -> None:
        started = time.monotonic()
        left = max(0.0, self.last_heard + self.silence_seconds - started)
        super().wait(left if timeout is None else min(timeout, left))
        self.listened(time.monotonic() - started)

    def listened(self, seconds: float) -> None:
        """The replica waited `seconds` for this connection (its own `wait`, or the hub's over them all)."""
        self._waited += seconds

    def end(self, reason: str) -> None:
        """Shut the connection down from another thread: the loop wakes, reads EOF and returns; the peer
        sees the connection close."""
        self.end_reason = reason
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass   # already closed


class ReplicaServer:
    """Loads `config`'s engine and serves every gateway that proves the key on `host`:`port` (0: any free
    port).

    `address` is known at once; `state` is `loading`, `ready` or `failed: <reason>`; `key` is the
    32-byte secret a gateway must prove; `gateways` the addresses of the gateways served now. Thread
    rules: `start` once, from any thread; the engine (`_engine`) and the sessions are the engine
    thread's; a connection's handshake thread hands it to the hub (`SessionHub.attach`), or, while the
    engine loads, to `_early` under `_lock`."""

    def __init__(self, config: EngineConfig, host: str, port: int = 0, key: bytes | None = None) -> None:
        self.config = config
        self.key = key or os.urandom(KEY_BYTES)
        self.listener = socket.create_server((host, port), backlog=8)
        self.address = (host, self.listener.getsockname()[1])
        self.state = "loading"
        self._engine = None
        self._hub = None                               # every gateway's session, once the engine is loaded
        self._lock = threading.Lock()
        self._early: list[ReplicaChannel] = []         # proved the key while the engine loads
        self._handshakes: dict[socket.socket, float] = {}   # connections proving their key now: when they came
        self._threads = (threading.Thread(target=self._run, name="cliffguard-replica", daemon=True),
                         threading.Thread(target=self._accept, name="cliffguard-replica-accept", daemon=True))

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        """The engine thread: load, then serve every gateway's session (`engine.sessions.SessionHub`)
        until the process ends; a step that fails ends it (`os._exit`) after telling every gateway."""
        from engine.llm_engine import LLMEngine
        from engine.sessions import SessionHub
        from engine.worker import _rank_lost, _serve, _step_failed

        if self.config.cpu_threads:   # as a local worker does (engine.worker): the bundle's CPUs, no more
            import torch

            torch.set_num_threads(self.config.cpu_threads)
        try:
            engine = LLMEngine(self.config)
        except Exception as exc:  # noqa: BLE001 - told to every gateway that connects
            with self._lock:
                self.state = f"failed: {type(exc).__name__}: {exc}"
                early, self._early = self._early, []
            log.error("replica failed to load: %s", self.state)
            for channel in early:
                self._refuse(channel)
            return
        hub = SessionHub(engine)
        engine.group.on_rank_exit = lambda reason: _rank_lost(hub, reason)
        with self._lock:
            self._engine, self._hub, self.state = engine, hub, "ready"
            early, self._early = self._early, []
        for channel in early:
            hub.attach(channel, str(channel.peer))
        try:
            _serve(engine, hub)
        except Exception:  # noqa: BLE001 - a failed step: say why, then end the process for a restart
            try:
                _step_failed(hub, engine.group)
            finally:
                os._exit(1)

    def _accept(self) -> None:
        """The accept thread: each connection proves its key on a thread of its own (`_admit`), so a peer that
        connects and says nothing holds up no gateway; past `MAX_HANDSHAKES` at once the oldest is dropped."""
        while True:
            try:
                conn, peer = self.listener.accept()
            except OSError as exc:   # out of descriptors, say: try again shortly
                log.error("replica: accept failed: %s", exc)
                time.sleep(1.0)
                continue
            with self._lock:
                oldest = min(self._handshakes, key=self._handshakes.get) if len(self._handshakes) >= MAX_HANDSHAKES \
                    else None
                self._handshakes[conn] = time.monotonic()
            if oldest is not None:
                log.warning("replica: %d handshakes under way: the oldest is dropped for %s", MAX_HANDSHAKES, peer)
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)   # its thread's read ends, and the thread with it
            try:
                threading.Thread(target=self._admit, args=(conn, peer), name="cliffguard-replica-handshake",
                                 daemon=True).start()
            except RuntimeError as exc:   # no thread to be had now: this connection is refused, the next may not be
                log.error("replica: connection from %s refused: %s", peer, exc)
                with self._lock:
                    self._handshakes.pop(conn, None)
                conn.close()

    def _admit(self, conn: socket.socket, peer) -> None:
        """Prove `conn`'s key, then hand it to the engine's hub (or hold it while the engine loads; refuse it
        with the reason if the load failed)."""
        try:
            keys = self._handshake(conn)
        except Exception as exc:  # noqa: BLE001 - OSError, WireError, or a bug: the connection is refused, not leaked
            log.warning("replica: connection from %s refused: %s", peer, exc)
            conn.close()
            return
        finally:
            with self._lock:
                self._handshakes.pop(conn, None)
        channel = ReplicaChannel(conn, keys, peer, SILENCE_SECONDS)
        with self._lock:
            hub, loading = self._hub, self.state == "loading"
            if loading:
                self._early.append(channel)
        if hub is not None:
            hub.attach(channel, str(peer))
        elif not loading:
            self._refuse(channel)

    def _refuse(self, channel: ReplicaChannel) -> None:
        """A gateway that connected to a replica whose load failed: the reason, then close."""
        from engine.worker import LAST_WORDS_SECONDS

        try:
            channel.send(StartupError(self.state.removeprefix("failed: ")))
            channel.drain(LAST_WORDS_SECONDS)
        except OSError:
            pass
        finally:
            channel.close()

    @property
    def num_sessions(self) -> int:
        """Gateway sessions served so far."""
        return self._hub.num_sessions if self._hub is not None else 0

    @property
    def gateways(self) -> list[str]:
        """The gateways being served now (their addresses)."""
        return [session.name for session in self._hub.sessions] if self._hub is not None else []

    def _handshake(self, conn: socket.socket) -> FrameKeys:
        """The key proved both ways, all within `HANDSHAKE_SECONDS` (TimeoutError past it)."""
        deadline = time.monotonic() + HANDSHAKE_SECONDS
        keep_alive(conn, SILENCE_SECONDS)   # the gateway reads whenever data comes
        conn.settimeout(HANDSHAKE_SECONDS)
        shake = Handshake(self.key)
        conn.sendall(shake.hello())
        conn.sendall(shake.server_proof(_read_exact(conn, Handshake.CLIENT_BYTES, deadline)))
        return shake.keys(server=True)


def _read_exact(conn: socket.socket, size: int, deadline: float) -> bytes:
    """`size` bytes, all before `deadline` (time.monotonic()): a peer trickling bytes is not waited for."""
    data = bytearray()
    while len(data) < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the peer did not finish the handshake in time")
        conn.settimeout(left)
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise OSError("the peer closed the connection during the handshake")
        data += chunk
    return bytes(data)


def placed_config(config: EngineConfig) -> EngineConfig:
    """`config` on the GPUs Ray assigned to the calling actor's placement group *now* (call it inside the
    actor, at every start: a restarted actor may be in a group Ray rescheduled on another node). Rank 0
    is the actor itself (bundle 0): its own GPU; rank r runs on the GPU of bundle r, learned by a zero-CPU
    task that asks for that bundle's GPU. A CPU device's config is returned as it is. RuntimeError if the
    actor holds no GPU, or a bundle's GPU is not free within `BUNDLE_GPU_SECONDS`."""
    if not config.device.startswith("cuda"):
        return config
    import ray

    own = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
    if not own:
        raise RuntimeError("a CUDA replica's actor holds no GPU: its bundles ask for none")
    others: tuple[int, ...] = ()
    if config.tensor_parallel_size > 1:
        group = ray.util.get_current_placement_group()
        if group is None:
            raise RuntimeError(f"tensor_parallel_size {config.tensor_parallel_size} needs the actor in a "
                               f"placement group of as many bundles")
        others = _bundle_gpus(group, range(1, config.tensor_parallel_size))
    return dataclasses.replace(config, device="cuda", gpu_ids=(int(own[0]), *others))


def _bundle_gpus(group, bundles: range) -> tuple[int, ...]:
    """The GPU each of `bundles` of `group` holds (bundle i keeps its GPU while the group stays placed)."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0, num_gpus=1)
    def gpu_of_bundle() -> int:
        return int(ray.get_runtime_context().get_accelerator_ids()["GPU"][0])

    refs = [gpu_of_bundle.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote()
            for i in bundles]
    try:
        return tuple(ray.get(refs, timeout=BUNDLE_GPU_SECONDS))
    except GetTimeoutError:
        for ref in refs:
            ray.cancel(ref, force=True)
        raise RuntimeError(f"the GPUs of bundles {list(bundles)} of the replica's placement group were not "
                           f"free within {BUNDLE_GPU_SECONDS:g} s") from None


class ReplicaActor:
    """The Ray actor of one replica (made a Ray class by `gateway.workers.ray_cluster`; this module never imports
    Ray at its top). At every start (a restart included) it takes its GPUs from Ray's assignment of its
    placement group (`placed_config`), never from its arguments: Ray restarts an actor with the same
    arguments wherever the group is now. It serves on the node's IP address; `endpoint` hands the gateway
    what it needs to connect, over Ray's own control plane. Run threaded (`max_concurrency` > 1) so that
    `endpoint` and `state` answer while the engine loads and `wait_stopped` can stay pending: its failure
    is the gateway's death notice."""

    def __init__(self, config: EngineConfig) -> None:
        import ray

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.node_id = ray.get_runtime_context().get_node_id()
        self.server = ReplicaServer(placed_config(config), ray.util.get_node_ip_address())
        self.server.start()
        self._stopped = threading.Event()

    def endpoint(self) -> tuple[str, int, bytes, str]:
        """(host, port, key, node id)."""
        return (*self.server.address, self.server.key, self.node_id)

    def state(self) -> str:
        return self.server.state

    def gpu_ids(self) -> tuple[int, ...]:
        """The GPU of each rank, as this process hands them to its engine (empty on a CPU device)."""
        return tuple(self.server.config.gpu_ids)

    def pid(self) -> int:
        return os.getpid()

    def sessions(self) -> dict:
        """The replica's own counters of its gateways' sessions and each pool's credits, with their
        high-water marks since the start (`engine.sessions.SessionHub.counters`): a look from outside,
        without a gateway. Empty while the engine loads, or when its load failed."""
        hub = self.server._hub
        return hub.counters() if hub is not None else {}

    def wait_stopped(self, timeout: float) -> bool:
        """True once the actor is stopping, False after `timeout` seconds; the call fails (RayActorError)
        when the actor dies first. The gateway keeps one pending as its death notice: bounded, so a
        gateway that went away leaves no call holding one of the actor's threads for long."""
        return self._stopped.wait(timeout)


async def connect(host: str, port: int, key: bytes, timeout: float) -> tuple[socket.socket, FrameKeys]:
    """The gateway's side: connect to a replica and prove the key (and check the replica's proof);
    a non-blocking socket and the session's keys, for an `engine.ipc.Channel`. OSError (or TimeoutError)
    if the replica cannot be reached in `timeout` seconds, WireError if it is not one or keys differ."""
    import asyncio

    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    keep_alive(sock, UNREAD_SECONDS)   # the replica reads between steps only

    async def shake() -> FrameKeys:
        await loop.sock_connect(sock, (host, port))
        hand = Handshake(key)
        hello = await _read_exact_async(loop, sock, Handshake.HELLO_BYTES)
        await loop.sock_sendall(sock, hand.client_answer(hello))
        hand.check_server(await _read_exact_async(loop, sock, Handshake.PROOF_BYTES))
        return hand.keys(server=False)

    try:
        keys = await asyncio.wait_for(shake(), timeout)
    except BaseException:
        sock.close()
        raise
    return sock, keys


async def _read_exact_async(loop, sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = await loop.sock_recv(sock, size - len(data))
        if not chunk:
            raise OSError("the replica closed the connection during the handshake")
        data += chunk
    return bytes(data)
