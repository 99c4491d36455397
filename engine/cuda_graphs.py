"""Decode steps as replays of CUDA graphs captured at start, one per padded batch size.

An eager decode step of a 32-layer model launches ~330 kernels from Python; on a GPU the launches, not
the arithmetic, set the step's time (the GPU waits for the host). A CUDA graph records a forward pass's
launches once and replays them with one call. What a replay may differ in must live in device memory
the graph read at capture: `DecodeGraphs` owns those static buffers (token ids, positions, slots, block
tables, sequence lengths, `query_start_loc`) and the output buffer, sized for the largest batch, and
captures `LlamaForCausalLM.forward` once per batch size of `capture_sizes(max_num_seqs)`, largest
first, into one shared memory pool; a sparse attention that picks its path by the step's lengths is captured
once per length of `capture_lengths` too (its dense regime, then doubling lengths where its kernels allow).

A step with `n` decode tokens (every sequence's query length 1, n <= the largest size) copies its inputs
into the first `n` rows of the buffers, marks the padded rows' slots -1 (their K/V is not stored; they
read block 0 and their outputs are dropped), replays the graph of the smallest size >= n, and reads the
first `n` rows of the output. Prefill and mixed steps run eagerly: their shapes vary with every chunk and
their arithmetic, not their launches, sets their time.

Why the replay is right: every launch decision of the decode path is taken from Python ints fixed by the
padded batch (`query_lens_list` all 1; `seq_lens_list` at the graph's length, so the flash-decoding split
count suits any length it holds), and every per-step tensor the kernels read (the attention plan's tiles, the
rotary rows, the metadata) is either a static buffer or built from one on the device. The plan is built
by the eager warm-up run before each capture, so no host-to-device copy happens during capture.

With tensor parallelism each rank captures its own shard's forward, the all-reduces of its row-parallel
layers inside the graph (NCCL collectives are capturable; the communicator exists from the group's
start, `engine.parallel.join_group`, which also turns off NCCL's cuMem buffers that would cost each
captured all-reduce memory of its own). Rank 0 tells the others when (`engine.parallel.CaptureGraphs`), so
every rank runs the same warm-ups and captures in the same order, and each decode step replays the same
size on every rank: the collectives pair up as they do in an eager step.

`GraphBackend` hides `torch.cuda.CUDAGraph`: tests replay the same logic on the CPU with a recorder that
re-runs exactly the launches it saw at capture (tests/engine/graph_recorder.py), which is what a CUDA
graph does, so a launch decision read from a per-step Python value fails there as it would on a GPU.

Memory: graphs keep their pool's activations; `graph_memory_bytes` is what the capacity plan sets aside
on each GPU (`pools.capacity_plan`, of one rank's shard), and `DecodeGraphs.capture` measures what
capture took on CUDA and logs it beside that reserve. `enforce_eager: true` on a device (YAML) turns graphs off.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from kernels import AttentionMetadata

__all__ = ["MAX_GRAPH_BATCH", "CudaGraphBackend", "DecodeGraphs", "GraphBackend", "capture_lengths", "capture_sizes",
           "graph_memory_bytes"]

MAX_GRAPH_BATCH = 512   # decode steps with more sequences run eagerly (their launches are a small share)


def capture_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes a graph is captured for: 1, 2, 4, then every multiple of 8, up to and
    including `max_batch` (a step of n decodes replays the smallest size >= n)."""
    sizes = [s for s in (1, 2, 4) if s <= max_batch] + list(range(8, max_batch + 1, 8))
    if max_batch >= 1 and sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def capture_lengths(max_model_len: int, dense_len: int | None, sparse: bool) -> list[int]:
    """The longest sequences the graphs are captured for, shortest first (a step replays those of the shortest that
    holds its longest sequence): `max_model_len` alone for most models. A model whose attention picks its path by the
    step's lengths (`graph_max_len`: its dense regime's longest) holds that regime alone, unless its longer regime's
    kernels launch alike for every length up to the one they are given (`graph_sparse_regime`: DeepSeek V3.2's and
    MiniMax M3's Triton sparse kernels, whose indexer scores as many positions as that length): then lengths double
    from the dense regime's up to `max_model_len`, so a step's indexer scores at most twice its longest sequence."""
    if dense_len is None or dense_len >= max_model_len:
        return [max_model_len]
    lengths = [dense_len]
    while sparse and lengths[-1] < max_model_len:
        lengths.append(min(2 * lengths[-1], max_model_len))
    return lengths


