"""Where a tensor-parallel group's sockets listen (`engine.rendezvous`): the ranks are one machine's processes, and
every socket of theirs, gloo's included, is on the loopback interface even where this machine's hostname resolves to
an address other machines reach (gloo's own choice left alone)."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).parents[2]
_SIOCGIFADDR = 0x8915   # Linux's ioctl for an interface's IPv4 address


def listening_addresses(pid: int) -> list[str]:
    """The IPv4 and IPv6 addresses process `pid`'s listening TCP sockets are bound to, as /proc's hex."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    addresses = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:   # 0A: LISTEN
                    addresses.append(fields[1].rsplit(":", 1)[0])
    return addresses


def rank(index: int, port: int = 0) -> None:
    """Rank `index` of a group of two over gloo (rank 0 serves the store and starts rank 1): one all-reduce, then
    print its listening sockets' addresses and wait for the other rank."""
    from engine.rendezvous import join_group, serve_store

    with torch.no_grad():
        if index == 0:
            store = serve_store(2)
            follower = subprocess.Popen([sys.executable, "-c", f"from tests.engine.test_rendezvous import rank; "
                                                               f"rank(1, {store.port})"], cwd=REPO)
            group = join_group(torch.device("cpu"), 0, 2, store, followers=[follower])
        else:
            group = join_group(torch.device("cpu"), 1, 2, f"tcp://127.0.0.1:{port}")
        total = torch.ones(1)
        torch.distributed.all_reduce(total, group=group)
        line = " ".join(map(str, (index, int(total.item()), *listening_addresses(os.getpid())))) + "\n"
        os.write(sys.stdout.fileno(), line.encode())   # one write: the two ranks' lines never interleave
        torch.distributed.barrier(group=group)
        torch.distributed.destroy_process_group()
    if index == 0:
        follower.wait(timeout=30)


def _an_address_other_machines_reach() -> str | None:
    """An IPv4 address of one of this machine's interfaces other than the loopback, or None."""
    from engine.rendezvous import loopback_interface

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            if name == loopback_interface():
                continue
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            return socket.inet_ntoa(packed[20:24])
    finally:
        probe.close()
    return None


def _can_unshare() -> bool:
    return (shutil.which("unshare") is not None
            and subprocess.run(["unshare", "-u", "-m", "true"], capture_output=True).returncode == 0)


@pytest.mark.skipif(sys.platform != "linux", reason="/proc and Linux's interface flags")
def test_gloos_sockets_listen_on_the_loopback_where_the_hostname_resolves_elsewhere(tmp_path):
    """Two ranks in a namespace of their own (`unshare`: a hostname of its own, resolved by a hosts file to this
    machine's other address): gloo, left to itself, listens on that address; the group's every socket, the store's
    and gloo's, listens on 127.0.0.1 alone."""
    address = _an_address_other_machines_reach()
    if address is None or not _can_unshare():
        pytest.skip("needs an interface other than the loopback and `unshare -u -m` (root)")
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{address} cliffguard-node\n")
    script = (f"hostname cliffguard-node && mount --bind {hosts} /etc/hosts && exec {sys.executable} -c "
              f"'from tests.engine.test_rendezvous import rank; rank(0)'")
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    ran = subprocess.run(["unshare", "-u", "-m", "sh", "-c", script], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    lines = sorted(line.split() for line in ran.stdout.splitlines())
    assert [line[:2] for line in lines] == [["0", "2"], ["1", "2"]]
    rank0, rank1 = lines[0][2:], lines[1][2:]
    assert len(rank0) >= 2 and len(rank1) >= 1   # rank 0: the store and gloo's listener; rank 1: gloo's
    assert set(rank0 + rank1) == {"0100007F"}    # 127.0.0.1, little-endian
