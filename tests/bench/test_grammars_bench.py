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
