"""A device replica served over TCP: the worker loop of `engine.worker`, reached across a network.

A `ReplicaServer` lives in a process that a cluster manager placed (a Ray actor: `ReplicaActor`, and
`gateway.workers.ray_cluster` on the gateway's side). It binds a listening socket at once, then loads the
engine on a thread of its own and serves one gateway connection at a time with the same messages,
the same loop, the same heartbeat thread and the same back-pressure as a local worker
(`engine.worker._serve`: the gateway's watchdog judges a replica as it judges a local worker). The engine
outlives connections: when a gateway goes away (or restarts), whatever it had in flight is aborted,
its blocks freed, and the next gateway that proves the key is served by the loaded engine.

Every connection is authenticated before a byte of a message is read (`engine.wire.Handshake`, then
signed frames); the key is made here, at random, and handed out only through the cluster's control
plane (`ReplicaActor.endpoint`). A step that fails ends the process (`os._exit`): the cluster manager
restarts the replica, the gateway sees the connection drop and the actor's death, and retries what
had sent no token elsewhere.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import traceback

from engine.config import EngineConfig
from engine.ipc import Channel
from engine.messages import Fatal, Ready, StartupError
from engine.wire import KEY_BYTES, FrameKeys, Handshake, WireError

log = logging.getLogger("cliffguard.engine")

__all__ = ["ReplicaServer", "ReplicaActor", "HANDSHAKE_SECONDS", "connect"]

HANDSHAKE_SECONDS = 10.0   # a peer that has not finished the handshake by then is dropped
KEEPALIVE = (10, 5, 3)     # TCP keepalive: idle seconds, probe interval, probes: a silent peer is gone in ~25 s


def keep_alive(sock: socket.socket) -> None:
    """Nagle off, and TCP keepalive probes so a peer behind a dead link (no FIN, no RST) is noticed."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = KEEPALIVE
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class ReplicaServer:
    """Loads `config`'s engine on a thread and serves gateways on `host`:`port` (0: any free port).

    `address` is known at once; `state` is `loading`, `ready` or `failed: <reason>`; `key` is the
    32-byte secret a gateway must prove. One connection is served at a time; another waits in the
    listen backlog until the current one ends. Thread rules: `start` once, from any thread; the rest
    is the server thread's."""

    def __init__(self, config: EngineConfig, host: str, port: int = 0, key: bytes | None = None) -> None:
        self.config = config
        self.key = key or os.urandom(KEY_BYTES)
        self.listener = socket.create_server((host, port), backlog=8)
        self.address = (host, self.listener.getsockname()[1])
        self.state = "loading"
        self.num_sessions = 0
        self._engine = None
        self._thread = threading.Thread(target=self._run, name="cliffguard-replica", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        from engine.llm_engine import LLMEngine
        from engine.worker import WorkerChannel

        if self.config.cpu_threads:   # as a local worker does (engine.worker): the bundle's CPUs, no more
            import torch

            torch.set_num_threads(self.config.cpu_threads)
        try:
            self._engine = LLMEngine(self.config)
            self.state = "ready"
        except Exception as exc:  # noqa: BLE001 - told to every gateway that connects
            self.state = f"failed: {type(exc).__name__}: {exc}"
            log.error("replica failed to load: %s", self.state)
        while True:
            conn, peer = self.listener.accept()
            try:
                keys = self._handshake(conn)
            except (OSError, WireError) as exc:
                log.warning("replica: connection from %s refused: %s", peer, exc)
                conn.close()
                continue
            self._session(WorkerChannel(conn, keys))   # the loop and its heartbeat thread send on it

    def _handshake(self, conn: socket.socket) -> FrameKeys:
        keep_alive(conn)
        conn.settimeout(HANDSHAKE_SECONDS)
        shake = Handshake(self.key)
        conn.sendall(shake.hello())
        conn.sendall(shake.server_proof(_read_exact(conn, Handshake.CLIENT_BYTES)))
        return shake.keys(server=True)

    def _session(self, channel: Channel) -> None:
        """Serve one gateway until it leaves; then abort what it left in flight."""
        from engine.worker import LAST_WORDS_SECONDS, _serve, worker_info

        self.num_sessions += 1
        engine = self._engine
        try:
            if engine is None:
                channel.send(StartupError(self.state.removeprefix("failed: ")))
                channel.drain(LAST_WORDS_SECONDS)
                return
            channel.send(Ready(worker_info(engine)))
            _serve(engine, channel)
        except OSError as exc:
            log.warning("replica: gateway connection lost: %s", exc)
        except Exception:  # noqa: BLE001 - a failed step: say why, then end the process for a restart
            try:
                channel.send(Fatal(traceback.format_exc()))
                channel.drain(LAST_WORDS_SECONDS)
            finally:
                os._exit(1)
        finally:
            channel.close()
            if engine is not None:
                for request_id in list(engine.requests):
                    engine.abort(request_id)


def _read_exact(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise OSError("the peer closed the connection during the handshake")
        data += chunk
    return bytes(data)


class ReplicaActor:
    """The Ray actor of one replica (made a Ray class by `gateway.workers.ray_cluster`; this module never imports
    Ray at its top). It serves on the node's IP address; `endpoint` hands the gateway what it needs to
    connect, over Ray's own control plane. Run threaded (`max_concurrency` > 1) so that `endpoint`
    and `state` answer while the engine loads and `wait_stopped` can stay pending: its failure is
    the gateway's death notice."""

    def __init__(self, config: EngineConfig, gpu_ids: tuple[int, ...] = ()) -> None:
        import dataclasses

        import ray

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        if gpu_ids:
            config = dataclasses.replace(config, device="cuda", gpu_ids=tuple(gpu_ids))
        self.node_id = ray.get_runtime_context().get_node_id()
        self.server = ReplicaServer(config, ray.util.get_node_ip_address())
        self.server.start()
        self._stopped = threading.Event()

    def endpoint(self) -> tuple[str, int, bytes, str]:
        """(host, port, key, node id)."""
        return (*self.server.address, self.server.key, self.node_id)

    def state(self) -> str:
        return self.server.state

    def pid(self) -> int:
        return os.getpid()

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
    keep_alive(sock)

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
