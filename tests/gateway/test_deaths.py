"""Deaths counted by cause (`gateway.workers.deaths`, `gateway.completion`): a request is a poison request
only when the deaths under it are its own (a failed step, a hang, a replica lost alone), never when one
fault took several replicas at once; the batch runner follows the same rule (`replica_lost` never
counts). Unit tests of the classification and the verdicts, then two local replicas killed together
under a request (answered, not poison) and a real poison marker on two replicas (500 poison_request)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from types import SimpleNamespace

import pytest

from engine.faults import POISON_ENV
from gateway.batch.endpoints import BATCHES
from gateway.completion import MAX_DEATHS_PER_REQUEST, Completion, _judge, _judge_line
from gateway.openai.errors import ApiError
from gateway.workers.deaths import (FAILURE, HANG, LOSS, STALL, STOPPED, UNREADABLE, DeathsUnder, DeviceDeaths,
                                    Hold, SuspectGate, cause_of, last_line)
from gateway.workers.supervisor import Backoff
from tests.gateway.test_app import _client, _model
from tests.gateway.test_batches import _FakeExecutor, _create, _jsonl, _jsonl_file, _line, _wait
from tests.gateway.test_batches import _client as _batch_client
from tests.gateway.conftest import pools_yaml
from tests.gateway.test_replicas import _all_ready, _replicated

FAST = Backoff(initial_seconds=0.2, max_seconds=1.0)
TRACEBACK = "device worker failed:\nTraceback (most recent call last):\n  File \"x.py\"\nRuntimeError: boom"


def _client_of(name: str, step_failed: bool = False) -> object:
    return SimpleNamespace(name=name, step_failed=step_failed)


def _failed(name: str) -> object:
    """A client whose worker reported a failed step (its `Fatal`, as `engine.client` reads it)."""
    return _client_of(name, step_failed=True)


def _local(retryable: bool = True) -> SimpleNamespace:
    """What `_judge` reads of a `LocalResponse` a worker died under."""
    return SimpleNamespace(request_id="chatcmpl-1", retryable=retryable,
                           error=ApiError(503, "engine unavailable: gone", type="server_error", code="engine_dead"))


# --- the classification ---------------------------------------------------------------------------------

def test_causes_from_what_the_clients_heard():
    """A worker's `Fatal` tells a failed step from a group that lost a rank by a field, not by its words."""
    from engine.client import AsyncEngineClient
    from engine.messages import Fatal

    assert cause_of(_failed("f")) == FAILURE and cause_of(_client_of("l")) == LOSS and cause_of(object()) == LOSS
    for fatal, expected in ((Fatal(TRACEBACK), FAILURE),
                            (Fatal("device worker's group broke: rank 1 exited (signal 9)", group_broke=True), LOSS),
                            (Fatal("device worker: the gateway's commands cannot be read", unreadable=True),
                             UNREADABLE)):
        client = AsyncEngineClient.__new__(AsyncEngineClient)   # only what `_dispatch` reads and sets
        client.step_failed, exits = False, []
        client._on_exit = exits.append
        client._dispatch(fatal)
        assert cause_of(client) == expected and exits[0].startswith("device worker failed:")
    assert last_line(TRACEBACK) == "RuntimeError: boom" and last_line("") == ""


def test_a_worker_that_could_not_read_a_command_is_no_requests_death_even_alone():
    """The gateway's own doing (a frame the worker cannot decode): never counted, even on a device of one
    replica, where a lone loss counts at once (it was recorded as a loss: two made every request poison)."""
    deaths = DeviceDeaths("cpu")
    unreadable = deaths.record(SimpleNamespace(name="u", step_failed=False, commands_unreadable=True), 0,
                               "device worker failed:\ndevice worker: the gateway's commands cannot be read")
    assert unreadable.cause == UNREADABLE and deaths.counts(unreadable) is False


