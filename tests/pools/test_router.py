"""The router alone: pools as specs and limits, prompts as fake tokenizers (no model, milliseconds)."""

from __future__ import annotations

import pytest

from pools.pool import Pool
from pools.router import NoRouteError, Router, UnknownModelError
from pools.config.spec import PoolSpec, RouteSpec

MODEL = "builtin:smollm2-135m-instruct"


def _make_pool(name: str, route: RouteSpec, *, max_model_len: int = 512, counter: object | None = None,
               model: str = MODEL) -> Pool:
    spec = PoolSpec(name=name, model=model, route=route, kv_share=0.5)
    return Pool(spec, tokenizer=None, counter=counter or object(), prefix_ids=[], max_model_len=max_model_len)


def _make_router(counter: object | None = None) -> Router:
    counter = counter or object()
    return Router([_make_pool("chat", RouteSpec(max_prompt_tokens=64), counter=counter),
                   _make_pool("rag", RouteSpec(min_prompt_tokens=65), max_model_len=1024, counter=counter)])


def test_the_first_pool_in_file_order_that_admits_the_exact_count():
    router = _make_router()
    for n, name in ((0, "chat"), (64, "chat"), (65, "rag"), (1023, "rag")):
        pool, ids = router.route("smollm2-135m-instruct", lambda pool: list(range(n)))
        assert (pool.name, len(ids)) == (name, n)


def test_a_pool_that_cannot_count_the_prompt_leaves_it_to_the_next_and_says_why_where_it_was_its_to_take():
    """An upstream pool's stand-in tokenizer without a chat template (or whose template refuses what the
    upstream takes) once made every chat request a 400, those a later pool would have served too. A prompt
    that was that pool's to take (its length in its route by the others' count) still gets its reason, not a
    misleading "too long"."""
    router = Router([_make_pool("cloud", RouteSpec(max_prompt_tokens=64)),
                     _make_pool("local", RouteSpec(min_prompt_tokens=65), max_model_len=4096)])

    def tokenize(n):
        def count(pool):
            if pool.name == "cloud":
                raise ValueError("chat template: model folder ./gpt has none")
            return [1] * n
        return count

    assert router.route("smollm2-135m-instruct", tokenize(100))[0].name == "local"
    with pytest.raises(ValueError, match="has none"):          # 10 tokens: cloud's to take, and it cannot
        router.route("smollm2-135m-instruct", tokenize(10))
    with pytest.raises(NoRouteError, match="takes a prompt of this length") as info:   # nobody's: too long
        router.route("smollm2-135m-instruct", tokenize(5000))
    assert "'local'" in str(info.value)
    with pytest.raises(TypeError):                              # not a pool's refusal: a fault, raised at once
        router.route("smollm2-135m-instruct", lambda pool: (_ for _ in ()).throw(TypeError("bug")))


def test_one_tokenization_per_distinct_tokenizer():
    calls = []
    shared = object()
    router = _make_router(shared)
    pool, _ = router.route("smollm2-135m-instruct", lambda pool: calls.append(pool.name) or [1] * 100)
    assert pool.name == "rag" and calls == ["chat"]   # rag shares chat's counter: not tokenized again
    router = Router([_make_pool("chat", RouteSpec(max_prompt_tokens=64)),
                     _make_pool("rag", RouteSpec(min_prompt_tokens=65))])
    calls.clear()
    router.route("smollm2-135m-instruct", lambda pool: calls.append(pool.name) or [1] * 100)
    assert calls == ["chat", "rag"]


def test_errors_name_the_model_the_count_and_every_pools_limits():
    router = _make_router()
    with pytest.raises(UnknownModelError, match="model: 'gpt-9' is not served here; available: "
                                                "smollm2-135m-instruct"):
        router.route("gpt-9", lambda pool: [1])
    with pytest.raises(NoRouteError) as info:
        router.route("smollm2-135m-instruct", lambda pool: [1] * 1024)
    assert str(info.value) == ("1024 tokens; no pool of model 'smollm2-135m-instruct' takes a prompt of this "
                               "length (pool 'chat' takes 0..64; pool 'rag' takes 65..1023)")
    assert info.value.num_prompt_tokens == 1024
    # pools whose tokenizers count the prompt differently: each pool's count beside its limits (the first's
    # alone read as if it were every pool's: 1024 tokens, and rag takes 65..1023)
    router = Router([_make_pool("chat", RouteSpec(max_prompt_tokens=64)),
                     _make_pool("rag", RouteSpec(min_prompt_tokens=65, max_prompt_tokens=512))])
    with pytest.raises(NoRouteError) as info:
        router.route("smollm2-135m-instruct", lambda pool: [1] * (1024 if pool.name == "chat" else 600))
    assert str(info.value) == ("no pool of model 'smollm2-135m-instruct' takes this prompt (pool 'chat' takes 0..64, "
                               "1024 tokens by its tokenizer; pool 'rag' takes 65..511, 600 tokens by its tokenizer)")


def test_a_pool_admits_up_to_its_context_less_one_token():
    pool = _make_pool("p", RouteSpec(max_prompt_tokens=4096), max_model_len=512)
    assert pool.max_prompt_tokens == 511 and pool.admits(511) and not pool.admits(512)
    assert pool.device == "default" and pool.model_name == "smollm2-135m-instruct"
