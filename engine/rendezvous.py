"""How a tensor-parallel group's ranks meet: rank 0's store, each follower's word that it joined, the process group.

Rank 0 serves the group's `torch.distributed.TCPStore` on a free port of 127.0.0.1 it binds itself (`serve_store`: no
port chosen, freed and taken again, which another process could take meanwhile; no other interface) before it starts its
followers, and hands them its address. A follower connects to it and sets its key (`joined/<rank>`) before the process
group's own rendezvous, so rank 0 can tell a follower on its way from one that will never come: it waits for every
follower's key while watching its process, and one that ends first (an import that fails, a device it cannot open, a
fork whose start fails) fails the group's start at once, naming the rank and how its process ended, instead of the
rendezvous's `INIT_TIMEOUT_SECONDS` later (`describe_exit` words how it ended). Then every rank builds the process group
on the store (NCCL on CUDA, gloo on a CPU).

The ranks are one machine's processes, so gloo's own sockets (a listening one per rank, a pair per peer) are on the
loopback interface too: left to itself gloo takes the address this machine's hostname resolves to, often the address
other machines reach (a container's, a host's). `join_group` names the loopback interface in `GLOO_SOCKET_IFNAME`
while the group is built, unless the operator set it.
"""

from __future__ import annotations

import datetime
import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from engine.config import DEFAULT_COLLECTIVE_TIMEOUT_SECONDS

__all__ = ["INIT_TIMEOUT_SECONDS", "describe_exit", "join_group", "loopback_interface", "serve_store"]

INIT_TIMEOUT_SECONDS = 300   # how long a rank waits for the others to join the group (the rendezvous)
_POLL_SECONDS = 0.02         # how often rank 0 looks for a follower's key, and at its process
_IFF_LOOPBACK = 0x8          # an interface's flag (Linux's if.h) that says it is the loopback


def serve_store(size: int) -> torch.distributed.TCPStore:
    """Rank 0's store for a group of `size` ranks, listening on a port of 127.0.0.1 (`store.port`): on a socket
    bound here, as the store given a host and port of its own listens on every interface."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    return torch.distributed.TCPStore("127.0.0.1", port, size, is_master=True, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=INIT_TIMEOUT_SECONDS),
                                      master_listen_fd=listener.detach())


def join_group(device: torch.device, rank: int, size: int, store: torch.distributed.TCPStore | str,
               collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_SECONDS, followers: Sequence = ()):
    """Join the group as `rank` (NCCL on CUDA, gloo on a CPU) through `store`: rank 0's own (`serve_store`), which
    waits for each of its `followers` (their processes, ranks 1..) to say it joined first; or its address
    (tcp://127.0.0.1:port) for a follower, which says so. The rendezvous waits up to `INIT_TIMEOUT_SECONDS`, every
    collective after it `collective_timeout` seconds. Returns the process group (`torch.distributed`'s WORLD)."""
    timeout = datetime.timedelta(seconds=INIT_TIMEOUT_SECONDS)
    if isinstance(store, str):
        host, port = store.removeprefix("tcp://").rsplit(":", 1)
        store = torch.distributed.TCPStore(host, int(port), size, is_master=False, timeout=timeout)
        store.set(f"joined/{rank}", "1")
    else:
        _await_followers(store, size, followers)
    if device.type == "cuda":
        # NCCL's cuMem buffers cost each all-reduce captured in a decode graph memory of its own (1-2 GiB
        # over the graphs of a large model, NVIDIA/nccl#1234) that the capacity plan does not set aside;
        # one node's ranks need no cuMem. Set before the communicator exists; a user's own value wins.
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
        torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl", store=store, rank=rank, world_size=size, timeout=timeout,
                                             device_id=device)
    else:
        with _gloo_on_loopback():
            torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(datetime.timedelta(seconds=collective_timeout), torch.distributed.group.WORLD)
    return torch.distributed.group.WORLD


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface (`lo` on Linux), or None where the kernel does not say
    (no /sys/class/net)."""
    for _, name in socket.if_nameindex():
        try:
            flags = int(Path("/sys/class/net", name, "flags").read_text(), 16)
        except (OSError, ValueError):
            continue
        if flags & _IFF_LOOPBACK:
            return name
    return None


@contextlib.contextmanager
def _gloo_on_loopback() -> Iterator[None]:
    """Within: gloo's sockets on the loopback interface (`GLOO_SOCKET_IFNAME`, read as the group is built), unless
    the operator named interfaces of their own or none is found."""
    interface = None if "GLOO_SOCKET_IFNAME" in os.environ else loopback_interface()
    if interface is None:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        yield
    finally:
        del os.environ["GLOO_SOCKET_IFNAME"]


def describe_exit(exitcode: int) -> str:
    """A process's exit code in words: `exit code 1`, `signal 9, SIGKILL` (negative codes are signals)."""
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        return f"signal {-exitcode}, {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"signal {-exitcode}"


def _await_followers(store: torch.distributed.TCPStore, size: int, followers: Sequence) -> None:
    """Until every follower's key is in `store`: RuntimeError naming the first whose process ended before it said it
    joined, or that has not said so within `INIT_TIMEOUT_SECONDS`."""
    deadline = time.monotonic() + INIT_TIMEOUT_SECONDS
    for rank, process in enumerate(followers, start=1):
        while not store.check([f"joined/{rank}"]):
            if (code := process.poll()) is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} of {size} (pid {process.pid}) exited before it "
                                   f"joined the group ({describe_exit(code)})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel rank {rank} of {size} (pid {process.pid}) did not join the "
                                   f"group within {INIT_TIMEOUT_SECONDS} s")
            time.sleep(_POLL_SECONDS)
