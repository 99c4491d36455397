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
        whose ids depend on more of the pool, such as its chat template's variables, says so in the key).
        A pool whose `tokenize` raises ValueError (its chat template refuses the messages, an upstream pool's
        stand-in tokenizer has none, an id past its vocabulary) takes no prompt, and the next is tried; when
        no pool admits the prompt, that error propagates if its pool's route takes one of the counts the
        others made (the prompt was that pool's to take), or if no pool could count it. Raises
        UnknownModelError or NoRouteError.
        """
        pools = self.candidates(model_name)
        ids_by_key: dict[Hashable, list[int]] = {}
        errors: dict[Hashable, Exception] = {}
        for pool in pools:
            k = key(pool)
            if k not in ids_by_key and k not in errors:
                try:
                    ids_by_key[k] = tokenize(pool)
                except ValueError as exc:   # this pool cannot count it: another one may
                    errors[k] = exc
            if k in errors:
                continue
            ids = ids_by_key[k]
            if pool.admits(len(ids)):
                return pool, ids
        counted = [pool for pool in pools if key(pool) in ids_by_key]
        counts = [len(ids_by_key[key(pool)]) for pool in counted]
        for pool in pools:   # a pool that could not count it, whose route takes its length: its reason, not ours
            if key(pool) in errors and (not counted or any(pool.admits(n) for n in counts)):
                raise errors[key(pool)]
        raise NoRouteError(model_name, counts, counted)
