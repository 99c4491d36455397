"""The KV tensor of one device: every layer's K and V for every block.

Owns the memory, not the indices: which blocks a sequence holds is `engine.block_manager`'s business.
One tensor backs all pools of a device; a pool is a range of its block ids.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch

import engine.capacity as capacity
from engine.config import ConfigError, EngineConfig
from engine.deepseek_v4_config import refuse_fp8_cache
from engine.gemma4_config import rank_kv_heads
from engine.minimax_m3_config import index_key_dtype
from engine.model_config import ModelConfig
from engine.parallel import ShardShape
from engine.sliding_kv import SlidingRing, paged_bytes_per_token, ring_snapshots_bytes, rings_bytes
from engine.state_cache import num_snapshot_slots, states_bytes
from kernels.transfer import to_device, to_device_tensor

log = logging.getLogger("cliffguard.engine")


class KVCache:
    """`num_blocks` blocks of `block_size` slots of K and V for each layer.

    tensors: one a layer shape, each [its layers, planes, num_blocks, block_size, num_kv_heads, head_dim], planes K
    and V (DeepSeek's latent attention: one, both the layer's K and its V: `ModelConfig.kv_planes`; the layers with
    K/V alone, `ModelConfig.kv_layers`: Qwen3.5's linear-attention layers keep none). Most models have one shape
    (`data`, the tensor); Gemma 4's full layers have KV heads and a head size of their own, MiMo-V2-Flash's sliding
    layers KV heads of their own (`ModelConfig.layer_kv_shape`), so their K/V lie in a second tensor, a block id
    naming the same block in both.
    In `dtype`: the model's, or float8_e4m3fn for an FP8 cache (`kv_cache_dtype: fp8`; the kernels store and read it
    with per-layer scales). `raws` are the same memory as the block copies move it (bytes for FP8, which has no
    index_copy on a CPU). `num_kv_heads`: this rank's under tensor parallelism (default: the model's), of one of
    `tensor_parallel_size` ranks (which give a model of several shapes each shape's share).
    With a `ring` (`engine.sliding_kv`: `sliding_kv: window`) its sliding layers keep their K/V in `ring_tensors`
    instead, laid out alike with `ring.num_blocks` blocks (each row of the persistent batch its pool's ring:
    `SlidingRing.row_layout`); `layers` hands each layer its own (a ring layer's views of the ring tensors), `tensors`
    are the paged blocks alone.
    """

    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, num_kv_heads: int | None = None, tensor_parallel_size: int = 1,
                 ring: SlidingRing | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        refuse_fp8_cache(model, dtype)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self._device = torch.device(device)
        if len({model.layer_kv_shape(i) for i in model.kv_layers}) <= 1:   # one shape: this rank's heads
            shapes = [(num_kv_heads or model.num_kv_heads, model.head_dim)] * model.num_kv_layers
        else:   # each layer's own, this rank's share of its heads
            shapes = [(rank_kv_heads(heads, tensor_parallel_size), dim)
                      for heads, dim in map(model.layer_kv_shape, model.kv_layers)]
        in_ring = set(ring.layers) if ring is not None else set()
        self.ring = ring
        self.tensors, paged = _tensors([s for i, s in enumerate(shapes) if i not in in_ring], model.kv_planes,
                                       num_blocks, block_size, dtype, self._device)
        self.ring_tensors, rings = _tensors([s for i, s in enumerate(shapes) if i in in_ring], model.kv_planes,
                                            ring.num_blocks if ring is not None else 0, block_size, dtype,
                                            self._device)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            rings.pop(0) if i in in_ring else paged.pop(0) for i in range(len(shapes))]
        if model.block_indexer is not None:   # MiniMax M3: its sparse layers' indexer keys, a tensor beside the K/V
            self._add_index_keys(model, num_blocks, block_size, dtype)
        self.raws = [raw(tensor) for tensor in self.tensors]
        self.ring_snapshots: list[torch.Tensor] = []   # prefix caching's (`reserve_ring_snapshots`)
        self._row_layout = ring.row_layout() if ring is not None else ([], [])

    def _add_index_keys(self, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        """A tensor [sparse layers, 1, num_blocks, block_size, 1, index_head_dim] of MiniMax M3's indexer keys, whole
        on every rank, among `tensors` (so block copies and swaps move it with the K/V), in bfloat16 beside an FP8
        cache (`index_key_dtype`); a sparse layer's entry of `layers` is (K, V, its indexer keys)."""
        indexer = model.block_indexer
        keys = zeros((len(indexer.layers), 1, num_blocks, block_size, 1, indexer.head_dim), index_key_dtype(dtype),
                     self._device)
        self.tensors.append(keys)
        for j, layer in enumerate(indexer.layers):
            i = model.kv_layers.index(layer)
            self.layers[i] = (*self.layers[i], keys[j, 0])

    def reserve_ring_snapshots(self, num_slots: int) -> None:
        """Prefix caching's snapshot slots of the rings (`engine.state_cache` decides which prefix each holds): a
        slot is the `SlidingRing.snapshot_blocks` blocks of every ring layer before a block boundary, zeroed."""
        if self.ring is None or not num_slots:
            return
        count = num_slots * self.ring.snapshot_blocks
        self.ring_snapshots = [zeros((*t.shape[:2], count, *t.shape[3:]), self.dtype, self.device)
                               for t in self.ring_tensors]

    def copy_ring_windows(self, moves: list[tuple[int, int, int]], save: bool) -> None:
        """(row, position, slot) each: `save`, the row's ring blocks of the window before block-aligned `position` into
        snapshot `slot` (after the step that computed them); else back into the row's ring (before the step that
        resumes there). Blocks before position 0 are not moved."""
        if not moves or not self.ring_snapshots:
            return
        (base, sizes), nb, bs = self._row_layout, self.ring.snapshot_blocks, self.block_size
        pairs = [(base[row] + j % sizes[row], slot * nb + k) for row, position, slot in moves
                 for k, j in enumerate(range(position // bs - nb, position // bs)) if j >= 0]
        if not pairs:
            return
        ring = to_device([r for r, _ in pairs], torch.int64, self.device)
        snap = to_device([s for _, s in pairs], torch.int64, self.device)
        for rings, snaps in zip(map(raw, self.ring_tensors), map(raw, self.ring_snapshots)):
            if save:
                snaps.index_copy_(2, snap, rings.index_select(2, ring))
            else:
                rings.index_copy_(2, ring, snaps.index_select(2, snap))

    @property
    def data(self) -> torch.Tensor:
        """The cache's tensor where every layer has one shape (not Gemma 4's or MiMo-V2-Flash's: `tensors`)."""
        if len(self.tensors) != 1:
            raise ValueError("this KV cache holds layers of several shapes: see KVCache.tensors")
        return self.tensors[0]

    @property
    def raw(self) -> torch.Tensor:
        return raw(self.data)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def num_bytes(self) -> int:
        """The paged blocks' bytes (the rings' and their snapshots': `engine.sliding_kv.rings_bytes`,
        `ring_snapshots_bytes`)."""
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors)

    @property
    def bytes_per_block(self) -> int:
        return self.num_bytes // self.num_blocks

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block `dst` gets the K/V of block `src` (every layer)."""
        if not pairs:
            return
        src = to_device([s for s, _ in pairs], torch.int64, self.device)   # queued: the host goes on
        dst = to_device([d for _, d in pairs], torch.int64, self.device)
        for tensor in self.raws:
            tensor.index_copy_(2, dst, tensor.index_select(2, src))


def device_kv_cache(config: EngineConfig, model: ModelConfig, shard: ShardShape, dtype: torch.dtype,
                    device: torch.device, ring: SlidingRing | None) -> KVCache:
    """Rank 0's KV cache for an EngineConfig: its pools' blocks of this rank's KV heads in `dtype`, and where the
    device has a `ring` (`engine.sliding_kv`) one for each sequence its pools run (a decode graph's padded rows read
    ring block 0 and store nothing); on CUDA first checked to fit beside what is loaded (`check_fits_device`, the
    state layers' states counted)."""
    rings = rings_bytes(ring, model, dtype, shard.size) + ring_snapshots_bytes(ring, model, dtype, shard.size,
                                                                               num_snapshot_slots(config.pools))
    check_fits_device(device, config.num_blocks, paged_bytes_per_token(model, dtype, shard.size, ring)
                      * config.cache.block_size, config.memory_utilization, states_bytes(config, model, dtype) + rings)
    cache = KVCache(model, config.num_blocks, config.cache.block_size, dtype, device, shard.num_kv_heads, shard.size,
                    ring)
    if ring is not None:
        log.info("sliding layers (window %d): rings of %s positions for %s sequences, %.0f MiB", ring.window,
                 "/".join(map(str, (b * ring.block_size for b in ring.blocks))), "/".join(map(str, ring.rows)),
                 rings / 2**20)
    return cache


def check_fits_device(device: torch.device, num_blocks: int, block_bytes: int, memory_utilization: float,
                      states_bytes: int = 0) -> None:
    """On CUDA, the capacity formula once more with what is real now: the GPU's memory and the weights as
    loaded, against the plan's `num_blocks` KV blocks (and `states_bytes`, a state model's states and
    snapshots: `engine.state_cache.states_bytes`); then against the memory the driver has free now,
    which other processes' use takes from. A plan made for another GPU (`--vram`), or a GPU another process
    holds, is refused here with the numbers, instead of failing later in the middle of an allocation."""
    if device.type != "cuda":
        return
    needed = num_blocks * block_bytes + states_bytes
    total = torch.cuda.get_device_properties(device).total_memory
    loaded = torch.cuda.memory_allocated(device)
    available = capacity.kv_cache_bytes(total, loaded, memory_utilization)
    if needed > available:
        raise ConfigError(
            f"pools: the plan's {num_blocks} blocks need {needed / 2**30:.2f} GiB of KV cache{_with(states_bytes)}, "
            f"but {memory_utilization} x {total / 2**30:.2f} GiB - {loaded / 2**30:.2f} GiB of loaded weights leaves "
            f"{available / 2**30:.2f} GiB on {device}; plan with this GPU's memory")
    # what the driver can still give (other processes' use is gone from it), and what torch's allocator holds free
    reserved = torch.cuda.memory_reserved(device)
    free = torch.cuda.mem_get_info(device)[0] + reserved - loaded
    if needed > free:
        raise ConfigError(
            f"pools: the plan's {num_blocks} blocks need {needed / 2**30:.2f} GiB of KV cache{_with(states_bytes)}, "
            f"but {device} has {free / 2**30:.2f} GiB free now: {(total - free - loaded) / 2**30:.2f} GiB are held "
            "outside this worker (another process, or a worker of this device still ending)")


def _tensors(shapes: list[tuple[int, int]], planes: int, num_blocks: int, block_size: int, dtype: torch.dtype,
             device: torch.device) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """One zeroed tensor per distinct (KV heads, head size) of `shapes` (each layer's, in order), each [its layers,
    planes, num_blocks, block_size, heads, head size]; and each layer's (K, V) views of them, in order."""
    kinds = sorted(set(shapes), key=shapes.index)
    # Zeroed, so that a slot no step has written yet holds finite values.
    tensors = [zeros((shapes.count(kind), planes, num_blocks, block_size, *kind), dtype, device) for kind in kinds]
    views = []
    for i, kind in enumerate(shapes):
        tensor = tensors[kinds.index(kind)][shapes[:i].count(kind)]
        views.append((tensor[0], tensor[-1]))
    return tensors, views


def _with(states_bytes: int) -> str:
    return f" (with {states_bytes / 2**30:.2f} GiB of sequence states)" if states_bytes else ""


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as the block copies move it: its bytes when its elements are one byte (FP8),
    the tensor itself otherwise."""
    return tensor.view(torch.uint8) if tensor.element_size() == 1 and tensor.dtype != torch.uint8 else tensor


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On the CPU it lies on an anonymous memory map, which the OS hands out zeroed page
    by page as it is first written: a worker starts without writing gigabytes of zeros first (0.6 s for
    the default 3.3 GB on a 2-core VM), and only the blocks ever used become resident."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, numel * dtype.itemsize)
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)   # the tensor keeps the map alive


class SwapSpace:
    """A pool's CPU block pool for swapped-out K/V: the same layout as the device's KVCache (its tensors, each with
    `num_blocks` blocks) in CPU memory, pinned when the device is CUDA, so copies run at full PCIe bandwidth. Block
    ids come from the pool's CPU `BlockManager`; this class only moves bytes.
    """

    def __init__(self, kv_cache: KVCache, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        pin = kv_cache.device.type == "cuda"
        self.num_blocks = num_blocks
        self.kv_cache = kv_cache
        self.tensors = [torch.zeros((*t.shape[:2], num_blocks, *t.shape[3:]), dtype=t.dtype, device="cpu",
                                    pin_memory=pin) for t in kv_cache.tensors]
        self.raws = [raw(tensor) for tensor in self.tensors]

    @property
    def num_bytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, CPU block) pairs: device -> CPU."""
        if not pairs:
            return
        dev = to_device([d for d, _ in pairs], torch.int64, self.kv_cache.device)
        cpu = torch.tensor([c for _, c in pairs])   # the copy to the CPU waits for the device: it must
        for mine, theirs in zip(self.raws, self.kv_cache.raws):
            mine.index_copy_(2, cpu, theirs.index_select(2, dev).to("cpu"))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(CPU block, device block) pairs: CPU -> device."""
        if not pairs:
            return
        device = self.kv_cache.device
        cpu = torch.tensor([c for c, _ in pairs])
        dev = to_device([d for _, d in pairs], torch.int64, device)   # queued, as the blocks: the host goes on
        for mine, theirs in zip(self.raws, self.kv_cache.raws):
            theirs.index_copy_(2, dev, to_device_tensor(mine.index_select(2, cpu), device))

    def measure(self, num_blocks: int = 32, repeats: int = 3) -> tuple[float, float]:
        """(bytes per second, seconds per copy) of one direction of a swap, measured on real copies of this
        pool's blocks (device -> CPU and back, of one block and of `num_blocks`, the best of `repeats` each;
        block 0.. of both sides, whose contents are rewritten after). A copy costs its latency plus its bytes
        over the bandwidth: the two sizes tell them apart."""
        n = min(num_blocks, self.num_blocks, self.kv_cache.num_blocks)
        saved = [tensor[:, :, :n].clone() for tensor in self.kv_cache.tensors]
        one, many = (self._round_trip(k, repeats) for k in (1, n))
        for tensor, blocks in zip(self.kv_cache.tensors, saved):
            tensor[:, :, :n] = blocks
        for tensor in self.tensors:
            tensor.zero_()
        # a round trip's per block: the difference, unless timing noise could be all of it (latency-bound copies)
        per_block = (many - one) / (n - 1) if n > 1 and many - one > 0.1 * many else many / n
        return 2 * self.kv_cache.bytes_per_block / per_block, max(0.0, (one - per_block) / 2)

    def _round_trip(self, num_blocks: int, repeats: int) -> float:
        import time

        pairs, best = [(i, i) for i in range(num_blocks)], float("inf")
        for _ in range(repeats):
            _sync(self.kv_cache.device)
            t = time.perf_counter()
            self.swap_out(pairs)
            self.swap_in(pairs)
            _sync(self.kv_cache.device)
            best = min(best, time.perf_counter() - t)
        return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
