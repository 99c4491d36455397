"""Gated DeltaNet, the linear attention of Qwen3.5's (and Qwen3-Next's) `linear_attention` layers, the per-sequence
state those layers (and Mamba-2's, `engine.layers.mamba2`) keep in place of K/V (`RecurrentStates`), and what such a
mixer does with the step's rows (`StateMixer`).

A running sequence's state lives in the rows of the state tensors that match its row of the persistent batch
(`engine.input_batch`: a sequence holds one row for as long as it runs; `AttentionMetadata.rows`). A sequence
whose step starts at position 0 (its prefill's first chunk, a recompute after preemption) starts from zeros,
so a row left by an earlier holder is never read; one that resumes from a cached prefix has the state kept with it
copied into its row first (`RecurrentStates.prepare`: prefix caching's snapshot slots, `engine.state_cache`), and a
prefill piece that takes snapshots runs in parts ending where it takes them. A sequence that stops running loses its
state otherwise, which is why a model with these layers is served without swap (its K/V alone would not bring a
sequence back), and why samples of one request prefill apart.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.gated_delta_config import GatedDeltaShape, StateShape
from engine.parallel import Collectives
from kernels import AttentionMetadata
from kernels import gated_delta
from kernels.pieces import Pieces
from kernels.transfer import to_device, to_device_tensor


class RecurrentStates:
    """Each state layer's state for `num_rows` rows of the persistent batch: conv [rows + 2, conv_dim, kernel - 1]
    in the model's dtype, ssm [rows + 2, *shape.ssm_state_shape] float32 (Gated DeltaNet's [num_v_heads,
    k_head_dim, v_head_dim], Mamba-2's [num_heads, head_dim, d_state], Mamba-1's [channels, d_state]); row
    `padding_row` is what a decode graph's padded rows read and write (`engine.cuda_graphs`), the last, `zero_row`,
    zeros that nothing writes: what a sequence starting at position 0 reads in a batched step. Grows (doubling)
    when the persistent batch hands out a row past it, but not once `frozen` (decode graphs captured: they hold these
    tensors). Owned by the model; one forward pass at a time."""

    def __init__(self, shape: StateShape, num_layers: int, dtype: torch.dtype, device: torch.device,
                 num_rows: int = 0, extra: RecurrentStates | None = None) -> None:
        self.shape, self.num_layers, self.dtype, self.device = shape, num_layers, dtype, device
        self.extra = extra   # states of another shape over the same rows, kept with these (Qwen4-Exp's PLE layers')
        self.conv: list[torch.Tensor] = []
        self.ssm: list[torch.Tensor] = []
        self.num_rows = 0
        self._frozen = False
        self.snap_conv: list[torch.Tensor] = []   # prefix caching's snapshot slots (`engine.state_cache`)
        self.snap_ssm: list[torch.Tensor] = []
        self.saves: dict[int, list[tuple[int, int]]] = {}   # this step's: sequence -> [(token offset, slot)]
        self.split: StepSplit | None = None   # this step's decodes beside its prefills (`for_step`)
        self.pieces: StepPieces | None = None   # this step's prefill pieces as one batch (`for_step`)
        if num_rows:
            self.reserve(num_rows)

    @property
    def padding_row(self) -> int:
        return self.num_rows

    @property
    def zero_row(self) -> int:
        return self.num_rows + 1

    @property
    def frozen(self) -> bool:
        return self._frozen

    @frozen.setter
    def frozen(self, value: bool) -> None:
        self._frozen = value
        if self.extra is not None:
            self.extra.frozen = value

    def reserve(self, num_rows: int) -> None:
        """Room for rows 0 .. num_rows - 1 (the states held so far kept)."""
        if self.extra is not None:
            self.extra.reserve(num_rows)
        if num_rows <= self.num_rows:
            return
        if self.frozen:
            raise RuntimeError(f"row {num_rows - 1} of the persistent batch is past the {self.num_rows} rows of "
                               "linear-attention state the decode graphs were captured with")
        conv = (num_rows + 2, *self.shape.conv_state_shape)
        ssm = (num_rows + 2, *self.shape.ssm_state_shape)
        old = self.num_rows
        self.conv = [_grown(self.conv[i] if old else None, conv, self.dtype, self.device)
                     for i in range(self.num_layers)]
        self.ssm = [_grown(self.ssm[i] if old else None, ssm, torch.float32, self.device)
                    for i in range(self.num_layers)]
        self.num_rows = num_rows

    def reserve_snapshots(self, num_slots: int) -> None:
        """`num_slots` snapshot slots, each one state of every layer: prefix caching's (made at start, never grown)."""
        if self.extra is not None:
            self.extra.reserve_snapshots(num_slots)
        self.snap_conv = [torch.zeros(num_slots, *self.shape.conv_state_shape, dtype=self.dtype, device=self.device)
                          for _ in range(self.num_layers)]
        self.snap_ssm = [torch.zeros(num_slots, *self.shape.ssm_state_shape, dtype=torch.float32, device=self.device)
                         for _ in range(self.num_layers)]

    def prepare(self, loads: list[tuple[int, int]], saves: list[tuple[int, int, int]]) -> None:
        """Before a step: copy each (slot, row) of `loads` into the row (a sequence resuming from a cached prefix),
        and hold `saves` (sequence, token offset, slot) for the step's layers to take (`StateMixer.scan`)."""
        if self.extra is not None:
            self.extra.prepare(loads, saves)
        if loads:
            slots = to_device([slot for slot, _ in loads], torch.int64, self.device)   # queued: the host goes on
            rows = to_device([row for _, row in loads], torch.int64, self.device)
            self.reserve(max(row for _, row in loads) + 1)
            for i in range(self.num_layers):
                self.conv[i].index_copy_(0, rows, self.snap_conv[i].index_select(0, slots))
                self.ssm[i].index_copy_(0, rows, self.snap_ssm[i].index_select(0, slots))
        self.saves = {}
        for seq, offset, slot in saves:
            self.saves.setdefault(seq, []).append((offset, slot))

    def save(self, layer: int, slot: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Layer `layer`'s state after a prefix (`conv`, `ssm`: one sequence's) into snapshot `slot`."""
        self.snap_conv[layer][slot] = conv
        self.snap_ssm[layer][slot] = ssm

    def store_pieces(self, layer: int, after: tuple[torch.Tensor, torch.Tensor],
                     start: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Layer `layer`'s states after the step's longer pieces scanned at once (`pieces`): `after` (conv, ssm) the
        state after each part, `start` each piece's state before its first token; each piece's last into its row,
        and the snapshots (`saves`) into their slots, by index."""
        at = self.pieces.tensors()
        self.conv[layer].index_copy_(0, at["rows"], after[0].index_select(0, at["last"]).to(self.dtype))
        self.ssm[layer].index_copy_(0, at["rows"], after[1].index_select(0, at["last"]))
        for slots, sources, (conv, ssm) in ((at["save_slots"], at["save_parts"], after),
                                            (at["start_slots"], at["start_seqs"], start)):
            if slots.numel():
                self.snap_conv[layer].index_copy_(0, slots, conv.index_select(0, sources).to(self.dtype))
                self.snap_ssm[layer].index_copy_(0, slots, ssm.index_select(0, sources))

    def for_step(self, meta: AttentionMetadata) -> None:
        """Make room for the step's rows (host ints: no device read)."""
        if meta.rows is None:
            raise ValueError("a model with linear-attention layers needs the persistent batch's rows in its metadata")
        top = max(meta.rows_list, default=-1) + 1
        if top > self.num_rows:
            self.reserve(max(top, 2 * self.num_rows))
        self.split = StepSplit.of(meta.query_lens_list, self.device)
        self.pieces = StepPieces.of(meta, self.saves, self.zero_row, self.device,
                                    pieces_a_pass(self.ssm[0], self.device))
        if self.extra is not None:   # the same split and pieces for the states beside these
            self.extra.split, self.extra.pieces = self.split, self.pieces

    @property
    def num_bytes(self) -> int:
        own = sum(t.numel() * t.element_size() for t in (*self.conv, *self.ssm, *self.snap_conv, *self.snap_ssm))
        return own + (self.extra.num_bytes if self.extra is not None else 0)


