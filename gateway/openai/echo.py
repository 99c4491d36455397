"""`echo` on /v1/completions: each choice's text begins with its prompt, and with `logprobs` its logprobs begin with
the prompt's tokens', the first token's logprob and top_logprobs null (nothing comes before it), as OpenAI's and
vLLM's. What lm-evaluation-harness's loglikelihood requests read (`echo`, `max_tokens: 0`, `logprobs: 1`, token-id
prompts): a continuation's logprob summed from `token_logprobs`, and whether greedy would have written it from
`top_logprobs`.

The engine computes them (`SamplingParams.prompt_logprobs`, the model's raw logits): the whole prompt, never taken
from the prefix cache. A string prompt is echoed as sent, a token-id one decoded (special tokens kept); the prompt's
tokens' `text_offset`s count from 0, the generated ones' from the echoed text's end."""

from __future__ import annotations

from typing import Any

from gateway.openai import objects
from pools.pool import Pool

__all__ = ["echo_text", "prompt_logprobs", "joined"]


def echo_text(prompt: str | list[int], pool: Pool) -> str:
    """What a choice's text begins with: the prompt as sent, or its token ids decoded."""
    return prompt if isinstance(prompt, str) else pool.tokenizer.decode(prompt, skip_special_tokens=False)


def prompt_logprobs(ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]],
                    pool: Pool) -> dict[str, Any]:
    """The completions logprobs object of a prompt's tokens `ids` (`logprobs` and `top`: of ids[1:], the engine's
    prompt logprobs): the first token's null."""
    head, end = objects.completion_logprobs_from(ids[:1], [0.0], [[]], pool.token_text, pool.token_bytes)
    rest = objects.completion_logprobs(ids[1:], logprobs, top, pool.token_text, pool.token_bytes, end, ids[:1])
    return {"tokens": head["tokens"] + rest["tokens"], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": head["text_offset"] + rest["text_offset"]}


def joined(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """Two logprobs objects of consecutive tokens as one."""
    return first if then is None else {key: first[key] + then[key] for key in first}