def test_a_loss_counts_only_when_no_other_replica_was_lost_within_the_window():
    deaths = DeviceDeaths("cpu", num_replicas=2, window=2.0)
    a = deaths.record(_client_of("a"), 0, "device worker process exited (signal 9, SIGKILL)", at=100.0)
    assert deaths.counts(a, now=100.5) is None             # undecided while its window is open
    assert deaths.settled_at(a) == 102.0 and deaths.counts(a, now=102.0) is True   # alone: counts
    b = deaths.record(_client_of("b"), 1, "replica cpu/1: connection lost", at=101.5)
    assert deaths.counts(a, now=110) is False and deaths.counts(b, now=101.6) is False   # lost together
    c = deaths.record(_client_of("c"), 1, "replica cpu/1: connection lost", at=104.0)
    assert deaths.counts(c, now=110) is True               # 2.5 s after the last: a loss of its own
    same = deaths.record(_client_of("d"), 0, "device worker process exited", at=104.5)
    assert deaths.counts(same, now=110) is False           # replica 1 was lost 0.5 s before


def test_failures_and_hangs_count_stalls_are_losses_and_a_stop_never_counts():
    deaths = DeviceDeaths("cpu", num_replicas=2)
    now = time.monotonic()
    failed = deaths.record(_failed("f"), 0, TRACEBACK, at=now)
    hung = deaths.record(_client_of("h"), 1, "hung: one step has run for 700 s", HANG, at=now)
    assert deaths.counts(failed) is True and deaths.counts(hung) is True   # whatever else died meanwhile
    stalled = deaths.record(_client_of("s"), 0, "stalled: no word for 10 s", STALL, at=now)
    lost = deaths.record(_client_of("l"), 1, "device worker process exited", at=now + 0.5)
    assert stalled.is_loss and deaths.counts(stalled) is False and deaths.counts(lost) is False
    stopped = deaths.record(_client_of("x"), 0, "the gateway stopped the replica", STOPPED)
    assert deaths.counts(stopped) is False and deaths.settled_at(stopped) == stopped.at


def test_one_record_per_client_the_first_verdict_stays_and_a_lone_replica_decides_at_once():
    deaths = DeviceDeaths("cpu")                            # one replica: no other to lose
    client = _client_of("w")
    stalled = deaths.record(client, 0, "stalled: no word for 10 s", STALL, at=50.0)
    assert deaths.record(client, 0, "device worker process exited (signal 9, SIGKILL)") is stalled
    assert deaths.of(client) is stalled and deaths.of(_client_of("other")) is None
    assert deaths.settled_at(stalled) == 50.0 and deaths.counts(stalled, now=50.0) is True


def test_a_request_finds_a_death_recorded_after_it_saw_it_and_gives_up_after_its_timeout():
    async def scenario():
        deaths = DeviceDeaths("cpu", 2)
        client = _client_of("late")
        waiting = asyncio.ensure_future(deaths.wait_for(client, 5.0))
        await asyncio.sleep(0.01)
        deaths.record(_client_of("other"), 1, "device worker process exited")
        await asyncio.sleep(0.01)
        assert not waiting.done()
        death = deaths.record(client, 0, TRACEBACK)
        assert await waiting is death
        assert await deaths.wait_for(_client_of("never"), 0.05) is None

    asyncio.run(scenario())


# --- the verdicts on a request --------------------------------------------------------------------------

def test_two_failures_make_a_poison_request():
    async def scenario():
        deaths, under, local = DeviceDeaths("cpu", 2), DeathsUnder(), _local()
        under.add(deaths, deaths.record(_failed("a"), 0, TRACEBACK))
        assert await _judge(local, under, False) is True           # the first: run it again
        under.add(deaths, deaths.record(_failed("b"), 1, TRACEBACK))
        assert await _judge(local, under, False) is False
        assert local.error.status == 500 and local.error.code == "poison_request"
        assert "died twice" in local.error.message and "not retried again" in local.error.message

    asyncio.run(scenario())