class StepSplit:
    """A step's one-token pieces (decodes, a one-token prompt) beside longer ones (prefill chunks), on the host and on
    the device once for all the step's layers: every one-token piece runs in one batched `StateMixer.step`, each
    longer one in its own chunked scan, wherever they sit in the batch. `seqs`: the one-token pieces' places in the
    batch; `index`: the same on the device; `tokens`: their tokens' places in the step; `order`: where each output of
    the batched step, then each of the longer pieces' tokens in batch order, goes among the step's tokens."""

    def __init__(self, seqs: list[int], index: torch.Tensor, tokens: torch.Tensor, order: torch.Tensor) -> None:
        self.seqs, self.index, self.tokens, self.order = seqs, index, tokens, order
        self.place = {seq: i for i, seq in enumerate(seqs)}

    @classmethod
    def of(cls, query_lens: list[int], device: torch.device) -> StepSplit | None:
        """None for a step of one-token pieces alone, or of longer ones alone (nothing to split)."""
        if all(n == 1 for n in query_lens) or all(n > 1 for n in query_lens):
            return None
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        seqs = [i for i, n in enumerate(query_lens) if n == 1]
        tokens = [starts[i] for i in seqs]
        # the longer pieces' tokens as ranges, not a list of a long chunk's ints; one copy to the device a step
        rest = [torch.arange(starts[i], starts[i + 1]) for i, n in enumerate(query_lens) if n > 1]
        flat, k = to_device_tensor(torch.cat([torch.tensor(seqs + tokens + tokens), *rest]), device), len(seqs)
        return cls(seqs, flat[:k], flat[k:2 * k], flat[2 * k:])