def graph_memory_bytes(hidden_size: int, q_size: int, kv_size: int, intermediate_size: int, num_heads: int,
                       head_dim: int, max_batch: int, dtype_bytes: int, max_splits: int = 16, num_experts: int = 0,
                       top_k: int = 0, moe_intermediate_size: int = 0, sparse_bytes: int = 0) -> int:
    """What the capacity plan sets aside for the graphs of one rank: the largest batch's activations
    (the pool is shared, sizes are captured largest first, so the largest sets its size), doubled for the
    caching allocator's rounding and the graphs' own bookkeeping, plus 64 MiB for cuBLAS workspaces.

    Per decode token: the embeddings, the residual stream, the norm's output, o_proj's and down_proj's
    outputs (5 x hidden), qkv, attention's output, gate/up and its SiLU x mul, the rotary rows, and the
    flash-decoding partials (float32: max, sum and an accumulator per head and split). A mixture of experts
    (`num_experts` > 0, `kernels.triton_moe`) adds per token the router's float32 logits and, for each of its
    `top_k` pairs, gate/up and SiLU x mul of `moe_intermediate_size`, a float32 output row and the pair ids; graphs of
    a sparse regime (`capture_lengths`) add `sparse_bytes` (the indexer's scores and choice a token)."""
    per_token = dtype_bytes * (5 * hidden_size + q_size + 2 * kv_size + q_size + 3 * intermediate_size + head_dim)
    per_token += sparse_bytes
    per_token += 4 * num_heads * max_splits * (head_dim + 2)
    if num_experts:
        per_token += 4 * num_experts + top_k * (3 * dtype_bytes * moe_intermediate_size + 4 * hidden_size + 3 * 8)
    return 2 * max_batch * per_token + (64 << 20)


class GraphBackend:
    """How graphs are made, captured and replayed (`CudaGraphBackend` on a GPU)."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """Run `fn` under capture: (the graph, the output tensor its replays overwrite)."""
        raise NotImplementedError

    def replay(self, graph: Any) -> None:
        raise NotImplementedError

    def memory_in_use(self) -> int:
        """Device bytes in use now (0 where nobody counts)."""
        return 0


class CudaGraphBackend(GraphBackend):
    """`torch.cuda.CUDAGraph`s sharing one memory pool, captured on `device`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph, out

    def replay(self, graph: Any) -> None:
        graph.replay()

    def memory_in_use(self) -> int:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free


