"""The device worker process and its async client: streaming, concurrency, aborts, refusals."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import struct
import time

import msgspec
import pytest

from engine.client import AsyncEngineClient, EngineDeadError, start_fork_server
from engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.messages import Outputs
from engine.outputs import RequestDelta
from engine.sampling import SamplingParams
from engine.stats import EngineStats, WorkerInfo
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def config(builtin_path):
    # 91 blocks of 16 tokens: 64 MiB of SmolLM2's float32 K/V (46,080 B/token)
    return EngineConfig(model=str(builtin_path), cache=CacheConfig(block_size=16), pools=(
        PoolConfig(num_blocks=91, scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=2048)),))


async def _collect(client, prompt, params, **kwargs):
    text, outs = "", []
    async for out in client.generate(prompt, params, **kwargs):
        text += out.outputs[0].delta_text
        outs.append(out)
    return text, outs


def test_client_streams_the_same_text_as_the_offline_engine(config):
    prompts = ["The capital of France is", "Once upon a time", "def add(a, b):"]
    params = SamplingParams(temperature=0, max_tokens=8)
    offline = LLMEngine(config, progress=False).generate(prompts, params)

    async def main():
        async with AsyncEngineClient(config) as client:
            assert isinstance(client.info, WorkerInfo) and client.info.pools["default"].max_num_seqs == 8
            assert client.info.pools["default"].num_blocks == client.info.num_blocks == 91
            assert client.model_path == client.info.model_path
            results = await asyncio.gather(*(_collect(client, p, params) for p in prompts))
            stats = await client.stats(check=True)
            return results, stats

    results, stats = asyncio.run(main())
    for (text, outs), want in zip(results, offline):
        assert text == want.outputs[0].text
        assert outs[-1].finished and len(outs) > 1  # streamed in several deltas
    assert isinstance(stats, EngineStats) and stats.num_requests == 0
    assert stats.pools["default"].num_free_blocks == stats.pools["default"].num_blocks
    assert stats.step.num_steps > 0 and stats.pools["default"].num_computed_tokens > 0
    assert stats.pools["default"].num_generated_tokens == sum(outs[-1].outputs[0].num_tokens for _, outs in results)


def test_leaving_a_stream_early_aborts_and_a_bad_request_leaves_others_running(config):
    async def main():
        async with AsyncEngineClient(config) as client:
            long_params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            survivor = asyncio.create_task(_collect(client, "Count to twenty:", SamplingParams(
                temperature=0, max_tokens=16, ignore_eos=True)))
            async for out in client.generate("Tell me a long story.", long_params, request_id="quit"):
                if out.outputs[0].num_tokens >= 3:
                    break  # like a client disconnect
            with pytest.raises(ValueError, match="max_model_len"):
                await _collect(client, "hi", SamplingParams(max_tokens=5000))
            text, outs = await survivor
            assert outs[-1].outputs[0].finish_reason == "length" and text
            await asyncio.sleep(0.2)  # the abort travels to the worker
            return await client.stats(check=True)

    stats = asyncio.run(main())
    pool = stats.pools["default"]
    assert stats.num_requests == 0 and pool.num_free_blocks == pool.num_blocks
    assert pool.num_aborted >= 1                             # the stream left early


def test_startup_failure_is_reported(tmp_path):
    async def main():
        client = AsyncEngineClient(EngineConfig(model=str(tmp_path / "missing")))
        with pytest.raises(RuntimeError, match="missing"):
            await client.start()
        assert client.died.done() and not client.is_alive   # the process was reaped

    asyncio.run(main())


def test_what_the_worker_sends_per_step_does_not_grow_with_the_request(tiny_config):
    """Each step's message carries deltas: the bytes do not grow with the prompt or the output so far."""
    engine = LLMEngine(tiny_config, progress=False)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)

    def sizes(prompt: list[int]) -> list[int]:
        engine.add_request("r", prompt, params)
        out = []
        while engine.has_unfinished_requests():
            for step_out in engine.step():
                if not step_out.finished:
                    out.append(len(pickle.dumps(Outputs([RequestDelta.from_output(step_out)]))))
        return out

    short, long = sizes(list(range(100, 110))), sizes(list(range(100, 500)))
    assert len(short) == len(long) == 47
    assert max(long) - min(short) < 100, (min(short), max(short), min(long), max(long))
    assert max(long[-10:]) < min(long[:10]) + 40        # the 48th token costs what the 2nd did


