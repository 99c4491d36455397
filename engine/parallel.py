"""Tensor parallelism: one device's model and KV cache split over `tensor_parallel_size` ranks.

Rank 0, the device worker process, runs the whole engine (schedulers, step composer, sampler) as with one rank and
spawns ranks 1..T-1 (`TensorParallelGroup.start`): processes (`engine.model_runner.follower_main`) holding their
shard of the weights and KV cache, doing what rank 0 says. Each step rank 0 sends one `StepPlan` (the merged batch's
token ids, positions and block tables, the block copies and swaps to do first) to every follower; every rank runs
the same forward pass on its shard (two all-reduces a layer, an all-gather of the logits rank 0 samples from). The
ranks meet through rank 0's store (`engine.rendezvous`): a follower that ends before it joins fails the start at once.

**Liveness.** Plans travel on a socket pair per follower (`PlanLink`: length-prefixed pickles), not on a collective:
a follower waits for its next plan in a plain blocking read, which has no timeout, so a group idle for hours stays
whole. Collectives (NCCL on CUDA, gloo on a CPU) run only inside a step, under
`EngineConfig.collective_timeout_seconds` (the device key `collective_timeout_seconds`,
`DEFAULT_COLLECTIVE_TIMEOUT_SECONDS`): a rank that has not reached a collective that long after another is hung, the
collective fails, the step fails and the worker is restarted whole. Joining the group (the rendezvous) has its own
bound, `engine.rendezvous.INIT_TIMEOUT_SECONDS`. After loading, each follower says `ready` on its link, and rank 0
watches the links from a thread (`TensorParallelGroup.wait_ready` starts it): a follower's end closes when its process
ends, however it ends (`kill -9`, the OOM killer, a crash), and rank 0 then calls `on_rank_exit` with the reason, which
the device worker turns into its own death (`engine.worker`: a `Fatal` saying the group broke, then exit) within
milliseconds, idle or mid-step (a follower that ended by itself, its step failed, `OWN_END_SECONDS` later: rank 0's
failed step is said first, `engine.worker`): the gateway restarts the worker as it restarts any dead worker. A follower
that loses rank 0 dies with it (`PR_SET_PDEATHSIG`, and its link's end-of-file). A follower is spawned (`python -c`), or
forked from the fork server where rank 0's process runs one (`engine.fork_server.start_follower`).

How a model is cut (`ShardShape`), Megatron-style:
- q/k/v and gate/up are column-parallel: rank r holds heads `[r·H/T, (r+1)·H/T)` and a 1/T slice of the MLP's
  intermediate rows; o_proj and down_proj are row-parallel (an all-reduce of their outputs, the bias added on rank 0
  only);
- KV heads are split like query heads when T divides them; when the model has fewer KV heads than ranks (T a multiple
  of them), each rank holds the KV head its query heads read: replicated T / num_kv_heads times, as the plan assumes;
- the embedding and the LM head are vocab-parallel: each rank holds ceil(V/T) rows (zero-padded at the end), a
  lookup outside its rows reads zeros before the all-reduce, and the logits are gathered.
Rules on the shape live in `check_tensor_parallel`, which the capacity plan and the engine both call."""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.config import ConfigError, ceil_div
from engine.fork_server import start_follower
from engine.gemma4_config import rank_kv_heads
from engine.minimax_m3_config import index_key_bytes
from engine.model_config import ModelConfig
from engine.rendezvous import describe_exit, join_group, serve_store

log = logging.getLogger("cliffguard.engine")

