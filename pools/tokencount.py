"""Exact prompt token counts for routing: the model's byte-level BPE rebuilt as a tiktoken `Encoding`.

`TokenCounter` gives the ids of `engine.tokenizer.Tokenizer.encode(text, add_special_tokens=False)`, the HF
`tokenizers` ids, from one of two backends:

- "tiktoken": a `tiktoken.Encoding` built from the tokenizer when this module can show that tiktoken reproduces
  it exactly (byte-level BPE, a pre-tokenizer that is one regex, plainly matched added tokens);
- "hf": `tokenizers` itself, for every other tokenizer; `fallback_reason` says why.

Why tiktoken's merges are HF's. Inside each pre-tokenized piece HF merges the leftmost adjacent pair whose merge
rule comes first; tiktoken merges the leftmost adjacent pair whose concatenation has the lowest rank, and takes a
piece that is itself a token whole. Run HF's merges on the bytes of one vocabulary token t alone: t is *reachable*
when the run ends at [t], and the run's last merge is t's *final rule*. In a longer piece, the merges inside a span
that holds two adjacent tokens x, y are exactly that span's own run (no merge crossed its boundaries), so HF holds
x, y with x+y = t only on the way through t's own run: it then merges them by t's final rule if t is reachable, and
never otherwise. Hence tiktoken ranks = final rules of the reachable tokens (unreachable tokens left out) make
tiktoken take HF's merge at every step, and its whole-piece shortcut only ever returns a reachable token, which HF's
merges reach too. With `ignore_merges` HF takes the same shortcut; an unreachable token then stays in with a rank
past all merges when its own run ends in three or more tokens, since no two adjacent tokens ever form it.

The rest must match too, and is refused (backend "hf") where it may not: the normalizer (none, or NFC with text that
is already NFC), the pre-tokenizer (ByteLevel's GPT-2 regex, one `Split` regex, `Digits` before ByteLevel), the added
tokens (matched as tiktoken special tokens: no lstrip/rstrip/single_word, no two that overlap). Text holding a byte
the vocabulary lacks, text that is not NFC for an NFC tokenizer and lone surrogates are answered by `tokenizers`,
call by call. Last, the ids of a built-in corpus are compared with HF's at construction.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import tiktoken
import tokenizers

from engine.tokenizer import Tokenizer

log = logging.getLogger("cliffguard.pools.tokencount")

# GPT-2's pattern (ByteLevel use_regex), its plain alternatives grouped: see _group_plain_alternatives
_GPT2_PATTERN = r"""(?:'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+)|\s+(?!\S)|\s+"""
# Digits then ByteLevel's GPT-2 regex on the text between the numbers: numbers never take a space, and a whitespace
# run before a number is not cut short (the regex saw it at the end of its piece)
_DIGITS_GPT2_PATTERN = r"""(?:'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}DIGITS| ?[^\s\p{L}\p{N}]+)|\s+(?![^\s\p{N}])|\s+"""
_WHITESPACE_TAIL = r"|\s+(?!\S)|\s+"


class TokenCounter:
    """Token ids and counts of prompt text, identical to `Tokenizer.encode(text, add_special_tokens=False)`.

    `backend` is "tiktoken" or "hf" (then `fallback_reason` says why). Read-only after construction: one instance
    may serve many threads (tiktoken and tokenizers both release the GIL and keep no per-call state here).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._fast: _FastPath | None = None
        self.fallback_reason: str | None = None
        try:
            fast = _fast_path(_hf_backend(tokenizer))
            _verify(fast, tokenizer)
            self._fast = fast
        except _Inexact as exc:
            self.fallback_reason = str(exc)
            log.info("token counts from tokenizers, not tiktoken: %s", exc)
        self.backend: str = "hf" if self._fast is None else "tiktoken"
        controls = sorted(tokenizer.control_tokens, key=len, reverse=True)   # longest first: leftmost-longest
        self.controls: tuple[str, ...] = tuple(controls)
        self._control_ids = {c: spec[0] for c, spec in tokenizer.control_specs.items()}
        # the control tokens' strings (what a client's text is shielded of), and how the tokenizer matches them
        self.control_pattern: re.Pattern[str] | None = re.compile("|".join(map(re.escape, controls))) \
            if controls else None
        self._template_pattern = re.compile("|".join(
            _control_regex(c, *tokenizer.control_specs[c][1:]) for c in controls)) if controls else None
        self._as_text: frozenset[str] = frozenset() if self._fast is None else self._fast.allowed_special - {
            unicodedata.normalize("NFC", c) if self._fast.nfc else c for c in controls} - set(controls)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> TokenCounter:
        """The counter for a model folder's tokenizer (tokenizer.json + tokenizer_config.json)."""
        return cls(Tokenizer.from_folder(folder))

    def encode(self, text: str) -> list[int]:
        """The token ids of `text`; special tokens in it are matched as the HF tokenizer matches them."""
        ranks = self._fast.ranks(text) if self._fast is not None else None
        if ranks is None:
            return self._tokenizer.encode(text, add_special_tokens=False)
        return self._fast.ids(ranks)

    def encode_as_text(self, text: str, later: bool = False) -> list[int]:
        """`encode` with the control tokens (`controls`: the special added tokens) in `text` as plain text,
        as `Tokenizer.encode_as_text` (`later`: a part after an added token)."""
        ranks = self._fast.ranks(text, self._as_text) if self._fast is not None else None
        if ranks is None:
            return self._tokenizer.encode_as_text(text, later)
        return self._fast.ids(ranks)

    def encode_shielded(self, text: str, shielded: dict[str, str]) -> list[int]:
        """The ids of a chat prompt rendered from strings whose control tokens were swapped for the
        placeholder characters `shielded` maps back (`gateway.openai.chat_prompt.shield_controls`): the
        control tokens `text` holds are the template's own, each its token; a client's are their plain
        text. Without placeholders, `encode(text)`. The text between the template's control tokens is
        encoded alone, as the tokenizer itself splits on added tokens before its pre-tokenizer (a part after
        one with no Metaspace first-piece "\u2581", the spaces a token's lstrip / rstrip takes its own)."""
        if not shielded or self._template_pattern is None:
            return self.encode(text)
        table = str.maketrans(shielded)
        ids: list[int] = []
        start = 0
        for match in self._template_pattern.finditer(text):   # a token with lstrip / rstrip takes the spaces beside it
            ids += self.encode_as_text(text[start:match.start()].translate(table), later=start > 0)
            ids.append(self._control_ids.get(match.group()) or self._control_ids[match.group().strip()])
            start = match.end()
        return ids + self.encode_as_text(text[start:].translate(table), later=start > 0)

    def count(self, text: str) -> int:
        """len(encode(text)), without mapping ranks to ids."""
        ranks = self._fast.ranks(text) if self._fast is not None else None
        return len(ranks if ranks is not None else self._tokenizer.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        """`encode` of each text, in order."""
        if self._fast is None:
            return self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [self.encode(text) for text in texts]


def _control_regex(content: str, lstrip: bool, rstrip: bool, single_word: bool) -> str:
    """How the tokenizer matches an added token: with the spaces before it (`lstrip`) and after it
    (`rstrip`), only as a whole word (`single_word`)."""
    core = re.escape(content)
    if single_word:
        core = rf"(?<!\w){core}(?!\w)"
    return (r"\s*" if lstrip else "") + core + (r"\s*" if rstrip else "")


class _Inexact(Exception):
    """tiktoken cannot be shown to give this tokenizer's ids; the message says what stands in the way."""


@dataclass(frozen=True)
class _FastPath:
    """A tiktoken CoreBPE plus what maps its output onto HF ids."""

    core: Any                              # tiktoken's CoreBPE (Encoding._core_bpe: its wrapper rewrites lone
                                           # surrogates, which tokenizers rejects)
    allowed_special: frozenset[str]        # every added token tiktoken matches
    rank_to_id: list[int] | None           # None: the ranks are the HF ids
    min_missing_rank: int | None           # ranks >= this are bytes the vocabulary lacks; None: none can occur
    nfc: bool                              # the tokenizer NFC-normalizes: tiktoken answers only for NFC text

    def ranks(self, text: str, allowed_special: frozenset[str] | None = None) -> list[int] | None:
        """tiktoken's ranks for `text` (matching `allowed_special`, by default every added token), or None
        where tokenizers must answer."""
        if self.nfc and not unicodedata.is_normalized("NFC", text):
            return None
        try:
            ranks = self.core.encode(text, self.allowed_special if allowed_special is None else allowed_special)
        except UnicodeEncodeError:  # lone surrogates
            return None
        if self.min_missing_rank is not None and ranks and max(ranks) >= self.min_missing_rank:
            return None  # tokenizers drops such bytes (or gives unk) and merges across them
        return ranks

    def ids(self, ranks: list[int]) -> list[int]:
        table = self.rank_to_id
        return ranks if table is None else [table[r] for r in ranks]


def _hf_backend(tokenizer: Tokenizer) -> tokenizers.Tokenizer:
    """The tokenizers.Tokenizer behind `tokenizer`, added tokens from tokenizer_config.json included."""
    return tokenizer._backend


# --- building the tiktoken encoding -------------------------------------------------------------------------------


def _fast_path(backend: tokenizers.Tokenizer) -> _FastPath:
    """`_build_fast_path` of `backend`, built once per process for each distinct tokenizer (`_cached_fast_path`)."""
    found = _cached_fast_path(backend.to_str(), backend.encode_special_tokens)
    if isinstance(found, str):
        raise _Inexact(found)
    return found


@functools.lru_cache(maxsize=8)
def _cached_fast_path(text: str, encode_special_tokens: bool) -> _FastPath | str:
    """The fast path of the tokenizer whose JSON is `text`, or why there is none. Building one runs HF's merges on
    every vocabulary token (about 1 s for a 49k vocabulary on a 2-core CPU): a process that builds several gateways
    or pools on one tokenizer builds it once. The last 8 are kept (a gateway has one per model; a 150k
    vocabulary's takes tens of MB). A _FastPath is read-only."""
    try:
        return _build_fast_path(text, encode_special_tokens)
    except _Inexact as exc:
        return str(exc)


def _build_fast_path(text: str, encode_special_tokens: bool) -> _FastPath:
    """The tiktoken encoding of the tokenizer whose JSON is `text`; _Inexact where it cannot be shown exact."""
    spec = json.loads(text)
    model = spec["model"]
    if model.get("type") != "BPE":
        raise _Inexact(f"model type {model.get('type')}: only byte-level BPE is rebuilt for tiktoken")
    for key, plain in (("dropout", None), ("byte_fallback", False), ("continuing_subword_prefix", ""),
                       ("end_of_word_suffix", "")):
        if model.get(key) not in (plain, None):
            raise _Inexact(f"BPE {key}={model[key]!r}")
    nfc = _normalizer_is_nfc(spec.get("normalizer"))
    pat_str = _pattern(spec.get("pre_tokenizer"))
    special = _special_tokens(spec.get("added_tokens") or [], encode_special_tokens, nfc)
    ranks, rank_to_id = _mergeable_ranks(model)
    if rank_to_id is not None:  # special tokens need ranks of their own, mapped to their ids
        special_ids, special = special, {}
        for content, token_id in special_ids.items():
            special[content] = len(rank_to_id)
            rank_to_id.append(token_id)
    # bytes the vocabulary lacks: ranks past everything, so that tiktoken flags them instead of failing
    min_missing_rank = max([*ranks.values(), *special.values()]) + 1
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    for i, b in enumerate(missing):
        ranks[bytes([b])] = min_missing_rank + i
    try:
        encoding = tiktoken.Encoding(name="cliffguard-bpe", pat_str=pat_str, mergeable_ranks=ranks,
                                     special_tokens=special)
    except Exception as exc:  # fancy_regex rejects the pattern
        raise _Inexact(f"tiktoken rejects the pre-tokenizer regex {pat_str!r}: {exc}") from exc
    can_miss = any(b < 0xC0 or 0xC2 <= b <= 0xF4 for b in missing)  # bytes valid UTF-8 can hold
    return _FastPath(core=encoding._core_bpe, allowed_special=frozenset(special), rank_to_id=rank_to_id,
                     min_missing_rank=min_missing_rank if can_miss else None, nfc=nfc)


def _normalizer_is_nfc(normalizer: dict | None) -> bool:
    """False for no normalizer, True for NFC alone; any other normalizer changes text in ways not reproduced."""
    parts = normalizer.get("normalizers", []) if normalizer and normalizer.get("type") == "Sequence" else [normalizer]
    kinds = [p["type"] for p in parts if p is not None]
    if kinds in ([], ["NFC"]):
        return bool(kinds)
    raise _Inexact(f"normalizer {json.dumps(normalizer)[:200]}")


def _pattern(pre_tokenizer: dict | None) -> str:
    """tiktoken's pat_str: one regex whose matches are the pre-tokenizer's pieces."""
    parts = (pre_tokenizer.get("pretokenizers", []) if pre_tokenizer and pre_tokenizer.get("type") == "Sequence"
             else [pre_tokenizer])
    kinds = [p.get("type") if p else None for p in parts]
    byte_level = parts[-1] if kinds and kinds[-1] == "ByteLevel" else None
    if byte_level is not None and not byte_level.get("add_prefix_space", True):
        use_regex = byte_level.get("use_regex", True)
        if kinds == ["ByteLevel"]:
            return _GPT2_PATTERN if use_regex else r"[\s\S]+"
        if kinds == ["Digits", "ByteLevel"]:
            number = "" if parts[0].get("individual_digits", False) else "+"
            return _DIGITS_GPT2_PATTERN.replace("DIGITS", number) if use_regex else rf"\p{{N}}{number}|\P{{N}}+"
        split = parts[0]
        if (kinds == ["Split", "ByteLevel"] and not use_regex and "Regex" in split.get("pattern", {})
                and split.get("behavior") == "Isolated" and not split.get("invert", False)):
            regex = split["pattern"]["Regex"]
            # the text between two matches is a piece too: match it as a run of chars where no match starts
            return rf"{_group_plain_alternatives(regex)}|(?:(?!(?:{regex}))[\s\S])+"
    raise _Inexact(f"pre-tokenizer {json.dumps(pre_tokenizer)[:300]} is not one byte-level regex")


def _group_plain_alternatives(pattern: str) -> str:
    r"""`A|\s+(?!\S)|\s+` as `(?:A)|\s+(?!\S)|\s+` where A has no lookaround, backreference or bare flag group.

    The same matches, but fancy_regex hands all of A to the regex crate in one call instead of trying its
    alternatives one by one in its backtracking VM: about 1.5x faster on the GPT-2, Llama-3 and Qwen2 patterns.
    """
    head = pattern.removesuffix(_WHITESPACE_TAIL)
    trailing_backslashes = len(head) - len(head.rstrip("\\"))
    if (head == pattern or trailing_backslashes % 2
            or re.search(r"\(\?<|\(\?=|\(\?!|\\[1-9k]|\(\?[a-zA-Z-]*\)", head)):
        return pattern
    return f"(?:{head}){_WHITESPACE_TAIL}"


def _byte_chars() -> list[str]:
    """The ByteLevel alphabet (GPT-2's bytes_to_unicode): the char standing for each byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, num_shifted = [], 0
    for b in range(256):
        chars.append(chr(b) if b in printable else chr(256 + num_shifted))
        num_shifted += b not in printable
    return chars


_BYTE_CHARS = _byte_chars()
# str.translate table: ByteLevel chars -> the latin-1 char of their byte; other chars below 256 -> a char latin-1
# cannot encode, so that a token that is not byte-level fails to encode
_TO_LATIN1 = {**{i: "\uffff" for i in range(256)}, **{ord(c): chr(b) for b, c in enumerate(_BYTE_CHARS)}}


def _token_bytes(token: str) -> bytes | None:
    """The bytes a ByteLevel vocabulary token stands for; None for a token outside the alphabet."""
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return None


def _mergeable_ranks(model: dict[str, Any]) -> tuple[dict[bytes, int], list[int] | None]:
    """tiktoken's mergeable_ranks and the rank -> id table (None when the ranks are the ids); see the module doc."""
    vocab: dict[str, int] = model["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    merge_rank = {pair: rank for rank, pair in enumerate(merges)}  # a repeated pair keeps its last rank, as in HF
    rules_making: dict[str, list[int]] = {}
    for (left, right), rank in merge_rank.items():
        rules_making.setdefault(left + right, []).append(rank)
    ignore_merges = bool(model.get("ignore_merges", False))

    token_bytes = {token: _token_bytes(token) for token in vocab}
    single = {b[0]: vocab[token] for token, b in token_bytes.items() if b is not None and len(b) == 1}
    longer = [token for token, b in token_bytes.items() if b is not None and len(b) > 1]
    # HF's merges alone (no pre-tokenizer, no added tokens, no whole-token shortcut) on each longer token
    merges_only = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    runs = merges_only.encode_batch(longer, add_special_tokens=False)
    final_rule: dict[str, int] = {}
    unreachable_kept: list[str] = []
    for token, run in zip(longer, runs):
        if run.ids == [vocab[token]]:
            rules = rules_making[token]
            final_rule[token] = rules[0] if len(rules) == 1 else _final_rule(list(token), merge_rank)
        elif ignore_merges and len(run.ids) >= 3:
            unreachable_kept.append(token)
        elif ignore_merges and _can_be_piece(token_bytes[token]):
            raise _Inexact(f"ignore_merges: token {token!r} is only ever taken whole, but its own merges end in "
                           "two tokens that tiktoken would join")

    by_rule = sorted(final_rule, key=final_rule.__getitem__)
    if all(vocab[a] < vocab[b] for a, b in zip(by_rule, by_rule[1:])):  # ids in merge order: ranks = ids
        ranks = {bytes([b]): token_id for b, token_id in single.items()}
        ranks.update((token_bytes[t], vocab[t]) for t in [*by_rule, *unreachable_kept])
        return ranks, None
    rank_to_id = list(range(256))  # placeholder ids for bytes the vocabulary lacks: never returned
    ranks = {}
    for b, token_id in single.items():
        ranks[bytes([b])] = b
        rank_to_id[b] = token_id
    for token in [*by_rule, *unreachable_kept]:
        ranks[token_bytes[token]] = len(rank_to_id)
        rank_to_id.append(vocab[token])
    return ranks, rank_to_id


def _final_rule(symbols: list[str], merge_rank: dict[tuple[str, str], int]) -> int:
    """HF's BPE on one word (the leftmost pair of the first rule, until no rule applies): its last rule."""
    last = -1
    while len(symbols) > 1:
        rank, i = min((merge_rank.get(pair, len(merge_rank)), i) for i, pair in enumerate(zip(symbols, symbols[1:])))
        if rank == len(merge_rank):
            break
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        last = rank
    return last


def _can_be_piece(token: bytes) -> bool:
    """Pieces are whole UTF-8 chars."""
    try:
        token.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _special_tokens(added_tokens: list[dict[str, Any]], skip_special: bool, nfc: bool) -> dict[str, int]:
    """The added tokens tiktoken matches, as its special tokens: content -> id.

    tokenizers matches added tokens leftmost-longest, non-normalized ones first; tiktoken leftmost-first in an
    arbitrary order. That agrees when no two tokens overlap (neither holds the other, and no end of one starts
    another) and no token strips spaces or needs word boundaries.
    """
    strings: dict[str, dict[str, Any]] = {}
    for token in added_tokens:
        content = token["content"]
        if not content:
            continue
        text = unicodedata.normalize("NFC", content) if nfc and token.get("normalized", True) else content
        if text in strings:
            raise _Inexact(f"added tokens {strings[text]['content']!r} and {content!r} match the same text")
        strings[text] = token
    _check_no_overlap(list(strings))
    special = {}
    for text, token in strings.items():
        if skip_special and token.get("special", False):
            continue  # split_special_tokens: tokenizers encodes it as text
        flags = [flag for flag in ("lstrip", "rstrip", "single_word") if token.get(flag, False)]
        if flags:
            raise _Inexact(f"added token {token['content']!r} has {'/'.join(flags)}")
        special[text] = token["id"]
    return special


def _check_no_overlap(strings: list[str]) -> None:
    starts: dict[str, set[str]] = {}
    for s in strings:
        for k in range(1, len(s)):
            starts.setdefault(s[:k], set()).add(s)
    for s in strings:
        inside = next((t for t in strings if t != s and s in t), None)
        if inside is not None:
            raise _Inexact(f"added token {s!r} occurs inside added token {inside!r}")
        for k in range(1, len(s)):
            others = starts.get(s[k:], set()) - {s}
            if others:
                raise _Inexact(f"added token {s!r} ends with the start of added token {min(others)!r}")


# --- construction check -------------------------------------------------------------------------------------------

_CHECK_CORPUS = (
    "Hello, world! It's 5 o'clock: we'll see, they'd go, you're right, I've won, I'm here. IT'S DON'T 'S 'ſ",
    'def f(x, *args, **kw):\n    """Doc."""\n    return {"a": [1, 2, 3], \'b\': x ** 2}\n\n\nclass A:\n\tpass\n',
    '{"key": "value", "n": 12345678901234567890, "f": -1.5e-10, "nested": {"list": [true, false, null]}}',
    'for f in *.py; do echo "$f" | grep -E "^[a-z]+$" && ls -la ~/tmp 2>&1; done # $((1+2))',
    "0 1 12 123 1234 12345 123456 3.14159 1,000,000 x1y22z333 ²³ ½ ٣٤٥ ४२ 一二三",
    "café naïve Ångström résumé Straße ﬁ K Ω e\u0301 a\u0308 Z\u0351\u0352\u0353 \u0915\u094d\u0937",
    "日本語のテキスト、中文文本。한국어 텍스트 ภาษาไทย",
    "👋🏽 👨\u200d👩\u200d👧\u200d👦 🇫🇷 ❤️ ✨ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🀄",
    "مرحبا بالعالم שלום עולם \u200f\u200e",
    "a  b   c\t\td\n\n\ne \r\n f" + " " * 17 + "g" + "\n" * 5 + "\t \n \t" + "\u00a0\u2003\u3000x  \n  ",
    "   leading and trailing   ", "", " ", "\n", "a", "  1", "\n\n1", "x 1 2  3   4",
    "\x00\x01\x07\x1b[0m\x7f\u200b\ufeff\u2028\u2029\x85",
)


def _check_texts(added: list[str]) -> list[str]:
    """The built-in corpus plus the added tokens in context and near misses of them."""
    texts = list(_CHECK_CORPUS)
    for content in added[:64]:
        texts += [f"x{content}y", f" {content} \n{content}{content}", content[:-1], content[1:], f"{content[:-1]} "]
    if added:
        texts.append(" a ".join(added) + "\n" + "".join(added))
    return texts


def _verify(fast: _FastPath, tokenizer: Tokenizer) -> None:
    """Raise _Inexact if tiktoken's ids differ from tokenizers' on the check corpus."""
    added = _hf_backend(tokenizer).get_added_tokens_decoder()
    texts = _check_texts([added[i].content for i in sorted(added)])
    expected = tokenizer.encode_batch(texts, add_special_tokens=False)
    for text, want in zip(texts, expected):
        ranks = fast.ranks(text)
        if ranks is not None and fast.ids(ranks) != want:
            raise _Inexact(f"ids differ from tokenizers' on {text!r:.80}")
