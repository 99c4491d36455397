"""What changes a row's logits before sampling besides its grammar: `logit_bias`, and the repetition,
presence and frequency penalties read from token counts the sampler keeps on the device (`PenaltyCounts`).

The formulas are the sampler's (engine/sampler.py): the repetition penalty divides the positive logits
(multiplies the negative ones) of every token in the prompt or the output, as HF transformers; the
frequency and presence penalties subtract `count * frequency_penalty + (count > 0) * presence_penalty`
over the output, as OpenAI.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.transfer import to_device, to_device_tensor


MIN_ROWS = 8   # the table's first capacity; it doubles from there


def table_bytes(num_rows: int, vocab_size: int) -> int:
    """The most a `PenaltyCounts` holds for `num_rows` penalized sequences at once: 5 bytes a token (int32 counts,
    a bool of the prompt's) for each row of its capacity (a power of two from MIN_ROWS), and while it doubles to
    that capacity, for the half before it too."""
    capacity = MIN_ROWS
    while capacity < num_rows:
        capacity *= 2
    return 5 * vocab_size * (capacity + capacity // 2 if capacity > MIN_ROWS else capacity)


class PenaltyCounts:
    """Per-sequence token counts on the device, for the penalties, kept from step to step.

    A sequence that uses a penalty gets a row the first time it is sampled: `counts[row]` [vocab] int32
    holds how often each token occurs in its output, `in_prompt[row]` [vocab] bool which tokens its prompt
    holds, both filled once from its tokens. After each step the sampled tokens are added to their rows
    in one scatter (`record`), so a step's penalties cost O(rows x vocab) on the device whatever the
    outputs' lengths, and never walk the tokens in Python. Rows are reused after `release` (the engine's, when
    a sequence stops running: finished, preempted or swapped out; one that runs again is filled anew), so
    the rows in use are the running sequences' that use a penalty; the tensors double when full
    (`table_bytes`). Owned by the `Sampler`.
    """

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)       # [capacity, vocab]
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)     # [capacity, vocab]
        self._rows: dict[int, int] = {}     # sequence key -> row
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._rows)

    def rows(self, sampling_rows: Sequence) -> tuple[torch.Tensor, list[int]]:
        """The rows of `sampling_rows` (`engine.sampling.SamplingRow`s) as [len] int64 on the device, each
        filled from its tokens the first time; and the rows made for keyless sampling rows, to `free`
        after the call."""
        rows, temporary = [], []
        for row in sampling_rows:
            index = self._rows.get(row.key) if row.key is not None else None
            if index is None:
                index = self._fill(row)
                if row.key is None:
                    temporary.append(index)
                else:
                    self._rows[row.key] = index
            rows.append(index)
        return to_device(rows, torch.int64, self.device), temporary

    def record(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Add one sampled token to each row: rows, token_ids [n] on the device."""
        self.counts.index_put_((rows, token_ids), torch.ones_like(rows, dtype=torch.int32), accumulate=True)

    def release(self, key: int) -> None:
        """The sequence `key` ended: its row is free again (nothing if it has none)."""
        index = self._rows.pop(key, None)
        if index is not None:
            self._free.append(index)

    def free(self, rows: list[int]) -> None:
        self._free.extend(rows)

    def _fill(self, row) -> int:
        """A free row filled from the sequence's tokens (its one walk over them). The ids are filtered on
        the host (no placeholders, none past the logits): a boolean mask of a CUDA tensor waits for the
        device (its count), which would stall the launch of the step that first samples a penalized row."""
        if not self._free:
            self._grow()
        index = self._free.pop()
        ids = torch.tensor(row.token_ids, dtype=torch.int64)
        prompt, output = ids[:len(ids) - row.num_output_tokens], ids[len(ids) - row.num_output_tokens:]
        prompt = to_device_tensor(prompt[prompt < self.vocab_size], self.device)
        output = to_device_tensor(output[(output >= 0) & (output < self.vocab_size)], self.device)
        self.counts[index].zero_()
        self.in_prompt[index].zero_()
        self.in_prompt[index, prompt] = True
        self.counts[index].index_put_((output,), torch.ones_like(output, dtype=torch.int32), accumulate=True)
        return index

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(MIN_ROWS, 2 * old)
        for name in ("counts", "in_prompt"):   # a table at a time, the old one beside the new only (`table_bytes`)
            table = getattr(self, name)
            grown = table.new_zeros(new, self.vocab_size)
            grown[:old] = table
            setattr(self, name, grown)
        self._free.extend(range(new - 1, old - 1, -1))


def adjust_logits(logits: torch.Tensor, rows: Sequence, idx: list[int],
                  penalties: PenaltyCounts | None, penalty_rows: torch.Tensor | None) -> None:
    """Rows `idx` of logits, in place: + logit_bias, then the repetition, frequency and presence penalties
    of the rows that set one, read from their `penalty_rows` of `penalties` (in idx order). `rows`: the
    step's sampling rows (`engine.sampling.SamplingRow`s)."""
    # logits: [num_rows, vocab] float32
    device, vocab_size = logits.device, logits.shape[1]
    idx_t = to_device(idx, torch.int64, device)
    x = logits[idx_t]                                           # [num_adjusted, vocab], a copy
    sub = [rows[i] for i in idx]
    if any(row.params.logit_bias for row in sub):
        row_ids, token_ids, values = [], [], []
        for j, row in enumerate(sub):
            pairs = [(t, v) for t, v in row.params.logit_bias if t < vocab_size]
            row_ids += [j] * len(pairs)
            token_ids += [t for t, _ in pairs]
            values += [v for _, v in pairs]
        if row_ids:
            x.index_put_((to_device(row_ids, torch.int64, device), to_device(token_ids, torch.int64, device)),
                         to_device(values, torch.float32, device), accumulate=True)
    penalized = [j for j, row in enumerate(sub) if row.params.penalizes]
    if penalized:
        every = len(penalized) == len(sub)
        pen_t = None if every else to_device(penalized, torch.int64, device)
        y = x if every else x[pen_t]                              # [num_penalized, vocab]
        params = [sub[j].params for j in penalized]
        counts = penalties.counts[penalty_rows]                   # [num_penalized, vocab] int32
        if any(p.repetition_penalty != 1 for p in params):
            seen = penalties.in_prompt[penalty_rows] | (counts > 0)
            penalty = to_device([p.repetition_penalty for p in params], torch.float32, device).unsqueeze(1)
            y = torch.where(seen, torch.where(y > 0, y / penalty, y * penalty), y)
        if any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params):
            frequency = to_device([p.frequency_penalty for p in params], torch.float32, device).unsqueeze(1)
            presence = to_device([p.presence_penalty for p in params], torch.float32, device).unsqueeze(1)
            y = y - (counts * frequency + (counts > 0).float() * presence)
        if every:
            x = y
        else:
            x[pen_t] = y
    logits[idx_t] = x
