"""Fault injection for tests and `cliffguard bench chaos`: faults that no input reproduces on purpose.

Read once by the device worker from its environment (the gateway's, which spawned it); without these
variables nothing here runs and no prompt is decoded.

- `CLIFFGUARD_FAULT_POISON=<marker>`: a request whose prompt contains `marker` makes the next step
  raise, so the worker dies with `Fatal`: a request that crashes the worker (the gateway's two-death
  rule answers it 500 `poison_request`).
- `CLIFFGUARD_FAULT_REJECT=<marker>`: adding a request whose prompt contains `marker` raises
  RuntimeError: a failure of one request's handling, which fails that request alone (500
  `request_failed`) and leaves the worker serving.

A prompt is matched as text: a prompt of token ids (what the gateway sends) is decoded with the
engine's tokenizer once, when it is added.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

POISON_ENV = "CLIFFGUARD_FAULT_POISON"
REJECT_ENV = "CLIFFGUARD_FAULT_REJECT"


class InjectedFault(RuntimeError):
    """A fault `Faults` raised on purpose."""


@dataclass
class Faults:
    """The markers in force, and the poisoned requests added so far (request ids)."""

    poison: str | None = None
    reject: str | None = None
    poisoned: set[str] = field(default_factory=set)

    @classmethod
    def from_env(cls) -> "Faults | None":
        poison, reject = os.environ.get(POISON_ENV) or None, os.environ.get(REJECT_ENV) or None
        return cls(poison, reject) if poison or reject else None

    def on_add(self, engine, request_id: str, prompt: str | Sequence[int]) -> None:
        """Before `engine.add_request`: InjectedFault for a reject marker; remember a poison marker."""
        text = prompt if isinstance(prompt, str) else engine.tokenizer.decode(list(prompt))
        if self.reject is not None and self.reject in text:
            raise InjectedFault(f"fault injection: the prompt holds {REJECT_ENV}'s marker")
        if self.poison is not None and self.poison in text:
            self.poisoned.add(request_id)

    def before_step(self, engine) -> None:
        """InjectedFault while a poisoned request is in the engine (the step 'fails because of it')."""
        live = self.poisoned & engine.requests.keys()
        self.poisoned &= live
        if live:
            raise InjectedFault(f"fault injection: a step with request {min(live)!r}, whose prompt holds "
                                f"{POISON_ENV}'s marker")
