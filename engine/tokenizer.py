"""The model's tokenizer and chat template, read from an HF-style folder without importing transformers.

`Tokenizer.from_folder` reads tokenizer.json (or a tiktoken vocabulary, Kimi K2's: `engine.tiktoken_vocab`) with the
`tokenizers` library and tokenizer_config.json (plus the optional generation_config.json, config.json and
chat_template.jinja) itself, and reproduces the parts of transformers' (v5) `TokenizersBackend` that change ids or
text, so that encode, decode and the chat template give what `AutoTokenizer.from_pretrained(folder)` gives:

- special tokens named in tokenizer_config.json but missing from tokenizer.json's added tokens are added as special;
  without an `added_tokens_decoder` there, special_tokens_map.json's (older folders) are taken over the config's;
- `add_bos_token` / `add_eos_token` in tokenizer_config.json are ignored: transformers 5 drops them when there is a
  tokenizer.json, whose post-processor alone decides what `add_special_tokens=True` adds;
- `split_special_tokens` makes special-token strings in text encode as plain text;
- decode applies `clean_up_tokenization_spaces` only to non-BPE models, as transformers does;
- chat templates render as transformers renders them (`engine.chat_template`), with the special tokens as variables.

Model-specific tokenizer classes that transformers rebuilds from vocab and merges (a `LlamaTokenizer` with `legacy`
flags, say) are read from tokenizer.json as it is."""

from __future__ import annotations

import codecs
import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

from engine.chat_template import TEMPLATE_FUNCTIONS, check_messages, compile_chat_template, render
from engine.text import OutputText
from engine.tiktoken_vocab import SORTS_TOOLS, sorted_keys, tiktoken_backend

__all__ = ["TEMPLATE_FUNCTIONS", "IncrementalDetokenizer", "Tokenizer"]

# transformers' SPECIAL_TOKENS_ATTRIBUTES; other `*_token` keys in the config are model-specific special tokens
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
_REPLACEMENT_CHAR = "\ufffd"
_MIN_CONTEXT, _MAX_CONTEXT = 4, 24   # prompt tokens an output's first window begins with (IncrementalDetokenizer)


