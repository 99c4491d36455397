"""gateway.workers.supervisor: a fault of the supervisor's own (a pool's admission raising when told a worker is
ready) is logged once with its traceback and supervision goes on: the replica comes back, and comes back again
after a later death; a supervision task that ends anyway is never silent."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from engine.client import EngineDeadError
from gateway.workers.deaths import STOPPED
from gateway.workers.supervisor import Backoff
from tests.gateway.conftest import pools_yaml
from tests.gateway.test_app import _client
from tests.gateway.test_slow_clients import _until
from tests.gateway.test_supervisor import _Link, _remote_supervisor, _replica_server, _wait_ready_status

INJECTED = "injected fault in replica_ready"
QUICK = Backoff(initial_seconds=0.05, max_seconds=0.2)   # 0.05, 0.1, 0.2 s: no rule here depends on the waits


def _fail_once(admission) -> list[int]:
    """Make `admission.replica_ready` raise the first time it is called; the calls that reached it, by replica."""
    calls, real = [], admission.replica_ready

    def replica_ready(replica: int, restarted: bool = True) -> None:
        calls.append(replica)
        if len(calls) == 1:
            raise RuntimeError(INJECTED)
        real(replica, restarted=restarted)

    admission.replica_ready = replica_ready
    return calls


def _assert_logged_once(caplog) -> None:
    faults = [r for r in caplog.records if r.exc_info and INJECTED in str(r.exc_info[1])]
    assert len(faults) == 1, [r.getMessage() for r in faults]
    assert faults[0].levelno == logging.ERROR and "supervising the replica failed" in faults[0].getMessage()


async def _kill_and_wait(client, gateway) -> None:
    """SIGKILL the replica's worker; wait until /ready says it restarts, then that it is ready again."""
    os.kill(gateway.clients["cpu"][0].pid, signal.SIGKILL)
    await _wait_ready_status(client, 503)
    assert (await _wait_ready_status(client, 200))["devices"] == {"cpu": "ready"}


async def test_a_restart_whose_admission_raised_is_logged_and_the_replica_still_comes_back(aiohttp_client, tmp_path,
                                                                                          tiny_model, caplog):
    client, gateway = await _client(aiohttp_client, pools_yaml(tiny_model), tmp_path)
    supervisor = gateway.supervisors["cpu"][0]
    supervisor.backoff = QUICK
    calls = _fail_once(gateway.pools["chat"].admission)
    caplog.set_level(logging.INFO, logger="cliffguard.gateway")

    first = gateway.clients["cpu"][0]
    await _kill_and_wait(client, gateway)   # its restart's admission raised: that worker is dropped, another loads
    assert len(calls) == 2 and supervisor.is_active
    _assert_logged_once(caplog)
    dropped = [d for d in supervisor.deaths.deaths if d.cause == STOPPED]
    assert len(dropped) == 1 and dropped[0].client is not first and INJECTED in dropped[0].reason

    await _kill_and_wait(client, gateway)   # a later death: still restarted
    assert len(calls) == 3 and supervisor.is_active and supervisor.num_restarts == 3
    _assert_logged_once(caplog)
    r = await client.post("/v1/chat/completions", json={"model": tiny_model.name, "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status == 200


def test_a_remote_replica_whose_admission_raised_is_reached_again_and_its_pools_hear_it_is_new(tiny_model, caplog):
    """The first `replica_ready` raised: the connection is dropped (the replica process kept) and made again,
    and the pools then hear of a new process (`restarted`), since the one that raised never took it in."""
    server = _replica_server(tiny_model)

    async def scenario():
        supervisor, pool = _remote_supervisor(server, _Link(server))
        calls = _fail_once(pool.admission)
        supervisor.backoff = QUICK
        supervisor.start()
        try:
            await _until(lambda: pool.admission.ready)
            assert len(calls) == 2 and pool.admission.ready == [(0, True)] and supervisor.state == "ready"
            first = supervisor.client
            first.lost("the connection dropped (a partition)")   # a later death: reached again
            await _until(lambda: len(pool.admission.ready) == 2)
            assert pool.admission.ready[1] == (0, False) and supervisor.client.pid == first.pid
            assert supervisor.state == "ready" and supervisor.num_restarts == 2
        finally:
            await supervisor.stop()

    with caplog.at_level(logging.INFO, logger="cliffguard.gateway"):
        asyncio.run(scenario())
    _assert_logged_once(caplog)


def test_a_supervision_task_that_ends_anyway_is_logged_and_the_replica_shown_failed(tiny_model, caplog):
    """A fault that escapes even the fault handler ends the task: its done-callback logs it with the traceback,
    and the replica is failed rather than seemingly ready and unwatched."""
    server = _replica_server(tiny_model)

    async def scenario():
        supervisor, pool = _remote_supervisor(server, _Link(server))
        _fail_once(pool.admission)

        async def broken(exc, attempt):
            raise RuntimeError("the fault handler failed too") from exc

        supervisor._after_fault = broken
        supervisor.start()
        waiter = asyncio.create_task(supervisor.wait_ready())   # a request waiting for the replica
        try:
            await _until(lambda: not supervisor.is_active)
            assert supervisor.state.startswith("failed: the gateway's supervision of the replica ended")
            assert not supervisor.is_ready
            with pytest.raises(EngineDeadError, match="supervision of the replica ended"):
                await asyncio.wait_for(waiter, 5)                # woken, not left to its own timeout
        finally:
            await supervisor.stop()

    with caplog.at_level(logging.INFO, logger="cliffguard.gateway"):
        asyncio.run(scenario())
    ended = [r for r in caplog.records if "supervision of the replica ended" in r.getMessage()]
    assert len(ended) == 1 and ended[0].levelno == logging.ERROR and ended[0].exc_info is not None

