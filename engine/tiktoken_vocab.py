"""A model folder whose tokenizer is a tiktoken vocabulary (Kimi K2's: `tiktoken.model` and a Python class, no
tokenizer.json) read into the `tokenizers` library's byte-level BPE, which `engine.tokenizer.Tokenizer` wraps.

The folder's `tiktoken.model` holds each token's bytes (base64) and its rank, which is its id; the split of a text
into pieces is the class's regular expression (`PATTERNS`, by `tokenizer_class`: Moonshot's `TikTokenTokenizer`),
and its special tokens follow the vocabulary, `NUM_SPECIAL` of them, named by tokenizer_config.json's
`added_tokens_decoder` (the others `<|reserved_token_{id}|>`), as the class builds them. tiktoken merges, inside a
piece, the adjacent pair whose concatenation has the lowest rank, after looking the whole piece up; the BPE here
has the same ids, a merge rule for each way a token splits into two tokens, ordered by the token's rank, and looks
the whole piece up first (`ignore_merges`), as transformers' converter of tiktoken vocabularies does. The class
also hands its template the tools with their keys sorted at every depth (`sorted_keys`): so does
`engine.tokenizer.Tokenizer.apply_chat_template` for such a folder.
"""

from __future__ import annotations

import base64
import functools
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

VOCAB_FILE = "tiktoken.model"
NUM_SPECIAL = 256 + 2   # Moonshot's class: 256 reserved special tokens and two more after the vocabulary
# the pieces a text splits into, by tokenizer_config.json's `tokenizer_class` (Moonshot's tokenization_kimi.py)
PATTERNS = {"TikTokenTokenizer": "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+"])}


SORTS_TOOLS = ("TikTokenTokenizer",)   # classes whose chat template gets the tools' keys sorted at every depth


def sorted_keys(value: Any) -> Any:
    """`value` (JSON) with every object's keys in sorted order, as Moonshot's class hands tools to its template."""
    if isinstance(value, dict):
        return {key: sorted_keys(value[key]) for key in sorted(value)}
    return [sorted_keys(item) for item in value] if isinstance(value, list) else value


@functools.cache
def _byte_chars() -> tuple[str, ...]:
    """GPT-2's printable character for each byte, as byte-level BPE vocabularies write bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return tuple(chars[b] for b in range(256))


def read_ranks(path: Path) -> dict[bytes, int]:
    """A `tiktoken.model` file: each line a token's base64 bytes and its rank."""
    ranks = {}
    for number, line in enumerate(path.read_text(encoding="ascii").splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise ValueError(f"{VOCAB_FILE}: line {number} of {path} is not a token's base64 and its rank") from None
    return ranks


def tiktoken_backend(folder: Path, config: dict[str, Any]) -> _Backend | None:
    """The folder's tiktoken vocabulary as a `tokenizers` BPE with its special tokens; None where the folder has no
    `tiktoken.model`. A class whose pieces this module does not know is a ValueError naming it."""
    path = folder / VOCAB_FILE
    if not path.is_file():
        return None
    kind = config.get("tokenizer_class")
    if kind not in PATTERNS:
        raise ValueError(f"tokenizer_class: {folder} has a {VOCAB_FILE} of class {kind!r}, whose pieces are not "
                         f"known here (known: {', '.join(PATTERNS)})")
    ranks = read_ranks(path)
    chars = _byte_chars()
    vocab = {"".join(chars[b] for b in token): rank for token, rank in ranks.items()}
    if sorted(vocab.values()) != list(range(len(vocab))) or any(bytes([b]) not in ranks for b in range(256)):
        raise ValueError(f"{VOCAB_FILE}: {path} is not a byte-level vocabulary (its ranks run 0..n-1 over every byte)")
    backend = _Backend(models.BPE(vocab, _merges(vocab), fuse_unk=False, byte_fallback=False, ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERNS[kind]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    named = {int(i): entry for i, entry in (config.get("added_tokens_decoder") or {}).items()}
    for i in range(len(vocab), len(vocab) + NUM_SPECIAL):   # one at a time: each takes the next id
        entry = named.get(i) if isinstance(named.get(i), dict) else {}
        fields = {key: entry[key] for key in ("single_word", "lstrip", "rstrip", "normalized", "special")
                  if isinstance(entry.get(key), bool)}
        content = entry.get("content") if isinstance(entry.get("content"), str) else f"<|reserved_token_{i}|>"
        backend.add_special_tokens([AddedToken(content, **{"special": True, "normalized": False, **fields})])
        if backend.token_to_id(content) != i:
            raise ValueError(f"added_tokens_decoder: {content!r} named twice; its id {i} is taken")
    return backend


def _merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """A merge rule for each way a token splits into two tokens, by the token's rank, then the parts' ranks."""
    rules = []
    for token, rank in vocab.items():
        splits = [(vocab[token[:k]], vocab[token[k:]], token[:k], token[k:]) for k in range(1, len(token))
                  if token[:k] in vocab and token[k:] in vocab]
        rules += [(rank, *split) for split in splits]
    rules.sort()
    return [(left, right) for _, _, _, left, right in rules]