class Tokenizer:
    """Wraps tokenizers.Tokenizer plus the folder's special tokens and chat template. Build it with `from_folder`.
    Read-only after construction, so one instance may serve many requests."""

    def __init__(self, backend: _Backend, folder: Path, config: dict[str, Any], model_eos_token_ids: Sequence[int],
                 chat_templates: dict[str, str]) -> None:
        self._backend = backend
        self.folder = folder
        self._chat_templates = chat_templates
        self._sorts_tools = config.get("tokenizer_class") in SORTS_TOOLS
        self._special_tokens_map = _special_tokens_map(config)  # chat template variables: bos_token, eos_token, ...
        self._clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE"
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)))
        bos = self._special_tokens_map.get("bos_token")
        self.bos_token_id: int | None = backend.token_to_id(bos) if bos is not None else None
        eos_id = backend.token_to_id(eos) if (eos := self._special_tokens_map.get("eos_token")) else None
        self.eos_token_ids: frozenset[int] = frozenset(model_eos_token_ids) | ({eos_id} - {None})
        special = [*self._special_tokens_map.values(), *_extra_special_tokens(config)]
        self.all_special_ids: frozenset[int] = frozenset(
            i for i in (backend.token_to_id(t) for t in special) if i is not None)
        # ids that decode(skip_special_tokens=True) drops
        self._skipped_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        # the special tokens encode matches (none with split_special_tokens: those read as text): content ->
        # (id, lstrip, rstrip, single_word)
        self.control_specs: dict[str, tuple[int, bool, bool, bool]] = {} if backend.encode_special_tokens else {
            t.content: (i, t.lstrip, t.rstrip, t.single_word)
            for i, t in backend.get_added_tokens_decoder().items() if t.special and t.content}
        self.control_tokens: frozenset[str] = frozenset(self.control_specs)
        # <0xXX> tokens of a ByteFallback decoder, which decodes each run of them as one unit
        decoder_state = backend.decoder.__getstate__() if backend.decoder else b""
        byte_fallback = b'"ByteFallback"' in decoder_state
        self._metaspace = "\u2581".encode() in decoder_state or b"\\u2581" in decoder_state   # its "\u2581" is " "
        self._byte_level = b'"type":"ByteLevel"' in decoder_state.replace(b" ", b"")
        self._byte_token_ids = frozenset(
            i for i in (backend.token_to_id(f"<0x{b:02X}>") for b in range(256)) if i is not None
        ) if byte_fallback else frozenset()

    @functools.cached_property
    def byte_tables(self) -> tuple[tuple[bytes, ...], tuple[bytes, ...]] | None:
        """Each id's bytes where decode is only "join the tokens' bytes, then UTF-8 with U+FFFD for what is
        invalid" (a `ByteLevel` decoder, no clean-up): (bytes keeping special tokens, bytes skipping them).
        None for any other decoder (sentencepiece's, byte fallback), which `IncrementalDetokenizer` then
        decodes through the library. Built once (~60 ms for a 49k vocabulary)."""
        decoder = self._backend.decoder
        if self._clean_up_tokenization_spaces or decoder is None or \
                json.loads(decoder.__getstate__()).get("type") != "ByteLevel":
            return None
        keep = [b""] * self.vocab_size   # ids the vocabulary lacks decode to nothing
        for token, i in self._backend.get_vocab(with_added_tokens=True).items():
            keep[i] = _byte_level_bytes(token)
        for i in self._backend.get_added_tokens_decoder():   # added tokens: the library's word, or no table
            try:
                if keep[i].decode() != self._backend.decode([i], skip_special_tokens=False):
                    return None
            except UnicodeDecodeError:
                return None
        skip = list(keep)
        for i in self._skipped_ids:
            skip[i] = b""
        return tuple(keep), tuple(skip)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike, chat_template: str | None = None) -> Tokenizer:
        """Load tokenizer.json and the folder's configs (`chat_template`: a template's text in place of the folder's);
        a missing tokenizer.json is a FileNotFoundError, an unreadable one a ValueError."""
        folder, path = Path(folder), Path(folder) / "tokenizer.json"
        config = _with_special_tokens_map(_read_json(folder / "tokenizer_config.json"),
                                          _read_json(folder / "special_tokens_map.json"))
        backend = None if path.is_file() else tiktoken_backend(folder, config)   # Kimi's: engine.tiktoken_vocab
        if backend is None and not path.is_file():
            raise FileNotFoundError(f"tokenizer.json: not found in model folder {folder}")
        try:
            backend = backend or _Backend.from_file(str(path))
        except Exception as exc:   # noqa: BLE001 - the tokenizers library raises a bare Exception on a bad file
            raise ValueError(f"tokenizer.json: {path} is not a tokenizer the tokenizers library reads ({exc}); "
                             "a Git LFS pointer or a damaged download?") from None
        backend.no_truncation()
        backend.no_padding()
        _add_config_tokens(backend, config)
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        model_eos_ids = []  # eos_token_id: an int or a list, in either file
        for name in ("generation_config.json", "config.json"):
            value = _read_json(folder / name).get("eos_token_id")
            model_eos_ids += [i for i in (value if isinstance(value, list) else [value]) if isinstance(i, int)]
        templates = _read_chat_templates(folder, config) if chat_template is None else {"default": chat_template}
        return cls(backend, folder, config, model_eos_ids, templates)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (len() of the HF tokenizer)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text, added tokens included (grammar libraries build their view of
        the vocabulary from it)."""
        return self._backend.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` as stored (byte-level symbols, not decoded text); None if unused."""
        return self._backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, as HF `tokenizer(text, add_special_tokens=...).input_ids`."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_as_text(self, text: str, later: bool = False) -> list[int]:
        """`encode(text, add_special_tokens=False)` with `control_tokens` in `text` read as plain text (as
        `split_special_tokens` reads them); the other added tokens are matched as ever. `later`: `text` is
        the part of a longer one after an added token, where a Metaspace pre-tokenizer that prepends its
        "\u2581" to the first piece only (`prepend_scheme: first`) prepends none."""
        if not self.control_tokens:
            return self.encode(text, add_special_tokens=False)
        return self._text_backends[later].encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _text_backends(self) -> tuple[_Backend, _Backend]:
        """Copies of the backend that encode special tokens as text (a flag of the Rust object: setting it on
        the shared one would race with other threads' encodes): for a text's start, and for a later part."""
        def as_text(spec: dict[str, Any]) -> _Backend:
            backend = _Backend.from_str(json.dumps(spec))
            backend.encode_special_tokens = True
            return backend

        spec = json.loads(self._backend.to_str())
        first = as_text(spec)
        return (first, as_text(spec)) if _prepend_first_only(spec.get("pre_tokenizer")) else (first, first)

    @functools.cached_property
    def special_ids_around(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The ids `encode(text, add_special_tokens=True)` puts before and after the text's own: its
        post-processor's (`<bos> $A <eos>` gives ((bos,), (eos,))), read off a probe's encoding, where they
        are the tokens of no input sequence."""
        encoding = self._backend.encode("a", add_special_tokens=True)
        own = [i for i, sequence in enumerate(encoding.sequence_ids) if sequence is not None]
        if not own:   # the probe encodes to nothing of its own: all is added, as to an empty text
            return tuple(encoding.ids), ()
        return tuple(encoding.ids[:own[0]]), tuple(encoding.ids[own[-1] + 1:])

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` for each text (in parallel inside `tokenizers`)."""
        return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes, as OpenAI's logprobs report them (a character split over several tokens
        is whole only in their joined bytes; decoding one of them alone gives U+FFFD): the byte-level
        table's (`byte_tables`, special tokens as written; a byte-level piece's where clean-up leaves no
        table), a byte-fallback `<0xXX>` token's byte, a sentencepiece piece with its spaces, else the UTF-8
        of its decoded text."""
        tables = self.byte_tables
        if tables is not None and 0 <= token_id < len(tables[0]):
            return tables[0][token_id]
        piece = self._backend.id_to_token(token_id)
        if token_id in self._byte_token_ids:
            return bytes([int(piece[3:5], 16)])
        if self._byte_level and piece is not None:   # one with clean-up has no table: the piece's own bytes
            return _byte_level_bytes(piece)
        if self._metaspace and piece is not None:   # decoded alone, "\u2581the" loses its space to the Strip
            return piece.replace("\u2581", " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`, as HF `tokenizer.decode(ids, skip_special_tokens=...)`."""
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_tokenization_spaces else text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs: Any) -> str:
        """The prompt string for `messages`, as HF `apply_chat_template(messages, tokenize=False, ...)`
        (`engine.chat_template.render`).

        `kwargs` become template variables (over the special tokens of the same name); `tools` also picks the
        folder's "tool_use" template when there is one. `continue_final_message` ends the prompt inside the last
        message's content, for the model to continue it (not with `add_generation_prompt`). Bad messages, a
        folder without a template and errors the template raises are ValueErrors.
        """
        check_messages(messages)
        source = self._chat_template(use_tools=kwargs.get("tools") is not None)
        variables = {"tools": None, "documents": None, **self._special_tokens_map, **kwargs}
        if self._sorts_tools and variables["tools"]:   # Moonshot's class renders them with every key sorted
            variables["tools"] = sorted_keys(variables["tools"])
        return render(source, messages, add_generation_prompt, continue_final_message, variables)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat template; the template writes its own special tokens (HF semantics)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    def chat_template_source(self, use_tools: bool = False) -> str:
        """The text of the template `apply_chat_template` renders ("" when the folder has none): "tool_use" when
        tools are given and it exists, else "default" (HF's choice)."""
        return self._chat_templates.get("tool_use" if use_tools and "tool_use" in self._chat_templates else "default",
                                        "")

    def _chat_template(self, use_tools: bool) -> str:
        """`chat_template_source`, checked to compile."""
        if not self._chat_templates:
            raise ValueError(f"chat template: model folder {self.folder} has none; send a completion prompt instead")
        if not (source := self.chat_template_source(use_tools)):
            raise ValueError(f"chat template: model folder {self.folder} has several ({sorted(self._chat_templates)})"
                             " and no 'default' one")
        try:
            compile_chat_template(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template: {self.folder}: line {exc.lineno}: {exc.message}") from exc
        return source


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas, correct for multi-byte characters split across
    tokens: never emits a partial character (U+FFFD) and the concatenation of all deltas equals
    tokenizer.decode(all_output_ids, skip_special_tokens) at the end.

    Each step decodes a window: the tokens emitted last time (context) plus those not yet emitted. The new text is
    what the window decodes to beyond its context, and it is emitted only once it is final: the window's text does
    not end in U+FFFD (a UTF-8 sequence that later bytes may complete) and, for byte-fallback tokenizers, its last
    token is not an <0xXX> byte token (their decoder turns a whole run of byte tokens into U+FFFDs if any byte of the
    run is invalid, so a run's text is final only once the run ends: while one is open nothing is decoded, and
    the run is decoded once when it ends). Special tokens that decode skips are left out of the window, as the
    library leaves them out before its decoder (so a byte run stays one run across them, and a run of them costs
    nothing). A step costs O(window), not O(output); the window is a few tokens, a byte run's, or longer only while
    invalid bytes keep its text unfinished.

    The output is read in its prompt's context, as vLLM reads it: the first window begins with the prompt's last
    tokens (`_prompt_context`: 4 or more that decode to whole characters), so a sentencepiece tokenizer's leading
    space before the first output word is kept (its decoder strips the space a text begins with: decoded alone,
    "The cat" + "▁sat" gave "sat", and a completion did not follow on from its prompt), in a chat reply as in a
    completion. Where none do (a U+FFFD in the prompt's text), its last 24 are the context; where it has none (all
    special) the output is decoded alone. One instance per sequence; not thread-safe.

    A byte-level tokenizer (`Tokenizer.byte_tables`: GPT-2's, Llama 3's, Qwen's, SmolLM's) needs no window and no
    library call: its decode is the UTF-8 of the tokens' bytes joined, so each step feeds the new tokens' bytes
    to an incremental UTF-8 decoder, which holds an unfinished character back and replaces what can never be
    valid as the whole decode does (~1 us a token instead of two decodes).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._skipped = tokenizer._skipped_ids if skip_special_tokens else frozenset()
        self._byte_ids = tokenizer._byte_token_ids
        self._ids: list[int] = []
        self._text_ids: list[int] = []   # the ids decode reads: `_ids` less the special tokens it skips
        self._prefix_offset = 0  # window start, in _text_ids
        self._read_offset = 0  # end of the emitted tokens, in _text_ids
        self._text = OutputText()   # appended without copying what came before
        tables = tokenizer.byte_tables
        self._bytes = None if tables is None else tables[skip_special_tokens]
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        if self._bytes is None:   # byte-level text has no leading space to lose: no context needed
            self._text_ids = self._prompt_context(prompt_token_ids)
            self._read_offset = len(self._text_ids)   # the context: read, not emitted

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The shortest suffix of the prompt, 4 tokens or more (at most 24; special tokens decode skips left out),
        that decodes to whole characters (vLLM's choice), else all 24 (a U+FFFD in its text). It ends before a
        byte-fallback run the prompt ends with: the library would decode that run and one the output begins with
        as one (a bad byte in the output made the prompt's character U+FFFDs of the output's)."""
        ids = [i for i in prompt_token_ids[-_MAX_CONTEXT:] if i not in self._skipped]
        while ids and ids[-1] in self._byte_ids:
            ids.pop()
        for n in range(min(_MIN_CONTEXT, len(ids)), len(ids) + 1):
            if n and _REPLACEMENT_CHAR not in self._tokenizer.decode(ids[-n:], self._skip_special_tokens):
                return ids[-n:]
        return ids

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return str(self._text)

    @property
    def output_token_ids(self) -> list[int]:
        """All output token ids stepped so far."""
        return list(self._ids)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append generated tokens; returns the text that became final (maybe "")."""
        self._ids.extend(new_token_ids)
        if self._bytes is None:
            self._text_ids.extend(i for i in new_token_ids if i not in self._skipped)
            return self._emit(final=False)
        table, size = self._bytes, len(self._bytes)
        delta = self._utf8.decode(b"".join([table[i] if 0 <= i < size else b"" for i in new_token_ids]))
        self._text += delta
        return delta

    def flush(self) -> str:
        """At finish: the text held back, decoded as HF would show it (an unfinished character as U+FFFD)."""
        if self._bytes is None:
            return self._emit(final=True)
        delta = self._utf8.decode(b"", final=True)
        self._text += delta
        return delta

    def held_text(self, max_chars: int) -> str:
        """The text held back while a byte-fallback run is open (its whole characters; not emitted yet: the run's
        end may turn them into U+FFFDs, as HF decodes a bad run), for the stop strings to see at once; "" if
        no run is open. A long run gives its last characters only, at least `max_chars` + 1 of them (decoded
        from its last 4 x max_chars + 8 tokens, a character being 4 bytes at most, from a character's first
        byte: the library makes every byte of a run U+FFFD if one is bad): its cost stays bounded."""
        ids = self._text_ids
        if self._bytes is not None or self._read_offset == len(ids) or ids[-1] not in self._byte_ids:
            return ""
        decode, skip, window = self._tokenizer.decode, self._skip_special_tokens, 4 * max_chars + 8
        if len(ids) - self._read_offset > window:
            start, byte_of = len(ids) - window, self._tokenizer.token_bytes
            while start < len(ids) - 1 and ids[start] in self._byte_ids and 0x80 <= byte_of(ids[start])[0] < 0xC0:
                start += 1   # a character's continuation byte
            return decode(ids[start:], skip).rstrip(_REPLACEMENT_CHAR)
        held = decode(ids[self._prefix_offset:], skip)[len(decode(ids[self._prefix_offset:self._read_offset], skip)):]
        return held.rstrip(_REPLACEMENT_CHAR)   # an unfinished character is no text yet

    def _emit(self, final: bool) -> str:
        ids = self._text_ids
        if self._read_offset == len(ids) or (not final and ids[-1] in self._byte_ids):   # a byte run is open
            return ""
        decode, skip = self._tokenizer.decode, self._skip_special_tokens
        context_text = decode(ids[self._prefix_offset:self._read_offset], skip)
        window_text = decode(ids[self._prefix_offset:], skip)
        # "longer than the context": a window must start with text, else a sentencepiece decoder strips its space
        if not final and (len(window_text) <= len(context_text) or window_text.endswith(_REPLACEMENT_CHAR)):
            return ""
        delta = window_text[len(context_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        self._text += delta
        return delta


# --- loading ----------------------------------------------------------------------------------------------------


def _prepend_first_only(pre_tokenizer: dict[str, Any] | None) -> bool:
    """Whether `pre_tokenizer` (tokenizer.json's) holds a Metaspace that prepends to a text's first piece
    only; if so, it is made to prepend to none (in place: the spec of a later part's backend)."""
    if not isinstance(pre_tokenizer, dict):
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any([_prepend_first_only(p) for p in pre_tokenizer.get("pretokenizers", [])])
    if pre_tokenizer.get("type") == "Metaspace" and pre_tokenizer.get("prepend_scheme") == "first":
        pre_tokenizer["prepend_scheme"] = "never"
        return True
    return False


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token's string: the config holds a str or an AddedToken written as a dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_tokens_map(config: dict[str, Any]) -> dict[str, str]:
    """HF's special_tokens_map: the named special tokens, then model-specific ones (`image_token`, ...)."""
    named = {key: _token_content(config.get(key)) for key in _NAMED_SPECIAL_TOKENS}
    specific = {key: _token_content(value) for key, value in config.items()
                if key.endswith("_token") and key not in _NAMED_SPECIAL_TOKENS}
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        specific.update({key: _token_content(value) for key, value in extra.items()})
    return {key: value for key, value in {**named, **specific}.items() if value is not None}


def _with_special_tokens_map(config: dict[str, Any], tokens_map: dict[str, Any]) -> dict[str, Any]:
    """transformers' legacy read: without an `added_tokens_decoder` in tokenizer_config.json, the entries of
    special_tokens_map.json (bos, eos, unk, pad, additional tokens) are taken over the config's."""
    if not tokens_map or "added_tokens_decoder" in config:
        return config
    return {**config, **tokens_map}


def _extra_special_tokens(config: dict[str, Any]) -> list[str]:
    """The unnamed special tokens: `extra_special_tokens` (v5) or `additional_special_tokens` as a list."""
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    return [t for t in map(_token_content, extra) if t is not None] if isinstance(extra, list) else []


def _add_config_tokens(backend: _Backend, config: dict[str, Any]) -> None:
    """Add the tokens tokenizer_config.json declares and tokenizer.json lacks, the way transformers does."""
    decoder = config.get("added_tokens_decoder") or {}
    current = {repr(t) for t in backend.get_added_tokens_decoder().values()}
    for _, fields in sorted(decoder.items(), key=lambda item: int(item[0])):
        if isinstance(fields, dict) and isinstance(fields.get("content"), str):
            token = AddedToken(**{key: fields[key] for key in _ADDED_TOKEN_FIELDS if key in fields})
            if repr(token) not in current:  # new, or other flags: replaces tokenizer.json's entry
                backend.add_tokens([token])
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    for content in [*_special_tokens_map(config).values(), *_extra_special_tokens(config)]:
        if content not in present:
            backend.add_special_tokens([AddedToken(content, special=True, normalized=False)])
            present.add(content)


def _read_chat_templates(folder: Path, config: dict[str, Any]) -> dict[str, str]:
    """Templates by name. chat_template.jinja (and additional_chat_templates/*.jinja) win over the config's
    "chat_template", which is a string or a list of {name, template}."""
    templates = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        templates.update({p.stem: p.read_text(encoding="utf-8") for p in sorted(extra_dir.glob("*.jinja"))})
    if templates:
        return templates
    value = config.get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(isinstance(t, dict) and {"name", "template"} <= t.keys() for t in value):
        return {t["name"]: t["template"] for t in value}
    if value is not None:
        raise ValueError(f"{folder / 'tokenizer_config.json'}: chat_template: expected a string or a list of "
                         f"{{name, template}}, got {type(value).__name__}")
    return {}


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization (spaces before punctuation and contractions)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def _byte_level_bytes(piece: str) -> bytes:
    """A byte-level piece's bytes; a piece with a symbol outside the byte map is its own UTF-8, as the
    decoder takes it."""
    char_bytes = _byte_level_chars()
    try:
        return bytes(char_bytes[c] for c in piece)
    except KeyError:
        return piece.encode()


@functools.cache
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet undone: the printable symbol standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    shifted = [b for b in range(256) if b not in printable]   # the others stand as 256, 257, ...
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(shifted)}}
