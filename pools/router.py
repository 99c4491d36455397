"""Route a request to a pool by its model name and exact prompt token count.

Pools are tried in the order of the configuration file; the first whose route admits the count wins.
The count comes from the pool's own tokenizer (`pools.tokencount.TokenCounter`), so it is the same
number the engine will see.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pools.spec import RouteSpec


class UnknownModelError(LookupError):
    """No pool serves the requested model name."""


class NoRouteError(ValueError):
    """No pool of the model admits a prompt of this many tokens; the message has the count and the limits."""


@dataclass(frozen=True)
class RouteTarget:
    """What the router needs to know about one pool."""

    name: str
    model_name: str          # the `model` clients send
    route: RouteSpec
    max_model_len: int       # a prompt must also leave room for one generated token

    @property
    def min_tokens(self) -> int:
        return self.route.min_prompt_tokens

    @property
    def max_tokens(self) -> int:
        """The largest admitted prompt: the route's bound, capped at max_model_len - 1."""
        return self.route.upper(self.max_model_len)

    def admits(self, num_prompt_tokens: int) -> bool:
        return self.route.admits(num_prompt_tokens, self.max_model_len)


class Router:
    def __init__(self, targets: Sequence[RouteTarget]) -> None:
        self.targets = list(targets)
        self._by_model: dict[str, list[RouteTarget]] = {}
        for target in self.targets:
            self._by_model.setdefault(target.model_name, []).append(target)

    @property
    def model_names(self) -> list[str]:
        return list(self._by_model)

    def candidates(self, model_name: str) -> list[RouteTarget]:
        """The pools serving `model_name`, in configuration order; UnknownModelError if none."""
        targets = self._by_model.get(model_name)
        if not targets:
            raise UnknownModelError(
                f"model: {model_name!r} is not served here; available: {', '.join(self._by_model) or 'none'}")
        return targets

    def route(self, model_name: str, num_prompt_tokens: int) -> RouteTarget:
        targets = self.candidates(model_name)
        for target in targets:
            if target.admits(num_prompt_tokens):
                return target
        limits = "; ".join(f"pool {t.name!r} takes {t.min_tokens}..{t.max_tokens}" for t in targets)
        raise NoRouteError(f"prompt: {num_prompt_tokens} tokens; no pool of model {model_name!r} takes a "
                           f"prompt of this length ({limits})")