LOAD_TIMEOUT_SECONDS = 3600   # how long rank 0 waits for its followers to load their shards and say ready
OWN_END_SECONDS = 1.0   # a follower that ended by itself (its step failed): rank 0's failed step is said first
_READY = b"R"
_FAILED = b"F"   # a follower that could not load: its reason follows, up to MAX_REASON_BYTES, then it exits
MAX_REASON_BYTES = 4096
_LENGTH = struct.Struct("<Q")
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ShardShape:
    """What one rank of a tensor-parallel group holds of a model (every count is this rank's)."""

    rank: int
    size: int                 # tensor_parallel_size
    num_heads: int            # query heads
    num_kv_heads: int         # KV heads (a replica of one when size > the model's KV heads)
    head_start: int           # first query head
    kv_head_start: int        # first KV head
    intermediate_size: int    # rows of gate and of up
    moe_intermediate_size: int   # rows of each expert's gate and up (0: no experts)
    vocab_rows: int           # rows of the embedding and LM head shards (ceil(V / size))
    vocab_size: int           # the model's whole vocabulary
    shared_expert_intermediate_size: int = 0   # rows of the shared expert's gate and up (Qwen2-MoE; 0: none)

    @classmethod
    def of(cls, model: ModelConfig, rank: int = 0, size: int = 1) -> ShardShape:
        check_tensor_parallel(model, size)
        if not 0 <= rank < size:
            raise ConfigError(f"rank: must be in 0..{size - 1}, got {rank}")
        heads = model.num_heads // size
        if model.num_kv_heads % size == 0:
            kv_heads = model.num_kv_heads // size
            kv_start = rank * kv_heads
        else:   # size is a multiple of num_kv_heads: one KV head per rank, replicated
            kv_heads = 1
            kv_start = rank // (size // model.num_kv_heads)
        return cls(rank=rank, size=size, num_heads=heads, num_kv_heads=kv_heads, head_start=rank * heads,
                   kv_head_start=kv_start, intermediate_size=model.intermediate_size // size,
                   moe_intermediate_size=model.moe_intermediate_size // size,
                   vocab_rows=ceil_div(model.vocab_size, size), vocab_size=model.vocab_size,
                   shared_expert_intermediate_size=model.shared_expert_intermediate_size // size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    @property
    def num_vocab_rows_used(self) -> int:
        """Rows of this rank's vocab shard that hold real tokens (the last rank's tail is padding)."""
        return max(0, min(self.vocab_size, self.vocab_start + self.vocab_rows) - self.vocab_start)

    def heads_of(self, tensor: torch.Tensor, per_head: int = 1, dim: int = 0) -> torch.Tensor:
        """This rank's query heads' part of `tensor`, `per_head` rows (or columns: `dim`) a head: their sinks, gates'
        rows, o_proj's columns."""
        return tensor.narrow(dim, self.head_start * per_head, self.num_heads * per_head)

    def num_params(self, model: ModelConfig) -> int:
        """Parameters this rank holds: its query heads, its KV heads (replicated when the group outnumbers
        them), its MLP and expert rows, its padded vocab rows; the norms, the router and the row-parallel
        biases whole on every rank (`engine.model`). What the capacity plan sets aside for its weights."""
        return model.count_params(self.num_heads, self.num_kv_heads, self.intermediate_size,
                                  self.moe_intermediate_size, self.vocab_rows, self.shared_expert_intermediate_size)

    def kv_bytes_per_token(self, model: ModelConfig, dtype: torch.dtype) -> int:
        """This rank's S_KV: kv_planes (K and V: 2) x num_kv_layers x its KV heads x head_dim x dtype bytes (each
        layer's heads and head size: Gemma 4's full layers have their own); MiniMax M3's indexer keys whole."""
        return model.kv_planes * dtype.itemsize * sum(rank_kv_heads(heads, self.size) * dim for heads, dim in map(
            model.layer_kv_shape, model.kv_layers)) + index_key_bytes(model, dtype.itemsize)


def check_tensor_parallel(model: ModelConfig, size: int, key: str = "tensor_parallel_size") -> None:
    """ConfigError naming `key` when `size` ranks cannot split `model`: it must divide the attention
    heads and the MLP's intermediate size, and divide the KV heads or be a multiple of them."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"{key}: must be an integer >= 1, got {size!r}")
    if model.deepseek_v4 is not None and model.deepseek_v4.o_groups % size:   # each rank whole groups of heads
        raise ConfigError(f"{key}: {size} does not divide DeepSeek V4's o_groups {model.deepseek_v4.o_groups}")
    if model.state_shape is not None and (why := model.state_shape.split_error(size)):   # Qwen3.5's, Granite 4-H's
        raise ConfigError(f"{key}: {why}")   # first: a model of state layers alone names its channels as heads
    if heads := next((n for n in (model.num_heads, *(model.laguna.heads if model.laguna else ())) if n % size), 0):
        raise ConfigError(f"{key}: {size} does not divide the model's {heads} attention heads")   # Laguna's: a layer's
    for kv_heads in {model.layer_kv_shape(layer)[0] for layer in model.kv_layers}:   # Gemma 4's: two counts
        if kv_heads % size and size % kv_heads:
            raise ConfigError(f"{key}: {size} neither divides nor is a multiple of the model's {kv_heads} KV heads")
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(model, name) % size:
            raise ConfigError(f"{key}: {size} does not divide the model's {name} {getattr(model, name)}"
                              + (" (each expert is split across the ranks)" if name == "moe_intermediate_size" else ""))


@dataclass
class StepPlan:
    """One step as rank 0 sends it to the other ranks: ints only, so every rank builds the same tensors.
    `stop` ends a follower's loop. Block moves are done before the forward pass, in order: the copies
    and swaps rank 0's schedulers asked for since the last plan."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)            # each sequence's row of the persistent batch
    row_updates: list = field(default_factory=list)          # `engine.input_batch.RowUpdate`s, applied first
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    prompt_rows: list[int] = field(default_factory=list)      # rows whose next prompt token's logprob is asked
    prompt_targets: list[int] = field(default_factory=list)   # that token, for each of them
    prompt_top: int = 0                                       # the most top logprobs any of them asks
    num_pending: int = 0   # placeholders in input_ids: rank 0 sends the previous step's this many sampled ids
    measure_kv_scales: bool = False   # an FP8 cache's scales measured on this plan (engine.kv_scales)
    state_loads: list[tuple[int, int]] = field(default_factory=list)   # (snapshot slot, row): copied before the step
    state_saves: list[tuple[int, int, int]] = field(default_factory=list)   # (sequence, token offset, snapshot slot)
    moves: list[tuple[str, str, list[tuple[int, int]]]] = field(default_factory=list)   # (kind, pool, pairs)
    stop: bool = False


@dataclass(frozen=True)
class FollowerArgs:
    """What a follower rank's process is started with (pickled to its stdin, or its fork's argument)."""

    config: object          # the device's EngineConfig
    rank: int
    size: int
    device: str             # this rank's torch device
    init_method: str        # where the group meets (tcp://127.0.0.1:port)
    link_fd: int            # this rank's end of its `PlanLink` to rank 0 (an inherited socket)


@dataclass
class RankSetup:
    """What rank 0 built beside its KV cache, sent once before the first plan: each swapping pool's
    CPU swap blocks (every rank holds the same number, of its own shard)."""

    swap_blocks: dict[str, int] = field(default_factory=dict)


@dataclass
class CaptureGraphs:
    """Rank 0's word to capture the decode graphs (`engine.cuda_graphs`), sent between plans once an FP8
    cache's scales are measured: every rank captures the same sizes in the same order, so the all-reduces
    inside the captured forwards pair up at capture and at every replay."""

    max_batch: int
    max_model_len: int
    backend: object = None   # the `GraphBackend` to capture with; None: CUDA graphs on the rank's device


class Collectives:
    """The model's collectives over a tensor-parallel group; identity when the group has one rank."""

    def __init__(self, size: int = 1, group=None) -> None:
        self.size = size
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise max of `x` over the ranks, in place."""
        if self.size > 1:
            torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place (a device-side copy: NCCL queues it on CUDA)."""
        if self.size > 1:
            torch.distributed.broadcast(x, src=0, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size x n], rank 0's columns first."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class PlanLink:
    """One end of the control channel between rank 0 and one follower: a stream socket carrying
    length-prefixed pickles (plans down, one `ready` byte up). The peers are this machine's processes
    of one group, started by rank 0 itself: the pickles are theirs (never read from a network)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, data: bytes) -> None:
        """One frame (a pickle); OSError when the peer is gone."""
        self.sock.sendall(_LENGTH.pack(len(data)) + data)

    def receive(self) -> object:
        """The next frame's object; blocks with no timeout. EOFError when the peer is gone."""
        (size,) = _LENGTH.unpack(self._exact(_LENGTH.size))
        return pickle.loads(self._exact(size))

    def say_ready(self) -> None:
        self.sock.sendall(_READY)

    def say_failed(self, reason: str) -> None:
        """The follower could not load: its reason for rank 0 to give (OSError when rank 0 is gone)."""
        self.sock.sendall(_FAILED + reason.encode("utf-8", "replace")[:MAX_REASON_BYTES])

    def read_reason(self) -> str:
        """After `_FAILED`: the reason, to the end of the link."""
        reason = b""
        while len(reason) < MAX_REASON_BYTES and (chunk := self.sock.recv(MAX_REASON_BYTES)):
            reason += chunk
        return reason.decode("utf-8", "replace")

    def _exact(self, size: int) -> bytes:
        data = bytearray(size)
        view, got = memoryview(data), 0
        while got < size:
            n = self.sock.recv_into(view[got:])
            if not n:
                raise EOFError("the other end of the tensor-parallel link closed")
            got += n
        return bytes(data)


class TensorParallelGroup:
    """Rank 0's handle on its group: the followers' processes and the links to them.

    Built by `start` before rank 0 loads its own shard (the followers load theirs meanwhile);
    `wait_ready` waits for their loads and starts the watch; `close` stops the followers. A group of
    one rank is `TensorParallelGroup.single()`: no processes, and `broadcast` does nothing.
    `on_rank_exit(reason)` is called from the watch thread when a follower's process ends while the
    group is open; by default it logs the reason and ends this process (`end_process`)."""

    def __init__(self, size: int, collectives: Collectives, links: list[PlanLink] | None = None,
                 processes: list | None = None) -> None:
        self.size = size
        self.collectives = collectives
        self.links = links or []          # to ranks 1..size-1
        self.processes = processes or []
        self.on_rank_exit: Callable[[str], None] = end_process
        self._closing = False
        self._watch: threading.Thread | None = None

    @classmethod
    def single(cls) -> TensorParallelGroup:
        return cls(1, Collectives())

    @classmethod
    def start(cls, config, rank_devices: list[torch.device], follower: Callable[..., None]) -> TensorParallelGroup:
        """Start ranks 1..T-1 of `config` (an EngineConfig), join the group as rank 0 and return it.
        `rank_devices[r]` is the torch device of rank r. Each follower runs `follower`
        (`engine.model_runner.follower_main`) with its `FollowerArgs` and its end of a socket pair, its `PlanLink`:
        forked from this process's fork server where it runs one, else a new Python process reading them from its
        stdin (`engine.fork_server.start_follower`)."""
        size = len(rank_devices)
        store = serve_store(size)
        init_method = f"tcp://127.0.0.1:{store.port}"
        processes, links = [], []
        try:
            for rank in range(1, size):
                ours, theirs = socket.socketpair()
                links.append(PlanLink(ours))
                with theirs:   # the child holds its own copy; ours closes it
                    args = FollowerArgs(config, rank, size, str(rank_devices[rank]), init_method, theirs.fileno())
                    processes.append(start_follower(follower, args, theirs))
            group = join_group(rank_devices[0], 0, size, store, config.collective_timeout_seconds, processes)
        except BaseException:
            for process in processes:
                process.kill()
                process.wait()
            raise
        return cls(size, Collectives(size, group), links, processes)

    def broadcast(self, plan: object) -> None:
        """Send one plan (or the `RankSetup`) to every follower (rank 0 only); RuntimeError naming the
        rank when one is gone."""
        if self.size == 1:
            return
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, link in enumerate(self.links, start=1):
            try:
                link.send(data)
            except OSError as exc:
                if (failure := self._failure(rank)) is not None:
                    raise RuntimeError(f"tensor-parallel rank {rank} failed to load: {failure}") from exc
                raise RuntimeError(f"tensor-parallel rank {rank} is gone ({self._exit_of(rank)}): {exc}") from exc

    def wait_ready(self, timeout: float = LOAD_TIMEOUT_SECONDS) -> None:
        """Wait until every follower has loaded its shard and said so, then start watching them.
        RuntimeError naming the rank whose process ended first, or that is not ready by `timeout`."""
        if self.size == 1:
            return
        deadline = time.monotonic() + timeout
        for rank, link in enumerate(self.links, start=1):
            # past the deadline a rank whose word has come is still read: never 0, which means non-blocking
            link.sock.settimeout(max(1e-3, deadline - time.monotonic()))
            try:
                said = link.sock.recv(1)
            except TimeoutError:
                raise RuntimeError(f"tensor-parallel rank {rank} did not load within {timeout:g} s") from None
            except OSError as exc:
                said = b""
                log.warning("tensor-parallel rank %d: %s", rank, exc)
            finally:
                link.sock.settimeout(None)
            if said == _FAILED:
                raise RuntimeError(f"tensor-parallel rank {rank} failed to load: {self._failure(rank, said)}")
            if said != _READY:
                raise RuntimeError(f"tensor-parallel rank {rank} exited while loading ({self._exit_of(rank)})")
        self._watch = threading.Thread(target=self._watch_ranks, name="cliffguard-tp-watch", daemon=True)
        self._watch.start()

    def _watch_ranks(self) -> None:
        """The watch thread: a follower says nothing after `ready`, so its link turning readable means
        its process ended (end-of-file) or the link broke; either way the group is broken."""
        socks = {link.sock: rank for rank, link in enumerate(self.links, start=1)}
        while not self._closing:
            try:
                readable, _, _ = select.select(list(socks), [], [])
            except (OSError, ValueError):
                return   # the links were closed: the group is closing
            if self._closing:
                return
            rank = socks[readable[0]]
            reason = f"tensor-parallel rank {rank} of {self.size} {self._exit_of(rank, wait=2.0)}"
            if (self.processes[rank - 1].returncode or 0) >= 0:   # not killed: its step failed, as rank 0's does
                time.sleep(OWN_END_SECONDS)
                if self._closing:
                    return
            self.on_rank_exit(reason)
            return

    def _failure(self, rank: int, said: bytes | None = None) -> str | None:
        """What follower `rank` said of its failure to load before it ended (`PlanLink.say_failed`), if it did
        (`said`: its first byte, when read already)."""
        link = self.links[rank - 1]
        link.sock.settimeout(1.0)
        try:
            if said is None:
                said = link.sock.recv(1)
            return link.read_reason() if said == _FAILED else None
        except OSError:
            return None
        finally:
            link.sock.settimeout(None)

    def quiet(self) -> None:
        """The worker ends for a reason of its own (a failed step it says): the watch reports no follower's end."""
        self._closing = True

    def _exit_of(self, rank: int, wait: float = 0.2) -> str:
        """How follower `rank`'s process ended ("exited (signal 9, SIGKILL)"), or that it still runs."""
        process = self.processes[rank - 1]
        try:
            code = process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            return f"(pid {process.pid}) closed its link to rank 0 and is still running"
        return f"(pid {process.pid}) exited ({describe_exit(code)})"

    def close(self) -> None:
        """Stop the followers (a `stop` plan, then a kill for one that lingers) and leave the group."""
        if self.size == 1:
            return
        self._closing = True
        try:
            self.broadcast(StepPlan(stop=True))
        except RuntimeError:
            pass   # a follower is already gone
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for link in self.links:
            link.sock.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self.size = 1


def end_process(reason: str) -> None:
    """The default `on_rank_exit`: a group that lost a rank cannot step again; log why and end this
    process, so whoever supervises it (the gateway, a Ray actor's restart) starts the device again whole."""
    log.error("%s; ending this device process so that it is restarted whole", reason)
    logging.shutdown()
    os._exit(1)


def use_device(device: torch.device) -> None:
    """Make a GPU `device` this thread's current CUDA device, which Triton launches on and events and graph
    captures take their stream from (nothing for a CPU)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def die_with_parent() -> None:
    """On Linux, SIGKILL this process when its parent (rank 0's worker, or the fork server, which ends with
    rank 0's process) dies, however it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:   # the parent died before the call above
        os._exit(0)