def test_step_trace_writes_one_json_line_per_step(config, tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("CLIFFGUARD_STEP_TRACE", str(path))

    async def main():
        async with AsyncEngineClient(config) as client:
            return await _collect(client, "Hello there", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))

    text, outs = asyncio.run(main())
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 5                                       # a prefill step, then four decodes
    assert lines[0]["num_prefill_tokens"] > 1 and all(s["num_decode_tokens"] == 1 for s in lines[1:])
    assert all(s["seconds"] > 0 and s["pool_tokens"] == {"default": s["num_prefill_tokens"] + s["num_decode_tokens"]}
               for s in lines)
    assert all(s["target_seconds"] is None for s in lines)      # one pool, no SLO: no target
    assert all(s["cycle_seconds"] >= s["seconds"] for s in lines)   # the loop's turn holds the step
    assert all(s["new_variants"] == [] for s in lines)           # the CPU backend compiles nothing


def test_step_trace_names_the_kernel_variants_a_step_compiled(tmp_path, monkeypatch):
    """A step during which the backend compiled a kernel variant carries its key in `new_variants`; the
    steps before and after carry none (the variants compiled before serving are the baseline)."""
    from types import SimpleNamespace

    from engine.stats import StepStats
    from engine.worker import _StepTrace

    compiled = {"attn: a"}
    backend = SimpleNamespace(compiled_variants=lambda: frozenset(compiled))
    engine = SimpleNamespace(runner=SimpleNamespace(backend=backend), last_step=StepStats(seconds=0.01))
    monkeypatch.setenv("CLIFFGUARD_STEP_TRACE", str(tmp_path / "steps.jsonl"))
    trace = _StepTrace.from_env(engine)
    trace.write(engine, 0.0)
    compiled.update({"attn: b", "reduce: c"})
    trace.write(engine, 0.0)
    trace.write(engine, 0.0)
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [s["new_variants"] for s in lines] == [[], ["attn: b", "reduce: c"], []]
    monkeypatch.delenv("CLIFFGUARD_STEP_TRACE")
    assert _StepTrace.from_env(engine) is None


# --- a worker that dies ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory, builtin_path):
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny-worker"), "llama", builtin_path)
    return EngineConfig(model=str(folder), cache=CacheConfig(block_size=8), pools=(PoolConfig(num_blocks=128),))


def _open_fds() -> set[tuple[str, str]]:
    """This process's open file descriptors, each with what it points to (a number reused is another file),
    the workers' fork server running (its pipes stay open for the process's life). Compared as sets: a file
    another test left open may be closed meanwhile (by the GC), which is no leak."""
    start_fork_server()
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:   # the listing's own descriptor, closed by now
            pass
    return fds


def test_a_killed_worker_fails_its_streams_at_once_and_is_reaped(tiny_config):
    long_params = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)

    async def main():
        fds = _open_fds()
        client = AsyncEngineClient(tiny_config)
        await client.start()
        stream = client.generate([5, 6, 7], long_params)
        await anext(stream)                      # in flight
        fds_used = (client._channel.fileno(), client._sentinel)
        os.kill(client.pid, signal.SIGKILL)
        reason = "device worker process exited (signal 9, SIGKILL)"
        with pytest.raises(EngineDeadError) as failed:
            async with asyncio.timeout(5):
                async for _ in stream:
                    pass
        assert str(failed.value) == reason and not client.is_alive
        assert await asyncio.wait_for(client.died, 5) == reason and client.exitcode == -9
        with pytest.raises(EngineDeadError, match="exited"):
            await _collect(client, "hi", long_params)
        with pytest.raises(EngineDeadError):
            await client.stats(check=True)
        await client.shutdown()                  # after a death: nothing left to do, no error
        assert not any(asyncio.get_running_loop().remove_reader(fd) for fd in fds_used)   # no reader left
        assert _open_fds() <= fds                 # pipe and sentinel closed
        return client

    client = asyncio.run(main())
    assert client.died.result().endswith("(signal 9, SIGKILL)")


