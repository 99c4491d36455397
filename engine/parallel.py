"""Tensor parallelism: one device's model and KV cache split over `tensor_parallel_size` ranks.

The device worker process is rank 0. It runs the whole engine — the pools' schedulers, the step
composer, the sampler — exactly as with one rank, and spawns ranks 1..T-1 (`TensorParallelGroup.start`),
processes (`engine.model_runner.follower_main`) that hold their shard of the weights and of the KV
cache and do only what rank 0 tells them.
Each step rank 0 broadcasts one `StepPlan` (the flat token ids, positions and block tables of the
merged batch, and the block copies and swaps to do first) over a gloo group; every rank then runs the
same forward pass on its shard, with two all-reduces per layer and an all-gather of the logits, which
only rank 0 samples from. A follower that loses rank 0 (the worker was killed) dies with it
(`PR_SET_PDEATHSIG`); rank 0 that loses a follower fails its step, and the worker is restarted whole.

How a model is cut (`ShardShape`), Megatron-style:
- q/k/v and gate/up are column-parallel: rank r holds heads `[r·H/T, (r+1)·H/T)` and a 1/T slice of
  the MLP's intermediate rows; o_proj and down_proj are row-parallel (an all-reduce of their outputs,
  the bias added on rank 0 only);
- KV heads are split like query heads when T divides them; when the model has fewer KV heads than
  ranks (T a multiple of them), each rank holds the one KV head its query heads read, so KV heads are
  replicated T / num_kv_heads times, as the capacity plan assumes;
- the embedding and the LM head are vocab-parallel: each rank holds ceil(V/T) rows (zero-padded at
  the end), a lookup outside its rows reads zeros before the all-reduce, and the logits are gathered.
Rules on the shape live in `check_tensor_parallel`, which the capacity plan and the engine both call.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from dataclasses import dataclass, field

import torch

from engine.config import ConfigError, ceil_div
from engine.model_config import ModelConfig

log = logging.getLogger("cliffguard.engine")

INIT_TIMEOUT_SECONDS = 300   # how long rank 0 waits for its followers to join the group
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
                   vocab_rows=ceil_div(model.vocab_size, size), vocab_size=model.vocab_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    @property
    def num_vocab_rows_used(self) -> int:
        """Rows of this rank's vocab shard that hold real tokens (the last rank's tail is padding)."""
        return max(0, min(self.vocab_size, self.vocab_start + self.vocab_rows) - self.vocab_start)

    def kv_bytes_per_token(self, model: ModelConfig, dtype: torch.dtype) -> int:
        """This rank's S_KV: 2 x num_layers x its KV heads x head_dim x dtype bytes."""
        return 2 * model.num_layers * self.num_kv_heads * model.head_dim * dtype.itemsize


def check_tensor_parallel(model: ModelConfig, size: int, key: str = "tensor_parallel_size") -> None:
    """ConfigError naming `key` when `size` ranks cannot split `model`: it must divide the attention
    heads and the MLP's intermediate size, and divide the KV heads or be a multiple of them."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"{key}: must be an integer >= 1, got {size!r}")
    if model.num_heads % size:
        raise ConfigError(f"{key}: {size} does not divide the model's {model.num_heads} attention heads")
    if model.num_kv_heads % size and size % model.num_kv_heads:
        raise ConfigError(f"{key}: {size} neither divides nor is a multiple of the model's "
                          f"{model.num_kv_heads} KV heads")
    if model.intermediate_size % size:
        raise ConfigError(f"{key}: {size} does not divide the model's intermediate_size "
                          f"{model.intermediate_size}")
    if model.moe_intermediate_size % size:
        raise ConfigError(f"{key}: {size} does not divide the model's moe_intermediate_size "
                          f"{model.moe_intermediate_size} (each expert is split across the ranks)")


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
    moves: list[tuple[str, str, list[tuple[int, int]]]] = field(default_factory=list)   # (kind, pool, pairs)
    stop: bool = False


@dataclass(frozen=True)
class FollowerArgs:
    """What a follower rank's process is started with (pickled to its stdin)."""

    config: object          # the device's EngineConfig
    rank: int
    size: int
    device: str             # this rank's torch device
    init_method: str        # where the group meets (tcp://127.0.0.1:port)