def test_a_second_death_with_other_suspects_beside_it_is_judged_only_after_one_alone():
    """Two failures, the second while other suspects held the gate beside it: run once more (alone); a
    third failure then makes it a poison request."""
    async def scenario():
        deaths, under, local = DeviceDeaths("cpu", 1), DeathsUnder(), _local()
        for name in ("a", "b"):
            under.add(deaths, deaths.record(_failed(name), 0, TRACEBACK))
            assert await _judge(local, under, True) is True
        under.add(deaths, deaths.record(_failed("c"), 0, TRACEBACK))
        assert await _judge(local, under, False) is False
        assert local.error.code == "poison_request" and "died 3 times" in local.error.message

    asyncio.run(scenario())


def test_a_death_not_its_own_after_a_crowded_one_is_no_poison_verdict():
    """Two failures, the second crowded; on its run alone two replicas are lost together (not its fault):
    no poison request (it was once), the third death of any cause answers 503 engine_dead."""
    async def scenario():
        deaths, under, local = DeviceDeaths("cpu", 2, window=0.2), DeathsUnder(), _local()
        for name in ("a", "b"):
            under.add(deaths, deaths.record(_failed(name), 0, TRACEBACK))
            assert await _judge(local, under, True) is True
        deaths.record(_client_of("other"), 1, "device worker process exited")
        under.add(deaths, deaths.record(_client_of("c"), 0, "device worker process exited"))
        assert await _judge(local, under, False) is False
        assert local.error.status == 503 and local.error.code == "engine_dead"

    asyncio.run(scenario())


def _suspect(under: DeathsUnder, gate: SuspectGate, wait_seconds: float = 5.0,
             max_queue_seconds: float | None = None) -> Completion:
    """A Completion of an HTTP request on one device whose suspect gate is `gate`, routed to a pool with
    `max_queue_seconds`."""
    gateway = SimpleNamespace(config=SimpleNamespace(gateway=SimpleNamespace(device_wait_seconds=wait_seconds)),
                              suspect_gates=lambda pools: [gate], drain_over=False, cuttable=set())
    pool = SimpleNamespace(device="cpu", spec=SimpleNamespace(max_queue_seconds=max_queue_seconds))
    return Completion(gateway, SimpleNamespace(), [(pool, [1])], {}, "/completions", 0.0, "default",
                      http=SimpleNamespace())


def test_a_request_under_a_loss_still_undecided_is_a_suspect_and_waits_its_turn_at_most_device_wait():
    async def scenario():
        deaths, gate = DeviceDeaths("cpu", 2, window=5.0), SuspectGate()
        under = DeathsUnder()
        under.add(deaths, deaths.record(_client_of("a"), 0, "device worker process exited"))
        assert under.verdicts() == [None]                    # a lone loss: its window is still open
        async with _suspect(under, gate)._suspect_gates(under, Hold()) as hold:
            assert not hold.exclusive and gate._shared        # it holds the gate beside the others
        async with gate.shared():                            # another suspect runs: an exclusive turn waits
            crowded_twice = DeathsUnder([*under.seen, *under.seen])
            with pytest.raises(ApiError) as info:
                async with _suspect(crowded_twice, gate, 0.1)._suspect_gates(crowded_twice, Hold(crowded=True)):
                    pass
        assert info.value.status == 503 and info.value.code == "pool_unavailable"
        async with gate.shared():                            # a pool's max_queue_seconds shorter: that is the bound
            started = time.monotonic()
            with pytest.raises(ApiError) as info:
                async with _suspect(crowded_twice, gate, 30, 0.2)._suspect_gates(crowded_twice, Hold(crowded=True)):
                    pass
        assert info.value.status == 503 and 0.2 <= time.monotonic() - started < 5

    asyncio.run(scenario())