def test_a_worker_whose_gateway_is_gone_mid_step_ends_without_waiting_for_the_step(tiny_config, monkeypatch):
    """The gateway is killed while a step runs (here one held 60 s): the worker learns it from its heartbeat
    and ends LAST_WORDS_SECONDS later, so that it frees the device for the gateway that replaces it; it no
    longer ran until the step ended (or forever, the step hung)."""
    from engine.faults import SLOW_STEP_ENV
    from engine.worker import LAST_WORDS_SECONDS

    monkeypatch.setenv(SLOW_STEP_ENV, "SLOW:60")

    async def main():
        client = AsyncEngineClient(tiny_config)
        await client.start()
        process = client._process
        stream = client.generate("be SLOW", SamplingParams(max_tokens=4))
        pending = asyncio.ensure_future(anext(stream))
        async with asyncio.timeout(30):
            while client.last_step_seconds < 0.5:        # the held step runs
                await asyncio.sleep(0.1)
        client._loop.remove_reader(client._channel.fileno())
        client._channel.close()                          # the gateway's end closes, as when it is killed
        gone = time.monotonic()
        await asyncio.to_thread(process.join, LAST_WORDS_SECONDS + 10)
        ended = time.monotonic() - gone
        pending.cancel()
        return process.exitcode, ended

    exitcode, ended = asyncio.run(main())
    assert exitcode == 1 and ended < 15, (exitcode, ended)


def test_a_frame_from_the_worker_that_cannot_be_read_ends_it_at_once_as_no_requests_fault(tiny_config):
    """The gateway cannot decode what the worker sent (a corrupt stream): the worker is killed now and what is
    in flight fails at once, the death the link's (it never counts against a request), not a loss found when
    the process is reaped ten seconds later."""
    from engine.ipc import FrameError
    from gateway.workers.deaths import UNREADABLE, cause_of

    async def main():
        client = AsyncEngineClient(tiny_config)
        await client.start()
        stream = client.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        first = await anext(stream)

        def corrupt():
            raise FrameError("ipc: a frame of 4294967295 bytes: the stream is corrupt")

        client._channel.receive = corrupt
        began = time.monotonic()
        client._on_readable()
        with pytest.raises(EngineDeadError, match="device worker: unreadable frame"):
            async for _ in stream:
                pass
        await asyncio.wait_for(asyncio.shield(client.died), 5)
        return first, time.monotonic() - began, cause_of(client)

    first, took, cause = asyncio.run(main())
    assert first.outputs and took < 3 and cause == UNREADABLE, (took, cause)


async def _loading(config: EngineConfig) -> tuple[AsyncEngineClient, asyncio.Future]:
    """A client whose worker was launched and is loading (CLIFFGUARD_FAULT_SLOW_LOAD holds it); its `start`."""
    client = AsyncEngineClient(config)
    starting = asyncio.ensure_future(client.start())
    async with asyncio.timeout(30):
        while client._channel is None:
            await asyncio.sleep(0.05)
    return client, starting


def test_a_worker_whose_gateway_is_gone_while_it_loads_ends_at_once(tiny_config, monkeypatch):
    """The gateway is killed while its worker loads a model (here a load held 60 s): the worker ends within a
    second, freeing the device for the gateway that replaces it, instead of loading on (then stepping nothing
    until a heartbeat finds the socket closed); also when the gateway had sent it a command meanwhile (a
    restarted worker's admission reports reach it while it loads), which the worker has not read."""
    from engine.faults import SLOW_LOAD_ENV

    monkeypatch.setenv(SLOW_LOAD_ENV, "60")

    async def main():
        client, starting = await _loading(tiny_config)
        client.report_waiting("default", 3)              # a command it reads only once loaded
        await asyncio.sleep(0.5)
        process = client._process
        client._loop.remove_reader(client._channel.fileno())
        client._loop.remove_reader(client._sentinel)
        client._channel.close()                          # the gateway's end closes, as when it is killed
        gone = time.monotonic()
        await asyncio.to_thread(process.join, 20)
        ended = time.monotonic() - gone
        starting.cancel()
        return process.exitcode, ended

    exitcode, ended = asyncio.run(main())
    assert exitcode == 1 and ended < 5, (exitcode, ended)


def test_a_worker_stopped_while_it_loads_ends_at_once(tiny_config, monkeypatch):
    """`shutdown` while the model loads (the gateway stops, the autoscaler parks a replica): the worker, which
    reads no command before it is loaded, ended only once SIGKILLed after the whole grace period (10 s)."""
    from engine.faults import SLOW_LOAD_ENV

    monkeypatch.setenv(SLOW_LOAD_ENV, "60")

    async def main():
        client, starting = await _loading(tiny_config)
        await asyncio.sleep(0.5)
        began = time.monotonic()
        await client.shutdown(timeout=10)
        took = time.monotonic() - began
        with pytest.raises(EngineDeadError, match="engine shut down"):
            await starting
        return client.exitcode, took

    exitcode, took = asyncio.run(main())
    assert exitcode == 1 and took < 5, (exitcode, took)


