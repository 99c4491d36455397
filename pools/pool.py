"""`Pool`: one pool as the gateway serves it — its spec, route limits, tokenizer and where requests go.

Built once at start-up (`gateway.runtime.Gateway.from_config`); each replica's device worker client
is set when the gateway starts (and restarts) its workers. Everything here is read-only while
serving, except the `token_text` cache, which only ever grows (safe from the event loop and the
tokenizer thread alike), the `clients` the supervisors point at their live workers and the
`admission` ledger (event loop only).
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer
from pools.config.spec import PoolSpec
from pools.tokencount import TokenCounter

if TYPE_CHECKING:
    from engine.client import AsyncEngineClient
    from pools.credits.queue import CreditQueue

log = logging.getLogger("cliffguard.pools")

# The sampling fields a model's generation_config.json sets defaults for, with transformers' own defaults: a value
# that differs from its own is the model's advice (vLLM's `--generation-config auto` reads the same ones).
_HF_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}
ADVISED_FIELDS = tuple(_HF_SAMPLING)   # the request fields a model's advice fills where a request leaves them unset


def generation_defaults(folder: Path | str) -> dict[str, Any]:
    """The sampling defaults a model folder's generation_config.json advises (`_HF_SAMPLING`'s fields that it
    sets to other than transformers' defaults); a value `SamplingParams` refuses is left out, logged."""
    try:
        config = json.loads((Path(folder) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    defaults: dict[str, Any] = {}
    for key, own in _HF_SAMPLING.items():
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value == own:
            continue
        value = int(value) if key == "top_k" and float(value).is_integer() else value   # 20.0: a count all the same
        try:
            SamplingParams(**{key: value})
            defaults[key] = value
        except ValueError as exc:
            log.warning("%s/generation_config.json: %s: not taken as a default", folder, exc)
    return defaults


@dataclass
class Pool:
    """A pool as served: route + context limits, exact token counting, and its device worker or upstream.

    `max_model_len` is the pool's context (prompt + output tokens): the capacity plan's for a local
    pool, the YAML's or the tokenizer model's for an upstream one.
    """

    spec: PoolSpec
    tokenizer: Tokenizer            # chat template, token texts for logprobs
    counter: TokenCounter           # exact ids and counts (tiktoken where identical)
    prefix_ids: list[int]           # what the tokenizer adds before a completion prompt's text (e.g. BOS)
    max_model_len: int
    suffix_ids: list[int] = field(default_factory=list)   # and after it (an EOS, for some post-processors)
    num_replicas: int = 1                     # local pools: the replicas of its device (each serves it)
    vocab_size: int | None = None             # the ids a token-id prompt may hold (None: the tokenizer's)
    clients: list[AsyncEngineClient | None] = field(default_factory=list)   # each replica's worker, once spawned
    admission: CreditQueue | None = None        # local pools: KV credits and the queue (set by the gateway)
    _token_texts: dict[int, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.clients:
            self.clients = [None] * self.num_replicas

    @property
    def client(self) -> AsyncEngineClient | None:
        """The first replica's worker client (the only one for a device that is not replicated)."""
        return self.clients[0] if self.clients else None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def model_name(self) -> str:
        """The `model` clients send."""
        return self.spec.model_name

    @property
    def is_upstream(self) -> bool:
        return self.spec.is_upstream

    @property
    def device(self) -> str | None:
        """The device worker's name; None for an upstream pool."""
        return None if self.spec.is_upstream else self.spec.device

    @property
    def min_prompt_tokens(self) -> int:
        return self.spec.route.min_prompt_tokens

    @property
    def max_prompt_tokens(self) -> int:
        """The largest admitted prompt: the route's bound, capped at max_model_len - 1 (room for one
        generated token)."""
        return self.spec.route.upper(self.max_model_len)

    @functools.cached_property
    def sampling_defaults(self) -> dict[str, Any]:
        """What a request that leaves temperature, top_p, top_k, min_p or repetition_penalty unset samples with:
        the model's advice (`generation_defaults`, as vLLM applies it by default); none on an upstream pool (its
        server applies its own) or with `generation_config: none` (OpenAI's defaults)."""
        folder = getattr(self.tokenizer, "folder", None)
        if self.is_upstream or self.spec.generation_config == "none" or folder is None:
            return {}
        defaults = generation_defaults(folder)
        if defaults:
            log.info("pool %r: sampling defaults from the model's generation_config.json: %s (generation_config: "
                     "none serves OpenAI's)", self.name, ", ".join(f"{k} {v}" for k, v in defaults.items()))
        return defaults

    def cache_salt(self, tenant: str) -> str | None:
        """The prefix-cache partition of `tenant`'s requests: the tenant, unless the pool shares its cache
        across tenants (`share_prefix_cache`). A shared cache lets a tenant learn from hit counts or time
        to first token whether another tenant sent a prompt."""
        return None if self.spec.share_prefix_cache else tenant

    def admits(self, num_prompt_tokens: int) -> bool:
        """Whether a prompt of this many tokens goes to this pool."""
        return self.spec.route.admits(num_prompt_tokens, self.max_model_len)

    def prompt_ids(self, text: str) -> list[int]:
        """A completion prompt's ids: the text's own (`counter`) between what the tokenizer adds around it, as
        transformers' `tokenizer(text).input_ids` (`Tokenizer.special_ids_around`). An empty prompt is the
        start of a document, as OpenAI reads one: the tokenizer's BOS, else its EOS (the document separator)
        where it adds nothing around text (the engine needs a token to condition on)."""
        ids = [*self.prefix_ids, *self.counter.encode(text), *self.suffix_ids]
        if not ids:
            start = self.tokenizer.bos_token_id
            if start is None and self.tokenizer.eos_token_ids:
                start = min(self.tokenizer.eos_token_ids)
            if start is None:
                raise ValueError("prompt: must not be empty: this model's tokenizer has no BOS or EOS token to "
                                 "start a document with")
            ids = [start]
        return ids

    def token_text(self, token_id: int) -> str:
        """The text of one token, as logprobs report it (special tokens included): its bytes' text (a
        sentencepiece piece with its space, " cat", which decoding it alone strips), or, where they are part of
        a character, what decoding it gives (U+FFFD)."""
        text = self._token_texts.get(token_id)
        if text is None:
            try:
                text = self.tokenizer.token_bytes(token_id).decode("utf-8")
            except UnicodeDecodeError:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token, as logprobs report them (`Tokenizer.token_bytes`: its own, where
        `token_text` shows U+FFFD for part of a character)."""
        return self.tokenizer.token_bytes(token_id)
