"""Turns a step's scheduled sequences into one flat forward pass over the paged KV cache.

`ModelRunner` is rank 0's (the device worker's); with tensor parallelism it sends each step as a
`engine.parallel.StepPlan` to the other ranks before running its own shard, and `FollowerRunner` is
what each of those ranks runs: the same forward pass from the same plan, on its shard.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import signal
import socket
import sys
import time

import torch

from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.cuda_graphs import CudaGraphBackend, DecodeGraphs, GraphBackend
from engine.input_batch import InputBatch
from engine.kv_cache import KVCache, SwapSpace
from engine.kv_scales import attentions, measure_kv_scales
from engine.model import LlamaForCausalLM
from engine.models import build_model
from engine import prompt_logprobs
from engine.overlap import fill_pending
from engine.parallel import (CaptureGraphs, Collectives, FollowerArgs, PlanLink, RankSetup, ShardShape, StepPlan,
                             TensorParallelGroup, die_with_parent)
from engine.rendezvous import join_group
from engine.scheduler_output import ScheduledSeq
from engine.sequence import Sequence
from engine.sliding_kv import device_ring
from engine.state_cache import num_snapshot_slots
from kernels import AttentionMetadata, get_backend
from kernels.transfer import to_device

log = logging.getLogger("cliffguard.engine")


class _Forward:
    """The forward pass from a `StepPlan`, shared by rank 0 and its followers (each on its own shard)."""

    model: LlamaForCausalLM
    kv_cache: KVCache
    device: torch.device
    backend: object
    swap_spaces: dict[str, SwapSpace]
    tensor_parallel: bool
    input_batch: InputBatch
    last_inputs_seconds: float = 0.0   # host seconds the last `run` spent making its inputs
    graphs: DecodeGraphs | None = None   # decode steps as CUDA graph replays (`capture_graphs`)
    pending_tokens: torch.Tensor | None = None   # overlapped steps: the step in flight's sampled ids [num_sampled]
    prompt_spans: prompt_logprobs.PromptSpans   # the last plan's prompt-logprob rows and their results (rank 0's)

    def _grad_mode(self):
        # gloo collectives need autograd's bookkeeping off the tensors, not inference tensors
        return torch.no_grad() if self.tensor_parallel else torch.inference_mode()

    def run(self, plan: StepPlan) -> torch.Tensor | None:
        """Logits [num_sampled, vocab] (the model's dtype) of the plan's sampled rows; None when none is sampled.
        Every rank calls it with the same plan (the collectives inside pair up, `pending_ids`' too:
        rank 0's sampled ids of the step before, where the plan's inputs hold placeholders)."""
        if not plan.input_ids:
            self.last_inputs_seconds = 0.0
            return None
        with self._grad_mode():
            device = self.device
            started = time.perf_counter()
            self.input_batch.apply(plan.row_updates)
            input_ids, positions, meta = self.input_batch.prepare(plan.input_ids, plan.positions, plan.rows,
                                                                  plan.query_lens, plan.seq_lens)
            if plan.num_pending:   # placeholders (engine.overlap), filled from the previous step's ids
                input_ids = fill_pending(input_ids, self.pending_ids(plan.num_pending))
            self.last_inputs_seconds = time.perf_counter() - started
            if getattr(self.model, "states", None) is not None:   # a state model's prefix cache (`engine.state_cache`)
                self.model.states.prepare(plan.state_loads, plan.state_saves)
            loads, saves = ring_moves(plan) if self.kv_cache.ring_snapshots else ([], [])   # rings' (sliding_kv)
            self.kv_cache.copy_ring_windows(loads, save=False)
            if self.graphs is not None and not plan.state_saves and self.graphs.can_run(plan.query_lens,
                                                                                         plan.seq_lens):
                hidden = self.graphs.run(input_ids, positions, meta)
            else:
                hidden = self.model(input_ids, positions, self.kv_cache.layers, meta, self.backend)
            self.kv_cache.copy_ring_windows(saves, save=True)
            if plan.prompt_rows:
                self.prompt_spans.hold(prompt_logprobs.compute(self.model, hidden, plan))
            if not plan.sample_rows:
                return None
            rows = to_device(plan.sample_rows, torch.int64, device)
            return self.model.compute_logits(hidden[rows])

    def compile_kernels(self) -> None:
        """Compile every attention kernel variant a step can need before serving, where the backend
        compiles them (`kernels.triton_attention.compile_kernels`, on CUDA); nothing elsewhere."""
        compile_kernels = getattr(self.backend, "compile_kernels", None)
        attns = list(attentions(self.model).values())
        if compile_kernels is None or self.device.type != "cuda" or not attns:   # Mamba's layers: no attention
            return
        attn = attns[0]
        started = time.perf_counter()
        # (KV heads, head size, window, chunk; 0: none): Gemma 4's full layers have a shape of their own
        masks = sorted({(a.num_kv_heads, a.config.head_dim, a.sliding_window or 0, a.chunk or 0) for a in attns})
        alibi = getattr(attn, "alibi", False)   # BLOOM's and MPT's slopes
        dtype = self.model.embed_tokens.weight.dtype   # the model's; the cache's may be FP8
        count = sum(compile_kernels(attn.num_heads, kv_heads, head_dim, self.kv_cache.block_size,
                                    dtype, self.device, window or None, kv_dtype=self.kv_cache.dtype,
                                    softcap=attn.softcap, sinks=attn.sinks is not None, chunk=chunk or None,
                                    alibi=alibi)
                    for kv_heads, head_dim, window, chunk in masks)
        count += self.warm_sparse_kernels()
        log.info("compiled %d attention kernel variants in %.1fs", count, time.perf_counter() - started)

    def warm_sparse_kernels(self) -> int:
        """Run each kind of sparse attention's kernels once (an attention's `warm_kernels`: DeepSeek V3.2's indexer and
        sparse kernels, MiniMax M3's block-sparse ones) over its layer's cache, so the first step past the dense regime
        does not compile them while serving (a compile stalls every sequence of the device: 0.15-1.4 s a variant on a
        fresh GPU). Each runs a made-up decode over the first 64 positions of its layer's cache (read, not written).
        Returns how many kinds ran."""
        warmed, block = set(), self.kv_cache.block_size
        meta = AttentionMetadata.build([list(range(-(-64 // block)))], [1], [64], block, self.device)
        for i, attn in attentions(self.model).items():
            kind = (type(attn), getattr(attn, "sinks", None) is not None)
            warm = getattr(attn, "warm_kernels", None)
            if warm is not None and kind not in warmed and warm(self.backend, self.kv_cache.layers[i], meta,
                                                                self.model.embed_tokens.weight.dtype):
                warmed.add(kind)
        return len(warmed)

    def graphs_apply(self, enforce_eager: bool) -> bool:
        """Whether decode steps should replay CUDA graphs: on CUDA with the Triton kernels (the graph-safe
        ones), a model whose forward never asks the device a question (`graph_safe`: Qwen3-MoE's expert
        loop does), unless the device says `enforce_eager`. With tensor parallelism every rank captures
        (`ModelRunner.capture_graphs`), the all-reduces inside the graphs."""
        return (self.device.type == "cuda" and not enforce_eager
                and self.model.graph_safe and self.backend is sys.modules.get("kernels.triton_attention"))

    def capture_graphs(self, max_batch: int, max_model_len: int, graphs: GraphBackend | None = None) -> None:
        """Capture this rank's decode forward for every padded batch size up to `max_batch`
        (`engine.cuda_graphs`); from then on decode-only steps replay them. `graphs`: how (default: CUDA
        graphs on this device)."""
        with self._grad_mode():
            self.graphs = DecodeGraphs(self.model, self.kv_cache.layers, self.backend, self.device, max_batch,
                                       max_model_len, self.kv_cache.block_size,
                                       graphs or CudaGraphBackend(self.device), self.kv_cache.ring is not None)
            self.graphs.capture()
        if getattr(self.model, "states", None) is not None:   # the graphs read these tensors: they stay put
            self.model.states.frozen = True
        log.info("captured %d decode graphs (batch 1 to %d, sequences up to %s tokens) in %.1fs, %.0f MiB",
                 len(self.graphs.sizes) * len(self.graphs.lengths), self.graphs.max_batch,
                 "/".join(map(str, self.graphs.lengths)), self.graphs.capture_seconds, self.graphs.memory_bytes / 2**20)

    def _apply_move(self, kind: str, pool: str, pairs: list[tuple[int, int]]) -> None:
        if kind == "swap_out":
            self.swap_spaces[pool].swap_out(pairs)
        elif kind == "swap_in":
            self.swap_spaces[pool].swap_in(pairs)
        else:
            self.kv_cache.copy_blocks(pairs)


class ModelRunner(_Forward):
    """Owns the model and the KV cache of one device worker (rank 0 of its group) and runs the forward
    passes. `swap_spaces`: each swapping pool's CPU block pool, added by the engine as it builds them."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device, backend,
                 group: TensorParallelGroup | None = None, max_rows: int = 64, max_blocks: int = 64) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.backend = backend
        self.group = group or TensorParallelGroup.single()
        self.tensor_parallel = self.group.size > 1
        self.swap_spaces: dict[str, SwapSpace] = {}
        self.input_batch = InputBatch(max_rows, max_blocks, kv_cache.block_size, device, kv_cache.ring)
        if hasattr(model, "reserve_states"):   # linear-attention layers: a state per row, made now
            model.reserve_states(max_rows)
            if model.states is not None:
                log.info("linear-attention states for %d sequences: %.0f MiB", max_rows, model.states.num_bytes / 2**20)
        self.prompt_spans = prompt_logprobs.PromptSpans()
        self._moves: list[tuple[str, str, list[tuple[int, int]]]] = []   # for the followers' next plan

    def plan(self, batch: list[ScheduledSeq]) -> tuple[StepPlan, list[Sequence]]:
        """The step as ints (each sequence's row of the persistent batch, and what changed in the rows),
        and the sequences that produce a token this step (in sample-row order)."""
        plan = StepPlan()
        sampled: list[Sequence] = []
        self.prompt_spans = spans = prompt_logprobs.PromptSpans()
        plan.rows, plan.row_updates = self.input_batch.assign((item.seq.seq_id, item.seq.block_table, item.seq.pool)
                                                              for item in batch)
        input_ids, positions, sample_rows = plan.input_ids, plan.positions, plan.sample_rows
        for index, item in enumerate(batch):
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            if item.state_load is not None:
                plan.state_loads.append((item.state_load, plan.rows[index]))
            plan.state_saves.extend((index, offset, slot) for offset, slot in item.state_saves)
            if n == 1:   # a decode: no slice, no range
                input_ids.append(seq.token_ids[start])
                positions.append(start)
            else:
                input_ids.extend(seq.token_ids[start:start + n])
                positions.extend(range(start, start + n))
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                prompt_logprobs.plan_rows(plan, spans, seq, start, n, len(input_ids) - n)
            plan.query_lens.append(n)
            plan.seq_lens.append(start + n)
            if start + n == len(seq.token_ids):  # reached the end: sample the next token
                sample_rows.append(len(input_ids) - 1)
                sampled.append(seq)
        if self.pending_tokens is not None and plan.input_ids and min(plan.input_ids) < 0:   # placeholders
            plan.num_pending = int(self.pending_tokens.shape[0])
        return plan, sampled

    def release(self, seq: Sequence) -> None:
        """`seq` stopped running (finished, preempted, swapped out): its row of the persistent batch is free."""
        self.input_batch.release(seq.seq_id)

    def execute(self, batch: list[ScheduledSeq], measure_scales: bool = False
                ) -> tuple[torch.Tensor, list[Sequence]]:
        """Run the step on every rank; return logits [num_sampled, vocab] (the model's dtype) and the sequences they
        belong to. `measure_scales`: the other ranks measure their FP8 scales on it (`engine.kv_scales`)."""
        started = time.perf_counter()
        plan, sampled = self.plan(batch)
        plan.measure_kv_scales = measure_scales
        planned = time.perf_counter() - started
        if self.tensor_parallel:
            plan.moves, self._moves = self._moves, []
            self.group.broadcast(plan)
        logits = self.run(plan)
        self.last_inputs_seconds += planned
        if logits is None:
            logits = torch.empty(0, self.model.config.vocab_size, device=self.device)
        return logits, sampled

    def pending_ids(self, count: int) -> torch.Tensor:
        """The ids of the step in flight (`pending_tokens`), sent to the other ranks first."""
        ids = self.pending_tokens
        if self.tensor_parallel:
            ids = self.pending_tokens = ids.to(torch.int64).contiguous()
            self.model.comm.broadcast(ids)
        return ids

    def synchronize(self) -> None:
        """Wait until the device has finished the work launched so far: CUDA runs kernels asynchronously,
        so a clock read right after a launch reads the launch, not the work (a step that samples nothing
        returns as soon as its kernels are queued, and the next step would pay for it). No-op on the CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def move_blocks(self, pool: str, moves: list[tuple[str, list[tuple[int, int]]]]) -> None:
        """A scheduler's block moves (`SchedulerOutput.moves`: kind and pairs, in the order decided), before the
        next forward pass reuses any freed block: done here now, and on the other ranks before they run the
        next plan (in the same order)."""
        for kind, pairs in moves:
            if pairs:
                self._apply_move(kind, pool, pairs)
                if self.tensor_parallel:
                    self._moves.append((kind, pool, list(pairs)))

    def capture_graphs(self, max_batch: int, max_model_len: int, graphs: GraphBackend | None = None) -> None:
        """Capture the decode graphs here and, with tensor parallelism, on every other rank at once: they
        are told first (`CaptureGraphs`, with `graphs` pickled: None means CUDA graphs on each rank's
        device), so each rank's warm-up and capture run the same forwards in the same order and their
        all-reduces pair up, as they do at every replay."""
        if self.tensor_parallel:   # a CUDA backend is made by each rank, on its own device
            sent = None if graphs is None or isinstance(graphs, CudaGraphBackend) else graphs
            self.group.broadcast(CaptureGraphs(max_batch, max_model_len, sent))
        super().capture_graphs(max_batch, max_model_len, graphs)

    def setup_followers(self) -> None:
        """Tell the other ranks what rank 0 built beside its KV cache (the pools' swap spaces), so they
        allocate the same; then wait until each has loaded and said so (from then on rank 0 watches
        them: `TensorParallelGroup.wait_ready`)."""
        if self.tensor_parallel:
            self.group.broadcast(RankSetup({pool: space.num_blocks for pool, space in self.swap_spaces.items()}))
            self.group.wait_ready()


class FollowerRunner(_Forward):
    """Rank r > 0 of a tensor-parallel group: its shard of the model and of the KV cache, and a loop
    that runs rank 0's plans until told to stop."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device, link: PlanLink) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.backend = get_backend(device)
        self.link = link
        self.tensor_parallel = True
        self.swap_spaces = {}
        self.input_batch = InputBatch(64, 64, kv_cache.block_size, device,   # rows as rank 0's plans update them
                                      kv_cache.ring)
        self.prompt_spans = prompt_logprobs.PromptSpans()

    @classmethod
    def load(cls, config: EngineConfig, rank: int, size: int, device: torch.device, collectives: Collectives,
             link: PlanLink) -> FollowerRunner:
        """Load rank `rank`'s shard of `config`'s model and allocate its KV cache (the same blocks as rank 0,
        its KV heads only), then the swap spaces rank 0 announces (`ModelRunner.setup_followers`); then
        say ready."""
        from engine.weights import iter_weights, resolve_model
        from kernels.cpu_linear import pack_linears, use_packed_linears

        dtype = config.resolved_dtype(device)
        path = resolve_model(config.model, cache_dir=config.cache_dir)
        model_config = ModelConfig.from_folder(path).serving(config.max_model_lens)
        shard = ShardShape.of(model_config, rank, size)
        model = build_model(model_config, dtype, device, shard, collectives, config.quantization)
        if config.random_weights:
            model.init_random(seed=config.seed)
        else:
            model.load_weights(iter_weights(path))
        if use_packed_linears(device, dtype):
            pack_linears(model)
        ring = device_ring(config, model_config)   # rank 0's (engine.sliding_kv): the same rows
        kv_cache = KVCache(model_config, config.num_blocks, config.cache.block_size, config.resolved_kv_dtype(device),
                           device, shard.num_kv_heads, shard.size, ring)
        runner = cls(model, kv_cache, device, link)
        kv_cache.reserve_ring_snapshots(num_snapshot_slots(config.pools))   # as rank 0's (nothing without rings)
        if hasattr(model, "reserve_states"):   # as rank 0's: its pools' rows, before any graph reads them
            model.reserve_states(sum(p.scheduler.max_num_seqs for p in config.pools))
            if model.states is not None:   # and prefix caching's snapshot slots
                model.states.reserve_snapshots(num_snapshot_slots(config.pools))
        runner.compile_kernels()
        setup = link.receive()
        for pool, num_blocks in setup.swap_blocks.items():
            runner.swap_spaces[pool] = SwapSpace(kv_cache, num_blocks)
        link.say_ready()
        return runner

    def pending_ids(self, count: int) -> torch.Tensor:
        """Rank 0's sampled ids of the step before, received into a buffer of this rank's."""
        return self.model.comm.broadcast(torch.empty(count, dtype=torch.int64, device=self.device))

    def serve(self) -> None:
        """Run plans until a `stop` plan comes (rank 0 closing); capture the decode graphs when told
        (`CaptureGraphs`). Waiting for a plan has no timeout (an idle group stays whole); rank 0's end
        raises EOFError here, and a collective that fails because a rank is gone (or past the collective
        timeout) RuntimeError, to the caller."""
        while True:
            plan = self.link.receive()
            if isinstance(plan, CaptureGraphs):
                self.capture_graphs(plan.max_batch, plan.max_model_len, plan.backend)
                continue
            if plan.stop:
                return
            for kind, pool, pairs in plan.moves:
                self._apply_move(kind, pool, pairs)
            if plan.measure_kv_scales:
                measure_kv_scales(self.model, lambda: self.run(plan))
            else:
                self.run(plan)


def follower_main(args: FollowerArgs | None = None) -> None:
    """A follower rank's process: its `FollowerArgs` (forked from the fork server), or read from stdin (`python
    -c`); join the group, load its shard, then run rank 0's plans until `stop`."""
    die_with_parent()
    for signum in (signal.SIGINT, signal.SIGTERM):   # sent to the process group: rank 0 says when to go
        signal.signal(signum, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = args or pickle.load(sys.stdin.buffer)
    config, rank, device = args.config, args.rank, torch.device(args.device)
    if config.cpu_threads:
        torch.set_num_threads(config.cpu_threads)
    link = PlanLink(socket.socket(fileno=args.link_fd))
    collectives = Collectives(args.size, join_group(device, rank, args.size, args.init_method,
                                                       config.collective_timeout_seconds))
    try:
        try:
            runner = FollowerRunner.load(config, rank, args.size, device, collectives, link)
        except Exception as exc:  # noqa: BLE001 - its own failure (out of memory, a bad shard): rank 0 says it
            log.error("tensor-parallel rank %d failed to load: %s: %s", rank, type(exc).__name__, exc)
            with contextlib.suppress(OSError):
                link.say_failed(f"{type(exc).__name__}: {exc}")
            raise SystemExit(1) from None
        runner.serve()
    except (EOFError, RuntimeError) as exc:   # rank 0 went away (idle, or mid-collective): nothing left to serve
        log.info("tensor-parallel rank %d stops: %s", rank, str(exc).splitlines()[0] if str(exc) else exc)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    # Done: end here, without the interpreter's teardown of torch (half a second of a 2-core CPU, which rank 0's
    # `close` waits for); nothing of a follower's is left to flush but its log.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def ring_moves(plan: StepPlan) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """The plan's prefix-cache snapshots as the sliding layers' rings take them (`KVCache.copy_ring_windows`): (row,
    position, slot) of each load, at the position its sequence resumes from, and of each save, at the block boundary
    it keeps (the piece's first position plus its offset)."""
    starts = [0, *itertools.accumulate(plan.query_lens)]   # each piece's first token in the step
    loads = [(row, plan.positions[starts[plan.rows.index(row)]], slot) for slot, row in plan.state_loads]
    saves = [(plan.rows[i], plan.positions[starts[i]] + offset, slot) for i, offset, slot in plan.state_saves]
    return loads, saves