class StepPieces:
    """A step's longer pieces (prefill chunks) as one batch for a mixer that scans them at once
    (`StateMixer.scans_pieces`): their layout (`kernels.pieces.Pieces`: a piece in parts ending where it takes
    snapshots), and on the device, made at the first layer that asks: each piece's row (`rows`), the row its state
    starts from (`held`: the zero row at position 0), each piece's last part (`last`), and the snapshots taken after
    a part (`save_slots`, `save_parts`) or before the piece's first token (`start_slots`, `start_seqs`)."""

    def __init__(self, pieces: Pieces, ints: dict[str, list[int]], device: torch.device,
                 limits: tuple[int, int]) -> None:
        self.pieces, self._ints, self.device = pieces, ints, device
        self._tensors: dict[str, torch.Tensor] | None = None
        # scanned in groups of consecutive sequences within `limits` (tokens, sequences: `pieces_a_pass`)
        self.limits, self.groups = limits, pieces.groups(*limits)

    def groups_of(self, max_seqs: int | None) -> list[tuple[slice, slice, Pieces]]:
        """The groups, of at most `max_seqs` sequences where given (a mixer's `pieces_at_once`)."""
        if max_seqs is None:
            return self.groups
        return self.pieces.groups(self.limits[0], min(self.limits[1], max_seqs))

    @property
    def batched(self) -> bool:
        """Whether a group scans several parts at once (else each part alone costs no more)."""
        return any(pieces.num_parts > 1 for _, _, pieces in self.groups)

    @classmethod
    def of(cls, meta: AttentionMetadata, saves: dict[int, list[tuple[int, int]]], zero_row: int,
           device: torch.device, limits: tuple[int, int]) -> StepPieces | None:
        """None where the step has no piece longer than one token."""
        if all(n == 1 for n in meta.query_lens_list):   # a decode step
            return None
        ints: dict[str, list[int]] = {name: [] for name in ("rows", "held", "save_slots", "save_parts", "start_slots",
                                                            "start_seqs")}
        part_lens, seq_parts = [], []
        for seq, (row, n, seq_len) in enumerate(zip(meta.rows_list, meta.query_lens_list, meta.seq_lens_list)):
            if n == 1:   # in the batched step
                continue
            ints["rows"].append(row)
            ints["held"].append(zero_row if seq_len == n else row)
            cut, first = 0, len(part_lens)
            for end, slot in (*saves.get(seq, ()), (n, None)):
                if end > cut:
                    part_lens.append(end - cut)
                    cut = end
                if slot is None:
                    continue
                if len(part_lens) > first:   # the state after the part just cut
                    ints["save_slots"].append(slot)
                    ints["save_parts"].append(len(part_lens) - 1)
                else:                        # the state before the piece's first token
                    ints["start_slots"].append(slot)
                    ints["start_seqs"].append(len(seq_parts))
            seq_parts.append(len(part_lens) - first)
        return cls(Pieces(part_lens, seq_parts), ints, device, limits) if seq_parts else None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The index tensors above, and `last`, on the device (one copy, made once a step)."""
        if self._tensors is None:
            ints = {**self._ints, "last": self.pieces.last_parts}
            flat = to_device([i for values in ints.values() for i in values], torch.int64, self.device)
            self._tensors, at = {}, 0
            for name, values in ints.items():
                self._tensors[name], at = flat[at:at + len(values)], at + len(values)
        return self._tensors


CPU_PASS_BYTES = 2 << 20   # a batched step's states at once on a CPU (a core's L2 and its share of the L3)
# a CPU's longer pieces scanned together up to this many tokens (a longer one alone): short prompts share their
# launches, long ones keep their tiles in the cache (8 pieces of 512 tokens at once ran at 0.6-0.9x the speed)
CPU_PIECE_TOKENS = 512


def pieces_a_pass(ssm: torch.Tensor, device: torch.device) -> tuple[int, int]:
    """How many tokens and sequences a scan of the longer pieces takes at once: all on a GPU (two launches a layer);
    on a CPU up to `CPU_PIECE_TOKENS` tokens and `CPU_PASS_BYTES` of states (at least a sequence)."""
    if device.type != "cpu":
        return 1 << 62, 1 << 62
    return CPU_PIECE_TOKENS, max(1, CPU_PASS_BYTES // max(1, ssm[0].numel() * ssm.element_size()))


def _rows_a_pass(ssm: torch.Tensor, num_rows: int) -> int:
    """How many rows a batched step takes at once: all on a GPU (one launch each); on a CPU as many as
    `CPU_PASS_BYTES` of state hold (at least one), so that the step's passes over a group's states find them in the
    cache (at Qwen3.5's 2 MiB a row, 63 rows at once took 1.8x as long as one at a time, 2026-12-07)."""
    if ssm.device.type != "cpu":
        return max(num_rows, 1)
    return max(1, min(num_rows, CPU_PASS_BYTES // max(1, ssm[0].numel() * ssm.element_size())))


def _grown(old: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    new = torch.zeros(shape, dtype=dtype, device=device)
    if old is not None:
        new[:old.shape[0] - 2] = old[:-2]   # the rows held; the old padding and zero rows are not
    return new


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head's output (weight, not 1 + weight), times SiLU (or `act`: Qwen4-Exp's sigmoid) of
    its gate z, in transformers' order of roundings (`Qwen3_5RMSNormGated`)."""

    def __init__(self, dim: int, eps: float, act: str = "silu") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.act = torch.sigmoid if act == "sigmoid" else F.silu

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        # x, z: [num_tokens, num_v_heads, v_head_dim]
        xf = x.float()
        normed = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (normed * self.act(z.float())).to(x.dtype)


class StateMixer(nn.Module):
    """What a token mixer with a per-sequence state does with the step's rows, whatever its recurrence: the causal
    convolution from each sequence's conv state, then `step` (one token of many sequences: a decode step, batched;
    the rows gathered and scattered back) or `chunk` (one sequence's new tokens), each from and to its recurrent
    state; a step that starts a sequence at position 0 starts it from zeros. A subclass gives `layer` (its index
    among the model's state layers), the convolution (`conv1d.weight` [channels, 1, kernel], `conv1d.bias` or
    None; or its own `convolve` and `convolve_step`: lightning attention's pass the inputs through) and the two scans,
    which take the convolution's output and the per-token inputs `extras`."""

    layer: int
    conv_silu = True   # SiLU after the convolution (LFM2's short convolutions: none)
    scans_pieces = False   # a step's longer pieces through `convolve_pieces` and `chunk_pieces` at once
    pieces_at_once: int | None = None   # at most this many sequences a scan (its temporaries grow with them)

    def step(self, x: torch.Tensor, extras: tuple[torch.Tensor, ...], ssm: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def chunk(self, x: torch.Tensor, extras: tuple[torch.Tensor, ...], ssm: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def chunk_pieces(self, x: torch.Tensor, extras: tuple[torch.Tensor, ...], ssm: torch.Tensor, pieces: Pieces
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`chunk` over several sequences' tokens at once (`kernels.pieces`), ssm [num_seqs, ...] their states ->
        (the outputs, the state after each part); where `scans_pieces`."""
        raise NotImplementedError

    def scan(self, mixed: torch.Tensor, extras: tuple[torch.Tensor, ...], meta: AttentionMetadata,
             states: RecurrentStates) -> torch.Tensor:
        """mixed: [num_tokens, channels], the convolution's input for the step's tokens, sequence after sequence;
        extras: per-token tensors [num_tokens, ...] -> the scans' outputs, in token order. The one-token pieces run
        as one batched step, beside them (`RecurrentStates.split`) too; the longer pieces in one chunked scan where
        the mixer `scans_pieces` (`RecurrentStates.pieces`), else each in its own."""
        if all(n == 1 for n in meta.query_lens_list):   # one token of each sequence, all at once
            return self._step_rows(mixed, extras, meta.rows, meta.seq_lens, states, None)
        split, outs = states.split, []
        if split is not None:   # the decodes beside the prefills: at once, then each prefill
            pick = split.tokens
            outs.append(self._step_rows(mixed.index_select(0, pick), tuple(e.index_select(0, pick) for e in extras),
                                        meta.rows.index_select(0, split.index),
                                        meta.seq_lens.index_select(0, split.index), states, split.place))
        if self.scans_pieces and states.pieces.batched:
            outs.append(self._scan_pieces(mixed, extras, states))
        else:
            self._scan_each(mixed, extras, meta, states, outs)
        out = torch.cat(outs)
        return out if split is None else torch.empty_like(out).index_copy_(0, split.order, out)

    def _scan_each(self, mixed: torch.Tensor, extras: tuple[torch.Tensor, ...], meta: AttentionMetadata,
                   states: RecurrentStates, outs: list[torch.Tensor]) -> None:
        """Each longer piece in its own chunked scan, its outputs appended to `outs`."""
        conv, ssm, start = states.conv[self.layer], states.ssm[self.layer], 0
        for seq, (row, n, seq_len) in enumerate(zip(meta.rows_list, meta.query_lens_list, meta.seq_lens_list)):
            start += n
            if n == 1:   # in the batched step
                continue
            fresh = seq_len == n
            conv_in = torch.zeros_like(conv[row]) if fresh else conv[row]
            ssm_in = torch.zeros_like(ssm[row]) if fresh else ssm[row]
            cut = 0   # the piece in parts ending where it takes snapshots (`RecurrentStates.saves`)
            for end, slot in (*states.saves.get(seq, ()), (n, None)):
                if end > cut:
                    span = slice(start - n + cut, start - n + end)
                    x, conv_in = self.convolve(mixed[span], conv_in)
                    out, ssm_in = self.chunk(x, tuple(e[span] for e in extras), ssm_in)
                    outs.append(out)
                    cut = end
                if slot is not None:
                    states.save(self.layer, slot, conv_in, ssm_in)
            conv[row] = conv_in
            ssm[row] = ssm_in

    def _scan_pieces(self, mixed: torch.Tensor, extras: tuple[torch.Tensor, ...], states: RecurrentStates
                     ) -> torch.Tensor:
        """The longer pieces at once (`RecurrentStates.pieces`): one convolution and one chunked scan over all of
        them, each from its row's state (zeros at position 0), their states and snapshots written back."""
        step, split = states.pieces, states.split
        at = step.tensors()
        if split is not None:   # their tokens, among the step's
            rest = split.order[len(split.seqs):]
            mixed, extras = mixed.index_select(0, rest), tuple(e.index_select(0, rest) for e in extras)
        conv, ssm = states.conv[self.layer], states.ssm[self.layer]
        conv_start, ssm_start = conv.index_select(0, at["held"]), ssm.index_select(0, at["held"])
        outs, conv_after, ssm_after = [], [], []
        for tokens, seqs, pieces in step.groups_of(self.pieces_at_once):   # on a CPU a cache's worth at a time
            x, conv_part = self.convolve_pieces(mixed[tokens], conv_start[seqs], pieces)
            out, ssm_part = self.chunk_pieces(x, tuple(e[tokens] for e in extras), ssm_start[seqs], pieces)
            outs.append(out)
            conv_after.append(conv_part)
            ssm_after.append(ssm_part)
        out, conv_after, ssm_after = (t[0] if len(t) == 1 else torch.cat(t) for t in (outs, conv_after, ssm_after))
        states.store_pieces(self.layer, (conv_after, ssm_after), (conv_start, ssm_start))
        return out

    def _step_rows(self, mixed: torch.Tensor, extras: tuple[torch.Tensor, ...], rows: torch.Tensor,
                   seq_lens: torch.Tensor, states: RecurrentStates, place: dict[int, int] | None) -> torch.Tensor:
        """One token of each of the sequences in `rows` of the states (`seq_lens`: theirs, 1 for a one-token prompt,
        which starts from zeros): the convolution's and the recurrence's step, batched; the rows gathered and
        scattered back, snapshots taken where a piece ends on one. place: sequence -> its place here (None: the
        step's own order)."""
        conv, ssm = states.conv[self.layer], states.ssm[self.layer]
        # a one-token prompt (a decode graph's padded rows too: seq_lens 1) reads the zero row, not its own
        held = torch.where(seq_lens > 1, rows, states.zero_row)
        group, outs = _rows_a_pass(ssm, rows.shape[0]), []
        for lo in range(0, rows.shape[0], group):
            hi = lo + group
            x, conv_new = self.convolve_step(mixed[lo:hi], conv.index_select(0, held[lo:hi]))
            out, ssm_new = self.step(x, tuple(e[lo:hi] for e in extras), ssm.index_select(0, held[lo:hi]))
            conv.index_copy_(0, rows[lo:hi], conv_new.to(conv.dtype))
            ssm.index_copy_(0, rows[lo:hi], ssm_new)
            for seq, saves in states.saves.items():   # a 1-token piece ending on a snapshot's boundary
                if (i := seq if place is None else place.get(seq)) is not None and lo <= i < hi:
                    states.save(self.layer, saves[0][1], conv_new[i - lo], ssm_new[i - lo])
            outs.append(out)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def convolve(self, x: torch.Tensor, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's inputs x [num_tokens, channels] through the causal convolution from its state conv ->
        (the outputs, the new state)."""
        bias = getattr(self.conv1d, "bias", None)
        return gated_delta.causal_conv(x, self.conv1d.weight[:, 0], conv, bias, self.conv_silu)

    def convolve_step(self, x: torch.Tensor, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One input of each of many sequences, x [num_seqs, channels], from their states [num_seqs, ...]."""
        bias = getattr(self.conv1d, "bias", None)
        return gated_delta.causal_conv_step(x, self.conv1d.weight[:, 0], conv, bias, self.conv_silu)

    def convolve_pieces(self, x: torch.Tensor, conv: torch.Tensor, pieces: Pieces
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Several sequences' inputs (`kernels.pieces`), each from its state conv [num_seqs, ...] -> (the outputs,
        the state after each part)."""
        bias = getattr(self.conv1d, "bias", None)
        return gated_delta.causal_conv_pieces(x, self.conv1d.weight[:, 0], conv, pieces, bias, self.conv_silu)


class GatedDeltaNet(StateMixer):
    """One linear-attention layer. in_proj: the checkpoint's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a as
    one GEMM (rows in that order); the causal convolution over q, k and v; the gated delta rule
    (`kernels.gated_delta`) from each sequence's state; the gated norm; out_proj. Under tensor parallelism each rank
    holds its key heads and their value heads (column-parallel in_proj, its heads' states, row-parallel out_proj)."""

    def __init__(self, shape: GatedDeltaShape, hidden_size: int, eps: float, layer: int,
                 comm: Collectives | None = None) -> None:
        super().__init__()
        s = self.shape = shape                  # this rank's heads under tensor parallelism
        self.layer = layer                      # its index among the model's linear layers (its state's)
        self.comm = comm or Collectives()       # out_proj's partial outputs summed over the ranks
        self.in_proj = nn.Linear(hidden_size, s.conv_dim + s.value_dim + 2 * s.num_v_heads, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(s.conv_dim, 1, s.conv_kernel))
        self.dt_bias = nn.Parameter(torch.empty(s.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(s.num_v_heads))
        self.norm = GatedRMSNorm(s.v_head_dim, eps if s.norm_eps is None else s.norm_eps, s.gate_act)
        self.out_proj = nn.Linear(s.value_dim, hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata, states: RecurrentStates) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size], the step's tokens sequence after sequence -> [num_tokens, hidden_size];
        each sequence's state read from and written back to its row."""
        s = self.shape
        mixed, z, b, a = self.in_proj(hidden).split([s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads], dim=-1)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)        # log decay, <= 0
        beta = b.sigmoid() * s.beta_scale if s.beta_scale != 1.0 else b.sigmoid()
        out = self.scan(mixed, (g, beta), meta, states)
        out = self.norm(out.to(hidden.dtype), z.unflatten(-1, (s.num_v_heads, s.v_head_dim)))
        return self.comm.all_reduce(self.out_proj(out.flatten(1)))

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        q, k, v = x.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        return (q.unflatten(-1, (s.num_k_heads, s.k_head_dim)), k.unflatten(-1, (s.num_k_heads, s.k_head_dim)),
                v.unflatten(-1, (s.num_v_heads, s.v_head_dim)))

    def step(self, x, extras, ssm):
        return gated_delta.recurrent_step(*self._split(x), *extras, ssm)

    def chunk(self, x, extras, ssm):
        return gated_delta.chunked(*self._split(x), *extras, ssm)

    scans_pieces = True

    def chunk_pieces(self, x, extras, ssm, pieces):
        return gated_delta.chunked_pieces(*self._split(x), *extras, ssm, pieces)
