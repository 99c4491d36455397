"""Route a request to a pool by its model name and exact prompt token count.

Pools are tried in the order of the configuration file; the first whose route admits the count wins.
The count comes from the pool's own tokenizer (`pools.tokencount.TokenCounter`), so it is the same
number the engine will see. Synchronous and HTTP-free: the gateway runs `Router.route` in its
tokenizer thread when the prompt is long.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from pools.pool import Pool


class UnknownModelError(LookupError):
    """No pool serves the requested model name. The message starts with `model:`."""


class NoRouteError(ValueError):
    """No pool of the model admits the prompt; the message has its count and every pool's limits, each pool's
    count beside its limits where the pools' tokenizers count it differently (no field prefix: the caller
    names the field, `prompt` or `messages`). `num_prompt_tokens`: the first pool's count."""

    def __init__(self, model_name: str, counts: Sequence[int], pools: Sequence[Pool]) -> None:
        one = len(set(counts)) == 1
        limits = "; ".join(f"pool {p.name!r} takes {p.min_prompt_tokens}..{p.max_prompt_tokens}"
                           + ("" if one else f", {n} tokens by its tokenizer") for p, n in zip(pools, counts))
        super().__init__(f"{counts[0]} tokens; no pool of model {model_name!r} takes a prompt of this length "
                         f"({limits})" if one else f"no pool of model {model_name!r} takes this prompt ({limits})")
        self.model_name = model_name
        self.num_prompt_tokens = counts[0]


class Router:
    """The pools by the model name clients send, each model's in configuration order."""

    def __init__(self, pools: Sequence[Pool]) -> None:
        self.pools = list(pools)
        self._by_model: dict[str, list[Pool]] = {}
        for pool in self.pools:
            self._by_model.setdefault(pool.model_name, []).append(pool)

    def candidates(self, model_name: str) -> list[Pool]:
        """The pools serving `model_name`, in configuration order; UnknownModelError if none."""
        pools = self._by_model.get(model_name)
        if not pools:
            raise UnknownModelError(
                f"model: {model_name!r} is not served here; available: {', '.join(self._by_model) or 'none'}")
        return pools

    def route(self, model_name: str, tokenize: Callable[[Pool], list[int]],
              key: Callable[[Pool], Hashable] = lambda pool: id(pool.counter)) -> tuple[Pool, list[int]]:
        """The first candidate pool whose route admits the prompt's exact count, and the prompt's ids.

        `tokenize(pool)` gives the prompt's token ids as that pool's tokenizer makes them; it is
        called once per distinct `key(pool)` (by default the pool's tokenizer, `Pool.counter`; a caller
        whose ids depend on more of the pool, such as its chat template's variables, says so in the key)
        and its errors propagate. Raises UnknownModelError or NoRouteError.
        """
        pools = self.candidates(model_name)
        ids_by_key: dict[Hashable, list[int]] = {}
        for pool in pools:
            k = key(pool)
            if k not in ids_by_key:
                ids_by_key[k] = tokenize(pool)
            ids = ids_by_key[k]
            if pool.admits(len(ids)):
                return pool, ids
        raise NoRouteError(model_name, [len(ids_by_key[key(pool)]) for pool in pools], pools)
