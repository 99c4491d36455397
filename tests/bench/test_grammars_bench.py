"""`cliffguard bench grammars`: what its per-token figure divides by."""

from __future__ import annotations

import time

from bench.grammars import _Lib, measure


class _Refusing(_Lib):
    """A library whose mask takes 2 ms a token and which refuses every instance at its first token."""

    name = "refusing"

    def compile(self, schema):
        return schema

    def matcher(self, compiled):
        return None

    def fill(self, matcher, bitmask, row):
        time.sleep(0.002)

    def accept(self, matcher, token):
        return False


def test_the_mask_time_per_token_counts_only_the_tokens_walked():
    """A library that refuses an instance at its first token walked one token, not the instance's 100: it
    read 100 times faster per token than it is."""
    out = measure(_Refusing(), [("s", "{}", list(range(100)))], vocab_size=128, batch=1)
    assert out["failures"] == {"s": "rejected the instance at token 0"}
    assert out["mask_us_per_token_batch1"] >= 1500, out


class _Walking(_Lib):
    """A library that accepts every token; its matchers remember what they accepted, its batched fills how
    many rows each had."""

    name = "walking"

    def __init__(self) -> None:
        self.batches: list[int] = []

    def compile(self, schema):
        return schema

    def matcher(self, compiled):
        return []

    def fill(self, matcher, bitmask, row):
        pass

    def fill_batch(self, matchers, bitmask):
        self.batches.append(len(matchers))

    def accept(self, matcher, token):
        matcher.append(token)
        return True


def test_the_batched_figure_has_every_row_for_as_many_steps_as_the_longest_instance():
    """The lockstep loop stopped once the shortest instance ended: 'mask us/step b32' timed only the first 7 of
    up to 50 steps (each JSON's opening). A row at its instance's end starts it again; every step has them all."""
    lib = _Walking()
    out = measure(lib, [("short", "{}", [1, 2]), ("long", "{}", list(range(10)))], vocab_size=128, batch=4)
    assert lib.batches == [4] * 10 and out["mask_us_per_step_batch4"] is not None