def test_a_request_reaching_its_run_after_the_drain_ended_is_answered_503_at_once():
    completion = _suspect(DeathsUnder(), SuspectGate())
    completion.gateway.drain_over = True
    with pytest.raises(ApiError) as info:
        asyncio.run(completion._run_cuttable(SimpleNamespace(), None))
    assert info.value.status == 503 and info.value.code == "server_shutting_down"


def test_the_suspect_gate_marks_holds_side_by_side_and_runs_one_alone_after_them():
    async def scenario():
        gate, order = SuspectGate(), []

        async def alone() -> None:
            async with gate.exclusive() as hold:
                order.append(("alone", hold.exclusive, hold.crowded))

        async with gate.shared() as first:
            assert not first.crowded
            async with gate.shared() as second:
                assert first.crowded and second.crowded
            waiting = asyncio.ensure_future(alone())
            await asyncio.sleep(0.01)
            assert not order                                   # it waits for the shared hold in flight
            late = asyncio.ensure_future(gate.shared().__aenter__())
            await asyncio.sleep(0.01)
            assert not late.done()                             # a waiting exclusive hold goes first
        await waiting
        assert order == [("alone", True, False)]
        assert not (await late).crowded

    asyncio.run(scenario())


def test_replicas_lost_together_are_no_poison_and_the_retries_are_still_bounded():
    async def scenario():
        deaths, under, local = DeviceDeaths("cpu", 2, window=0.2), DeathsUnder(), _local()
        for i in range(MAX_DEATHS_PER_REQUEST - 1):
            under.add(deaths, deaths.record(_client_of(f"a{i}"), i % 2, "device worker process exited"))
            assert await _judge(local, under, False) is True
        started = time.monotonic()
        under.add(deaths, deaths.record(_client_of("last"), 1, "replica cpu/1: connection lost"))
        assert await _judge(local, under, False) is False
        assert time.monotonic() - started < 0.15              # decided without waiting: others were lost beside it
        assert local.error.status == 503 and local.error.code == "engine_dead"
        assert local.error.headers["Retry-After"] == "2" and f"{MAX_DEATHS_PER_REQUEST} times" in local.error.message

    asyncio.run(scenario())


def test_two_lone_losses_make_a_poison_request_once_their_windows_have_passed():
    async def scenario():
        deaths, under, local = DeviceDeaths("cpu", 2, window=0.2), DeathsUnder(), _local()
        under.add(deaths, deaths.record(_client_of("a"), 0, "device worker process exited", at=time.monotonic() - 1))
        assert await _judge(local, under, False) is True
        started = time.monotonic()
        under.add(deaths, deaths.record(_client_of("b"), 1, "device worker process exited"))
        assert await _judge(local, under, False) is False            # it waited for b's window: nothing else was lost
        assert time.monotonic() - started >= 0.18 and local.error.code == "poison_request"

    asyncio.run(scenario())


def test_a_streamed_request_keeps_its_engine_dead():
    async def scenario():
        deaths, under, local = DeviceDeaths("cpu", 2), DeathsUnder(), _local(retryable=False)
        under.add(deaths, deaths.record(_failed("a"), 0, TRACEBACK))
        assert await _judge(local, under, False) is False and local.error.code == "engine_dead"

    asyncio.run(scenario())


def test_a_batch_line_hears_engine_dead_for_its_own_death_and_replica_lost_for_the_others():
    async def scenario():
        deaths = DeviceDeaths("cpu", 2, window=0.1)
        own = DeathsUnder()
        own.add(deaths, deaths.record(_failed("f"), 0, TRACEBACK))
        assert (await _judge_line(_local(), own)).error.code == "engine_dead"
        together, local = DeathsUnder(), _local()
        together.add(deaths, deaths.record(_client_of("a"), 0, "device worker process exited"))
        deaths.record(_client_of("b"), 1, "replica cpu/1: connection lost")
        assert (await _judge_line(local, together)).error.code == "replica_lost"
        assert local.error.status == 503 and local.error.headers["Retry-After"] == "2"
        alone, local = DeathsUnder(), _local()
        time.sleep(0.15)                                      # past the others' window
        alone.add(deaths, deaths.record(_client_of("c"), 1, "device worker process exited"))
        assert (await _judge_line(local, alone)).error.code == "engine_dead"   # after its window: alone

    asyncio.run(scenario())


