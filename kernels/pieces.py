"""Several sequences' new tokens scanned as one batch by a state layer (`kernels.gated_delta.chunked_pieces`,
`causal_conv_pieces`): their layout on the host, and the index tables a scan reads on the device, made once a step
for all the step's layers (one host-to-device copy each).

Tokens are flat, sequence after sequence, with no padding. Each sequence's tokens are cut into consecutive parts and
a scan gives the state after every part: where a prefix-caching snapshot is taken, and the sequence's last. A part
is cut into chunks of its own, so no chunk straddles two parts (a part's last chunk may be short): the chunks of all
sequences are independent within themselves (the WY form's solves, batched), and each sequence's chunks follow one
another through its state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch

from kernels.transfer import to_device, to_device_tensor

__all__ = ["ChunkTable", "ConvTable", "Pieces", "TorchPlan", "scan_tiles", "tiles"]


@dataclass
class ChunkTable:
    """The chunks on the device, int32 (a Triton scan's): `starts` / `lens` [num_chunks], each chunk's first token and
    its tokens (<= the chunk size); `seq_first` [num_seqs + 1], each sequence's first chunk; `part_end`
    [num_chunks], the part a chunk ends (its state kept after it), else -1."""

    starts: torch.Tensor
    lens: torch.Tensor
    seq_first: torch.Tensor
    part_end: torch.Tensor
    num_chunks: int


@dataclass
class TorchPlan:
    """The chunks padded to whole tiles for the torch scan, laid out step by step: `order` is the sequences by their
    chunk counts, most first, so the ones still scanning at their j-th chunk are the first `steps[j][1] -
    steps[j][0]`, and the tiles of step j (those sequences' j-th chunks, in that order) are tiles steps[j][0] ..
    steps[j][1] - 1: a step reads and writes a slice. `unpad` [num_tokens]: each token's slot among the tiles;
    `lens` [num_tiles]: each tile's tokens (float32); `steps[j][2:]`: the places among step j's tiles of those that
    end a part, and those parts (None: none)."""

    unpad: torch.Tensor
    num_tiles: int
    lens: torch.Tensor
    order: torch.Tensor
    steps: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]


@dataclass
class ConvTable:
    """Where each input goes in the flat window of a causal convolution of width `kernel` over all sequences (each
    sequence's `kernel - 1` state columns, then its tokens): `tokens` [num_tokens], `states` [num_seqs * (kernel -
    1)]; where each token's output is (`outputs`), and where the state after each part starts (`after`)."""

    tokens: torch.Tensor
    states: torch.Tensor
    outputs: torch.Tensor
    after: torch.Tensor
    length: int


class Pieces:
    """part_lens: each part's tokens (> 0), in token order; seq_parts: how many of them each sequence has (>= 1)."""

    def __init__(self, part_lens: list[int], seq_parts: list[int]) -> None:
        if not seq_parts or min(seq_parts) < 1 or sum(seq_parts) != len(part_lens) or min(part_lens) < 1:
            raise ValueError(f"pieces: parts {part_lens} of sequences {seq_parts}: every part and sequence non-empty")
        self.part_lens, self.seq_parts = list(part_lens), list(seq_parts)
        self.first_part = [0, *accumulate(seq_parts)]        # [num_seqs + 1]
        self.part_starts = [0, *accumulate(part_lens)]       # [num_parts + 1]
        self.num_tokens, self.num_parts, self.num_seqs = self.part_starts[-1], len(part_lens), len(seq_parts)
        self._cache: dict[tuple, object] = {}

    @classmethod
    def whole(cls, seq_lens: list[int]) -> Pieces:
        """Each sequence in one part."""
        return cls(seq_lens, [1] * len(seq_lens))

    def groups(self, max_tokens: int, max_seqs: int) -> list[tuple[slice, slice, Pieces]]:
        """Consecutive sequences in groups of at most `max_tokens` tokens and `max_seqs` sequences (a longer sequence
        alone): each group's tokens, its sequences and its own layout (a group's parts are consecutive, as its
        sequences are)."""
        key = ("groups", max_tokens, max_seqs)
        if key not in self._cache:
            groups, first = [], 0
            seq_start = [self.part_starts[p] for p in self.first_part]
            for s in range(1, self.num_seqs + 1):
                if s == self.num_seqs or seq_start[s + 1] - seq_start[first] > max_tokens or s - first >= max_seqs:
                    parts = slice(self.first_part[first], self.first_part[s])
                    groups.append((slice(seq_start[first], seq_start[s]), slice(first, s),
                                   Pieces(self.part_lens[parts], self.seq_parts[first:s])))
                    first = s
            self._cache[key] = groups
        return self._cache[key]

    @property
    def last_parts(self) -> list[int]:
        return [end - 1 for end in self.first_part[1:]]

    def seq_of_part(self) -> list[int]:
        return [s for s, n in enumerate(self.seq_parts) for _ in range(n)]

    def _chunks(self, chunk: int) -> tuple[list[int], list[int], list[int], list[int]]:
        """Host lists: each chunk's first token, its tokens, the part it ends (-1), and each sequence's first chunk."""
        starts, lens, ends, seq_first = [], [], [], [0]
        for s in range(self.num_seqs):
            for p in range(self.first_part[s], self.first_part[s + 1]):
                begin, stop = self.part_starts[p], self.part_starts[p + 1]
                for at in range(begin, stop, chunk):
                    starts.append(at)
                    lens.append(min(chunk, stop - at))
                    ends.append(p if at + chunk >= stop else -1)
            seq_first.append(len(starts))
        return starts, lens, ends, seq_first

    def chunk_table(self, chunk: int, device: torch.device) -> ChunkTable:
        key = ("chunks", chunk, device)
        if key not in self._cache:
            starts, lens, ends, seq_first = self._chunks(chunk)
            n = len(starts)
            flat = to_device(starts + lens + ends + seq_first, torch.int32, device)
            self._cache[key] = ChunkTable(flat[:n], flat[n:2 * n], flat[3 * n:], flat[2 * n:3 * n], n)
        return self._cache[key]

    def torch_plan(self, chunk: int, device: torch.device) -> TorchPlan:
        key = ("torch", chunk, device)
        if key not in self._cache:
            self._cache[key] = self._torch_plan(chunk, device)
        return self._cache[key]

    def _torch_plan(self, chunk: int, device: torch.device) -> TorchPlan:
        starts, lens, ends, seq_first = self._chunks(chunk)
        counts = [seq_first[s + 1] - seq_first[s] for s in range(self.num_seqs)]
        order = sorted(range(self.num_seqs), key=lambda s: -counts[s])
        unpad, steps, tile, tile_lens = [0] * self.num_tokens, [], 0, []
        for j in range(counts[order[0]]):
            first, done = tile, []
            for s in order:
                if counts[s] <= j:
                    break
                c = seq_first[s] + j
                unpad[starts[c]:starts[c] + lens[c]] = range(tile * chunk, tile * chunk + lens[c])
                tile_lens.append(lens[c])
                if ends[c] >= 0:
                    done.append((tile - first, ends[c]))
                tile += 1
            steps.append((first, tile, to_device([i for i, _ in done], torch.int64, device) if done else None,
                          to_device([p for _, p in done], torch.int64, device) if done else None))
        return TorchPlan(to_device(unpad, torch.int64, device), tile, to_device(tile_lens, torch.float32, device),
                         to_device(order, torch.int64, device), steps)

    def previous_table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """For a state that is the previous token's value: each token's previous one among [the sequences' states,
        then the tokens] (a sequence's first token reads its state), and each part's last token."""
        key = ("previous", device)
        if key not in self._cache:
            previous = torch.arange(self.num_tokens) + self.num_seqs - 1
            previous[[self.part_starts[p] for p in self.first_part[:-1]]] = torch.arange(self.num_seqs)
            last = torch.tensor(self.part_starts[1:]) - 1
            flat = to_device_tensor(torch.cat([previous, last]), device)
            self._cache[key] = flat[:self.num_tokens], flat[self.num_tokens:]
        return self._cache[key]

    def conv_table(self, kernel: int, device: torch.device) -> ConvTable:
        key = ("conv", kernel, device)
        if key not in self._cache:
            held, seq_start = kernel - 1, torch.tensor([self.part_starts[p] for p in self.first_part])
            seq_of_token = torch.repeat_interleave(torch.arange(self.num_seqs), seq_start.diff())
            token = torch.arange(self.num_tokens)
            states = (seq_start[:-1] + torch.arange(self.num_seqs) * held).unsqueeze(1) + torch.arange(held)
            after = torch.tensor(self.part_starts[1:]) + torch.tensor(self.seq_of_part()) * held
            after = (after.unsqueeze(1) + torch.arange(held)).flatten()   # each part's state columns
            flat = to_device_tensor(torch.cat([token + (seq_of_token + 1) * held, states.flatten(),
                                               token + seq_of_token * held, after]), device)
            t, k = self.num_tokens, self.num_seqs * held
            self._cache[key] = ConvTable(flat[:t], flat[t:t + k], flat[t + k:2 * t + k], flat[2 * t + k:],
                                         self.num_tokens + self.num_seqs * held)
        return self._cache[key]


def tiles(t: torch.Tensor, plan: TorchPlan, chunk: int) -> torch.Tensor:
    """A per-token tensor [num_tokens, heads, ...] as the torch scan's tiles [tiles, heads, chunk, ...] (`plan`'s
    layout), the pads zeros."""
    padded = t.new_zeros(plan.num_tiles * chunk, *t.shape[1:]).index_copy_(0, plan.unpad, t)
    return padded.unflatten(0, (-1, chunk)).transpose(1, 2)


def scan_tiles(plan: TorchPlan, ssm: torch.Tensor, num_parts: int, out: torch.Tensor,
               step: Callable[[slice, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch scans' walk through the states, step by step of `plan`: `step(at, held)` -> (the outputs of tiles
    `at`, the states after them), held the states [n, ...] of the n sequences still scanning (ssm [num_seqs, ...]
    in `plan.order`); the outputs written into `out` [tiles, heads, chunk, ...] -> (the outputs per token
    [num_tokens, heads, ...], the state after each part [num_parts, ...])."""
    state = ssm.float().index_select(0, plan.order)                          # sequences by their chunks, most first
    after = state.new_empty(num_parts, *state.shape[1:])
    for first, end, places, parts in plan.steps:   # the sequences' j-th chunks: tiles first .. end - 1
        out[first:end], state[:end - first] = step(slice(first, end), state[:end - first])
        if places is not None:
            after.index_copy_(0, parts, state.index_select(0, places))
    return out.transpose(1, 2).flatten(0, 1).index_select(0, plan.unpad), after
