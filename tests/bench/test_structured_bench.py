"""`cliffguard bench structured`: its options checked before the model loads."""

from __future__ import annotations

import pytest

from gateway.cli import main


@pytest.mark.parametrize("flag", ["--repeats", "--max-tokens"])
def test_a_count_below_1_is_refused_naming_its_option(flag, capsys):
    """`--repeats 0` divided by zero after the model had loaded, with a traceback."""
    assert main(["bench", "structured", flag, "0"]) == 2
    assert f"{flag}: must be >= 1, got 0" in capsys.readouterr().err