def _cpu_seconds(pid: int) -> float:
    """The user + system CPU seconds process `pid` has used (/proc/PID/stat)."""
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_worker_whose_waiting_request_needs_blocks_a_paused_one_holds_sleeps_instead_of_spinning(tiny_config):
    """a holds 7 of the pool's 8 blocks and is paused (its client reads slowly); b waits for 3 of them. Every step
    ran nothing and the worker stepped again at once, a core at 100% until a resumed; now it sleeps until a
    command, and both finish once a resumes. (a's last 9 tokens race its pause: where a finished first, b ran,
    and the scene is set again.)"""
    config = EngineConfig(model=tiny_config.model, cache=CacheConfig(block_size=8), pools=(PoolConfig(num_blocks=8),))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    async def main():
        async with AsyncEngineClient(config) as client:
            for attempt in range(3):
                a = client.generate(list(range(5, 55)), params, request_id=f"a{attempt}")
                await anext(a)
                client.pause(f"a{attempt}", True)
                b = asyncio.ensure_future(_collect(client, list(range(100, 120)), params))
                await asyncio.sleep(0.5)    # b reaches the worker, which finds no blocks for it
                if b.done():                # a finished before its pause landed: no paused holder
                    await a.aclose()
                    continue
                before = _cpu_seconds(client.pid)
                await asyncio.sleep(1.0)
                spent = _cpu_seconds(client.pid) - before
                assert not b.done() and spent < 0.3, spent
                client.pause(f"a{attempt}", False)
                rest = [out async for out in a]
                text, outs = await asyncio.wait_for(b, 10)
                assert rest[-1].finished and outs[-1].finished and outs[-1].outputs[0].num_tokens == 10
                return
            pytest.fail("a finished before its pause landed three times")

    asyncio.run(main())


def test_shutdown_reaps_and_a_client_starts_once(tiny_config):
    async def main():
        fds = _open_fds()
        async with AsyncEngineClient(tiny_config) as client:
            pass
        assert client.died.result() == "engine shut down" and client.exitcode == 0 and not client.is_alive
        assert _open_fds() <= fds
        with pytest.raises(RuntimeError, match="once"):
            await client.start()

    asyncio.run(main())


def test_a_command_the_worker_cannot_read_is_the_links_loss_not_the_requests(tiny_config):
    """A frame that does not decode (a gateway of other code) ends the worker as a broken link: its requests
    may run elsewhere. As a failed step it counted as the death of every request in flight (poison)."""
    async def main():
        client = AsyncEngineClient(tiny_config)
        await client.start()
        stream = client.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=480, ignore_eos=True))
        await anext(stream)
        body = msgspec.msgpack.encode(["AbortRequest", {"request_id": 7}])   # the id of the wrong type
        client._channel.sock.send(struct.pack("!Q", len(body)) + body)
        with pytest.raises(EngineDeadError, match="commands cannot be read"):
            async with asyncio.timeout(10):
                async for _ in stream:
                    pass
        assert client.commands_unreadable and not client.step_failed   # gateway.workers.deaths: UNREADABLE
        await client.shutdown()

    asyncio.run(main())


def test_the_integrity_check_runs_only_where_a_stats_query_asks_for_it(monkeypatch):
    """It walks every block between two steps, and a failure ends the worker: the autoscaler's drain poll
    (`stats()`, twice a second) never runs it; tests ask for it (`stats(check=True)`)."""
    import engine.worker as worker
    from engine.messages import StatsQuery, StatsReply

    checks, sent = [], []
    monkeypatch.setattr(worker, "engine_stats", lambda engine, check=False: checks.append(check) or "stats")
    channel = type("Channel", (), {"send": lambda self, msg: sent.append(msg)})()
    for query in (StatsQuery(), StatsQuery(check=True)):
        assert worker._handle(None, channel, query) is False
    assert checks == [False, True] and sent == [StatsReply("stats"), StatsReply("stats")]


def test_a_batch_lines_request_reaches_the_engine_as_one():
    """`AddRequest.background` (the gateway sets it for a batch line) is passed to the engine, which queues it
    after the interactive requests; it was read by the sessions only."""
    import engine.worker as worker
    from engine.messages import AddRequest
    from engine.sampling import SamplingParams

    added = []

    class Engine:
        def add_request(self, request_id, prompt, params, **kwargs):
            added.append((request_id, kwargs))
    channel = type("Channel", (), {"send": lambda self, msg: None})()
    worker._handle_request(Engine(), channel, AddRequest("r", [1, 2], SamplingParams(), background=True), None)
    assert added == [("r", {"priority": 0, "pool": None, "cache_salt": None, "background": True})]