class DecodeGraphs:
    """The model's decode forward captured per padded batch size (see the module docstring).

    model: the `LlamaForCausalLM`; kv_caches: its per-layer (k, v) caches; backend: the attention
    backend module; max_batch: the most decode tokens of a step (the pools' `max_num_seqs` together);
    max_model_len: the longest sequence (sets the block tables' width and the split count); `lengths` the longest
    sequences graphs hold (`capture_lengths`: a sparse model's dense regime, then doublings where its sparse kernels
    allow; a step with a longer sequence runs eagerly); graphs: the `GraphBackend`.
    """

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend, device: torch.device,
                 max_batch: int, max_model_len: int, block_size: int, graphs: GraphBackend, rings: bool = False
                 ) -> None:
        self.model, self.kv_caches, self.backend, self.graphs = model, kv_caches, backend, graphs
        self.lengths = capture_lengths(max_model_len, getattr(model, "graph_max_len", None),
                                       getattr(model, "graph_sparse_regime", False))
        max_model_len = self.lengths[-1]
        self.device, self.max_model_len, self.block_size = device, max_model_len, block_size
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1] if self.sizes else 0
        width = -(-max_model_len // block_size)
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        # each sequence's row of the persistent batch (a model with linear-attention layers keeps its state there);
        # padded rows use the model's padding row, whose state nothing reads
        states = getattr(model, "states", None)
        self.padding_row = states.padding_row if states is not None else 0
        self.rows = torch.full((n,), self.padding_row, dtype=torch.int64, device=device)
        # a window-bounded cache's (engine.sliding_kv): the sliding layers' slots and block tables over their rings
        self.ring_slots = self.slots.clone() if rings else None
        self.ring_tables = self.block_tables.clone() if rings else None
        # (length, size) -> (graph, its output, its metadata: the attention plan's tensors in `backend_cache` that the
        # graph reads stay alive with it)
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor, AttentionMetadata]] = {}
        self.capture_seconds = 0.0
        self.memory_bytes = 0

    def _meta(self, size: int, length: int, ring: bool = False) -> AttentionMetadata:
        slots, tables = (self.ring_slots, self.ring_tables) if ring else (self.slots, self.block_tables)
        meta = AttentionMetadata(
            slot_mapping=slots[:size], block_tables=tables[:size],
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_size=self.block_size, query_lens_list=[1] * size, seq_lens_list=[length] * size,
            has_invalid_slots=True, rows=self.rows[:size])   # padded rows: slot -1
        if not ring and self.ring_slots is not None:
            meta.ring = self._meta(size, length, ring=True)
        return meta

    def capture(self) -> None:
        """Capture every size of every length, longest and largest first (the later ones reuse its pool). Each
        is run once eagerly before its capture: kernels compile and the attention plan is built outside the capture."""
        started = time.perf_counter()
        before = self.graphs.memory_in_use()
        for length in reversed(self.lengths):
            for size in reversed(self.sizes):
                meta = self._meta(size, length)
                ids, positions = self.input_ids[:size], self.positions[:size]

                def forward(meta=meta, ids=ids, positions=positions) -> torch.Tensor:
                    return self.model(ids, positions, self.kv_caches, meta, self.backend)

                forward()                              # warm-up: compiles, fills meta.backend_cache
                graph, out = self.graphs.capture(forward)
                self._graphs[length, size] = (graph, out, meta)
        self.memory_bytes = max(0, self.graphs.memory_in_use() - before)
        self.capture_seconds = time.perf_counter() - started

    def can_run(self, query_lens: list[int], seq_lens: list[int] | None = None) -> bool:
        """Whether a step of these query lengths (and sequence lengths) replays a graph: decode tokens only,
        few enough, none longer than the graphs' block tables hold (a longer one runs eagerly)."""
        return bool(self._graphs) and 0 < len(query_lens) <= self.max_batch and all(q == 1 for q in query_lens) \
            and (not seq_lens or max(seq_lens) <= self.max_model_len)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states [n, hidden_size] from the graph of the smallest size >= n among those of the
        shortest length that holds its longest sequence (a view of that graph's output: read it before the next
        replay)."""
        n, longest = int(input_ids.shape[0]), max(meta.seq_lens_list)
        size = next(s for s in self.sizes if s >= n)
        graph, out, _ = self._graphs[next(length for length in self.lengths if length >= longest), size]
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:n].copy_(meta.slot_mapping, non_blocking=True)
        if size > n:   # padded rows store nothing and read one key of block 0 (not what a longer step left there)
            self.slots[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].zero_()
            self.rows[n:size].fill_(self.padding_row)
            if meta.ring is not None:
                self.ring_slots[n:size].fill_(-1)
                self.ring_tables[n:size, 0].zero_()
        if meta.ring is not None:
            self.ring_slots[:n].copy_(meta.ring.slot_mapping, non_blocking=True)
            self.ring_tables[:n, :width].copy_(meta.ring.block_tables, non_blocking=True)
        if meta.rows is not None:
            self.rows[:n].copy_(meta.rows, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.graphs.replay(graph)
        return out[:n]