@dataclass
class RankSetup:
    """What rank 0 built beside its KV cache, sent once before the first plan: each swapping pool's
    CPU swap blocks (every rank holds the same number, of its own shard)."""

    swap_blocks: dict[str, int] = field(default_factory=dict)


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

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size x n], rank 0's columns first."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class TensorParallelGroup:
    """Rank 0's handle on its group: the followers' processes and the control channel to them.

    Built by `start` before rank 0 loads its own shard (the followers load theirs meanwhile); `close`
    stops the followers. A group of one rank is `TensorParallelGroup.single()`: no processes, and
    `broadcast` does nothing."""

    def __init__(self, size: int, collectives: Collectives, control=None,
                 processes: list | None = None) -> None:
        self.size = size
        self.collectives = collectives
        self.control = control            # the gloo group plans travel on
        self.processes = processes or []

    @classmethod
    def single(cls) -> TensorParallelGroup:
        return cls(1, Collectives())

    @classmethod
    def start(cls, config, rank_devices: list[torch.device], follower: Callable[[], None]) -> TensorParallelGroup:
        """Start ranks 1..T-1 of `config` (an EngineConfig), join the group as rank 0 and return it.
        `rank_devices[r]` is the torch device of rank r. Each follower is a new Python process (not a
        multiprocessing child: the device worker may itself be a daemon) that runs `follower()`
        (`engine.model_runner.follower_main`), which reads its `FollowerArgs` from its stdin."""
        size = len(rank_devices)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        root = str(Path(__file__).resolve().parent.parent)   # where the `engine` package is
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))))
        command = [sys.executable, "-c", f"from {follower.__module__} import {follower.__name__}; "
                                         f"{follower.__name__}()"]
        processes = []
        try:
            for rank in range(1, size):
                process = subprocess.Popen(command, stdin=subprocess.PIPE, env=env)
                processes.append(process)
                process.stdin.write(pickle.dumps(FollowerArgs(config, rank, size, str(rank_devices[rank]),
                                                              init_method)))
                process.stdin.close()
            collectives, control = join_group(rank_devices[0], 0, size, init_method)
        except BaseException:
            for process in processes:
                process.kill()
                process.wait()
            raise
        return cls(size, collectives, control, processes)

    def broadcast(self, plan: StepPlan) -> None:
        """Send one plan to every follower (rank 0 only)."""
        if self.size > 1:
            torch.distributed.broadcast_object_list([plan], src=0, group=self.control)

    def close(self) -> None:
        """Stop the followers (a `stop` plan, then a kill for one that lingers) and leave the group."""
        if self.size == 1:
            return
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
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self.size = 1


def receive_plan(control) -> StepPlan:
    """A follower's next plan from rank 0 (blocks until rank 0 sends one)."""
    box = [None]
    torch.distributed.broadcast_object_list(box, src=0, group=control)
    return box[0]


def join_group(device: torch.device, rank: int, size: int, init_method: str) -> tuple[Collectives, object]:
    """Join the group as `rank`: NCCL for the tensors on CUDA (gloo on CPU), and a gloo group for plans."""
    timeout = datetime.timedelta(seconds=INIT_TIMEOUT_SECONDS)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl", init_method=init_method, rank=rank, world_size=size,
                                             timeout=timeout, device_id=device)
        control = torch.distributed.new_group(backend="gloo", timeout=timeout)
    else:
        torch.distributed.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                                             timeout=timeout)
        control = torch.distributed.group.WORLD
    return Collectives(size, torch.distributed.group.WORLD), control


def die_with_parent() -> None:
    """On Linux, SIGKILL this process when its parent (rank 0's worker) dies, however it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:   # the parent died before the call above
        os._exit(0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
