"""Fault injection for tests and `cliffguard bench chaos`: faults that no input reproduces on purpose.

Read once by the device worker from its environment (the gateway's, which spawned it); without these
variables nothing here runs and no prompt is decoded.

- `CLIFFGUARD_FAULT_POISON=<marker>`: a request whose prompt contains `marker` makes the next step
  raise, so the worker dies with `Fatal`: a request that crashes the worker (the gateway's two-death
  rule answers it 500 `poison_request`).
- `CLIFFGUARD_FAULT_REJECT=<marker>`: adding a request whose prompt contains `marker` raises
  RuntimeError: a failure of one request's handling, which fails that request alone (500
  `request_failed`) and leaves the worker serving.
- `CLIFFGUARD_FAULT_SLOW_STEP=<marker>:<seconds>`: the first step with a request whose prompt contains
  `marker` lasts `seconds` longer (a sleep inside the step): a long healthy step, as a first kernel
  compile or a huge prefill chunk makes one, which the watchdog must not take for a hang.
- `CLIFFGUARD_FAULT_SLOW_LOAD=<seconds>`: the worker sleeps that long before it loads the model: a
  large model's load, during which the gateway may go away (`slow_load`).

A prompt is matched as text: a prompt of token ids (what the gateway sends) is decoded with the
engine's tokenizer once, when it is added.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

POISON_ENV = "CLIFFGUARD_FAULT_POISON"
REJECT_ENV = "CLIFFGUARD_FAULT_REJECT"
SLOW_STEP_ENV = "CLIFFGUARD_FAULT_SLOW_STEP"
SLOW_LOAD_ENV = "CLIFFGUARD_FAULT_SLOW_LOAD"


def slow_load() -> None:
    """Before the worker loads its model: sleep `CLIFFGUARD_FAULT_SLOW_LOAD` seconds, if set."""
    if os.environ.get(SLOW_LOAD_ENV):
        time.sleep(float(os.environ[SLOW_LOAD_ENV]))


class InjectedFault(RuntimeError):
    """A fault `Faults` raised on purpose."""


@dataclass
class Faults:
    """The markers in force, and the poisoned requests added so far (request ids)."""

    poison: str | None = None
    reject: str | None = None
    slow: tuple[str, float] | None = None    # (marker, extra seconds of one step)
    poisoned: set[str] = field(default_factory=set)
    slowed: set[str] = field(default_factory=set)   # requests whose first step is still to be slowed

    @classmethod
    def from_env(cls) -> "Faults | None":
        poison, reject = os.environ.get(POISON_ENV) or None, os.environ.get(REJECT_ENV) or None
        slow = None
        if os.environ.get(SLOW_STEP_ENV):
            marker, _, seconds = os.environ[SLOW_STEP_ENV].rpartition(":")
            slow = (marker, float(seconds))
        return cls(poison, reject, slow) if poison or reject or slow else None

    def on_add(self, engine, request_id: str, prompt: str | Sequence[int]) -> None:
        """Before `engine.add_request`: InjectedFault for a reject marker; remember a poison marker."""
        text = prompt if isinstance(prompt, str) else engine.tokenizer.decode(list(prompt))
        if self.reject is not None and self.reject in text:
            raise InjectedFault(f"fault injection: the prompt holds {REJECT_ENV}'s marker")
        if self.poison is not None and self.poison in text:
            self.poisoned.add(request_id)
        if self.slow is not None and self.slow[0] in text:
            self.slowed.add(request_id)

    def before_step(self, engine) -> None:
        """InjectedFault while a poisoned request is in the engine (the step 'fails because of it')."""
        slowed = self.slowed & engine.requests.keys()
        self.slowed.clear()
        if slowed:
            time.sleep(self.slow[1])   # the GIL is free: the heartbeat thread beats on
        live = self.poisoned & engine.requests.keys()
        self.poisoned &= live
        if live:
            raise InjectedFault(f"fault injection: a step with request {min(live)!r}, whose prompt holds "
                                f"{POISON_ENV}'s marker")