async def test_the_batch_runner_retries_replica_lost_and_never_counts_it(aiohttp_client, tmp_path, tiny_model):
    fake = _FakeExecutor(scripted={"lost": [(503, "replica_lost")] * 3,
                                   "mixed": [(503, "replica_lost"), (503, "engine_dead"), (503, "replica_lost")]})
    client = await _batch_client(aiohttp_client, tmp_path, tiny_model, fake)
    done = await _wait(client, (await _create(client, _jsonl(_line("lost"), _line("mixed"))))["id"])
    assert done["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert fake.calls == {"lost": 4, "mixed": 4}               # three transient answers each, then the answer
    assert await _jsonl_file(client, done["error_file_id"]) == []
    client.app[BATCHES].store.check_integrity()


# --- two local replicas ----------------------------------------------------------------------------------

async def _wait_in_flight(client_of, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while client_of().num_in_flight < 1:
        assert time.monotonic() < deadline, "the request never reached the replica"
        await asyncio.sleep(0.005)


async def test_two_replicas_lost_together_under_a_request_are_not_its_fault(aiohttp_client, tmp_path, tiny_model):
    client, gateway = await _client(aiohttp_client, _replicated(tiny_model), tmp_path)
    await _all_ready(client)
    supervisors = gateway.supervisors["cpu"]
    for supervisor in supervisors:
        supervisor.backoff = FAST
    body = {"model": _model(tiny_model), "prompt": "Tell me about the cliffs of the north.", "max_tokens": 100,
            "temperature": 0, "ignore_eos": True}
    answer = asyncio.ensure_future(client.post("/v1/completions", json=body))
    deadline = time.monotonic() + 30
    while not any(s.client.num_in_flight for s in supervisors):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)
    first = next(s for s in supervisors if s.client.num_in_flight)
    other = supervisors[1 - first.replica]
    os.kill(first.client.pid, signal.SIGKILL)
    await _wait_in_flight(lambda: other.client)              # run again on the other replica ...
    os.kill(other.client.pid, signal.SIGKILL)                # ... which is lost too, moments later
    r = await answer
    body = await r.json()
    assert r.status == 200, body                             # not a poison request: it ran a third time
    assert body["usage"]["completion_tokens"] == 100
    deaths = first.deaths
    assert deaths is other.deaths
    lost = [d for d in deaths.deaths if d.cause == LOSS]
    assert {d.replica for d in lost} == {0, 1} and not any(deaths.counts(d) for d in lost)
    await _all_ready(client)


async def test_a_request_run_again_after_its_worker_died_is_observed_once(aiohttp_client, tmp_path, tiny_model):
    """Its first run streamed tokens inside the gateway (a JSON answer: the client saw none) when its worker died;
    it runs again and its client waits for one answer: one TTFT, one end-to-end latency, not two. Its second
    wait for credits counts from its arrival moved on by its first run (max_queue_seconds counts waits only)."""
    client, gateway = await _client(aiohttp_client, pools_yaml(tiny_model), tmp_path)
    await _all_ready(client)
    runs, admitted = [], gateway.admission.admitted   # (received, admitted at, left at) of each run

    @contextlib.asynccontextmanager
    async def watched(*args, **kwargs):
        async with admitted(*args, **kwargs) as placed:
            entered = time.perf_counter()
            try:
                yield placed
            finally:
                runs.append((kwargs["received"], entered, time.perf_counter()))

    gateway.admission.admitted = watched
    supervisors = gateway.supervisors["cpu"]
    for supervisor in supervisors:
        supervisor.backoff = FAST
    pool = next(name for name, p in gateway.pools.items() if not p.is_upstream)
    series = gateway.metrics.pool_series(pool)
    body = {"model": _model(tiny_model), "prompt": "Tell me about the cliffs of the north.", "max_tokens": 100,
            "temperature": 0, "ignore_eos": True}
    answer = asyncio.ensure_future(client.post("/v1/completions", json=body))
    deadline = time.monotonic() + 30
    while series.generation_tokens._value.get() < 1:                # its first run's tokens came
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)
    os.kill(next(s for s in supervisors if s.client.num_in_flight).client.pid, signal.SIGKILL)
    r = await answer
    assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 100
    sample = gateway.metrics.registry.get_sample_value
    assert sample("cliffguard_time_to_first_token_seconds_count", {"pool": pool}) == 1
    assert sample("cliffguard_e2e_request_latency_seconds_count", {"pool": pool}) == 1
    (first, entered, left), (second, _, _) = runs
    assert 0.8 * (left - entered) <= second - first <= left - entered, runs
    await _all_ready(client)
    # Two prompts, the first stopped early by a stop string of its own text: its choice ended before the worker
    # died, ran again and ended again; the request's two choices count in request_success twice, not three times.
    prompts = ["Tell me about the cliffs of the north.", "Tell me about the sea."]
    whole = await (await client.post("/v1/completions", json={**body, "prompt": prompts, "max_tokens": 200})).json()
    texts = [c["text"] for c in sorted(whole["choices"], key=lambda c: c["index"])]
    stop = next(texts[0][i:i + 4] for i in range(1, 40) if texts[0][i:i + 4] not in texts[1])
    success = [s for s in gateway.metrics.request_success.collect()[0].samples if s.name.endswith("_total")]
    before = sum(s.value for s in success)
    generated, deadline = series.generation_tokens._value.get(), time.monotonic() + 60
    answer = asyncio.ensure_future(client.post("/v1/completions", json={
        **body, "prompt": prompts, "stop": [stop], "max_tokens": 200}))   # the second runs long after the first
    while series.generation_tokens._value.get() < generated + 60:    # the first choice ended, the second runs
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)
    os.kill(next(s for s in supervisors if s.client.num_in_flight).client.pid, signal.SIGKILL)
    r = await answer
    reasons = sorted(c["finish_reason"] for c in (await r.json())["choices"])
    assert r.status == 200 and reasons == ["length", "stop"]
    success = [s for s in gateway.metrics.request_success.collect()[0].samples if s.name.endswith("_total")]
    assert sum(s.value for s in success) - before == 2
    await _all_ready(client)


@pytest.mark.parametrize("marker", ["qqz-poison-2b7e"])
async def test_a_request_that_fails_the_step_on_both_replicas_is_still_a_poison_request(
        aiohttp_client, tmp_path, tiny_model, monkeypatch, marker):
    monkeypatch.setenv(POISON_ENV, marker)                   # read by each worker when it starts
    client, gateway = await _client(aiohttp_client, _replicated(tiny_model), tmp_path)
    await _all_ready(client)
    for supervisor in gateway.supervisors["cpu"]:
        supervisor.backoff = FAST
    r = await client.post("/v1/completions", json={"model": _model(tiny_model), "prompt": f"Say {marker} once.",
                                                   "max_tokens": 8, "temperature": 0})
    body = await r.json()
    assert r.status == 500 and body["error"]["code"] == "poison_request", body
    assert r.headers["x-should-retry"] == "false"            # the openai SDK would send it twice more
    assert "died twice" in body["error"]["message"]
    deaths = gateway.supervisors["cpu"][0].deaths
    assert sorted(d.replica for d in deaths.deaths if d.cause == FAILURE) == [0, 1]   # one step failure on each
    await _all_ready(client)
    assert [s.num_restarts for s in gateway.supervisors["cpu"]] == [1, 1]             # never a third run
