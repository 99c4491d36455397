"""`POST /tokenize` and `POST /detokenize`, as vLLM's server has them: a prompt's token ids counted exactly as a
completion would count them, without generating. A RAG application sizes its chunks and checks a conversation
against the context with the model's own tokenizer and chat template, and sees the pool its prompt would go to.

`/tokenize` takes `model` and either `prompt` (a completion's text; `add_special_tokens`, default true, the ids the
tokenizer adds around it, as `/v1/completions` counts them) or `messages` (a chat, with `tools`,
`chat_template_kwargs`, `add_generation_prompt` and `continue_final_message` read as `/v1/chat/completions` reads
them; its prompt is what the template writes, so `add_special_tokens` is false there), and `return_token_strs`. It
answers `count`, `max_model_len` and `tokens` of the pool the prompt routes to, `pool` (its name), and `token_strs`
(each token's text, as logprobs show it) where asked. A prompt no pool takes is the 400 a completion gets.
`/detokenize` takes `model` and `tokens` (ids in the model's vocabulary) and answers `prompt`, their text with special
tokens written out."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.handlers import parsed, read_json
from gateway.openai.chat import parse_chat
from gateway.openai.errors import bad_request
from gateway.runtime import GATEWAY, Gateway, model_not_found
from pools.router import UnknownModelError

_OWN_FIELDS = ("add_special_tokens", "return_token_strs")   # /tokenize's, beside a chat's or a prompt's


def setup(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)


async def tokenize(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("body", f"must be a JSON object, got {type(body).__name__}")
    own = {key: _flag(body, key) for key in _OWN_FIELDS if key in body}
    rest = {key: value for key, value in body.items() if key not in _OWN_FIELDS}
    if "messages" in rest:
        if "prompt" in rest:
            raise bad_request("prompt", "give messages (a chat) or prompt (a completion's text), not both")
        if own.get("add_special_tokens"):
            raise bad_request("add_special_tokens", "a chat's prompt is what its template writes: true is taken "
                                                    "with prompt only")
        req = await parsed(gateway, parse_chat, rest, gateway.config.gateway.limits)
        pool, ids = await gateway.route_chat(req.model, req.messages, req.tools, req.chat_template_kwargs,
                                             req.offers_calls)
    else:
        pool, ids = await _route_text(gateway, rest, own.get("add_special_tokens", True))
    answer = {"count": len(ids), "max_model_len": pool.max_model_len, "tokens": ids,
              "token_strs": [pool.token_text(i) for i in ids] if own.get("return_token_strs") else None,
              "pool": pool.name}
    return web.json_response(answer)


async def _route_text(gateway: Gateway, body: dict[str, Any], special: bool):
    """A completion prompt's pool and ids (`special`: with what the tokenizer adds around the text)."""
    unknown = sorted(set(body) - {"model", "prompt"})
    if unknown:
        raise bad_request(unknown[0], "not a field of /tokenize (model, prompt or messages, and a chat's fields, "
                                      "add_special_tokens, return_token_strs)")
    model, prompt = _model(body), body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("prompt" if "prompt" in body else "messages",
                          "a completion's text (prompt, a string) or a chat (messages) is required")
    return await gateway.route_prompt(model, prompt, around=special)


async def detokenize(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("body", f"must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - {"model", "tokens"})
    if unknown:
        raise bad_request(unknown[0], "not a field of /detokenize (model, tokens)")
    model, tokens = _model(body), body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise bad_request("tokens", "a list of token ids (integers from 0) is required")
    try:
        pool = gateway.router.candidates(model)[0]
    except UnknownModelError as exc:
        raise model_not_found(exc) from None
    size = pool.vocab_size or pool.tokenizer.vocab_size
    if (past := next((j for j, t in enumerate(tokens) if t >= size), None)) is not None:
        raise bad_request(f"tokens[{past}]", f"token id {tokens[past]} is not in the vocabulary (0..{size - 1})")
    return web.json_response({"prompt": pool.tokenizer.decode(tokens, skip_special_tokens=False)})


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model", "the model's name (a string) is required")
    return model


def _flag(body: dict[str, Any], key: str) -> bool:
    if not isinstance(body[key], bool):
        raise bad_request(key, f"must be a boolean, got {type(body[key]).__name__}")
    return body[key]

