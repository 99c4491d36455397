"""A model folder whose tokenizer is a tiktoken vocabulary (Kimi K2's `tiktoken.model` and Moonshot's class, no
tokenizer.json): read by `Tokenizer.from_folder` and checked against tiktoken itself, an implementation nobody here
wrote, built from the same ranks, pattern and special tokens as Moonshot's class builds it. The vocabulary is one
learned here by byte-pair merges over a mixed text (English with contractions, Chinese, digits, code, blank runs), so
that many pieces need several merges."""

from __future__ import annotations

import base64
import collections
import json
from pathlib import Path

import pytest
import regex
import tiktoken

from engine.tiktoken_vocab import NUM_SPECIAL, VOCAB_FILE
from engine.tokenizer import Tokenizer

pytestmark = pytest.mark.fresh_tokenizers

# Moonshot's pattern as its tokenization_kimi.py writes it (kept apart from the module's copy, which it checks)
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+"""])
CORPUS = ("The model's answer isn't what we'd expected; they're sure it'll work. HTTPServer parses JSONData.\n"
          "中文English混合，北京市 Pascal 汉字abc。我们的模型很好！\n"
          "def f(x):\n    return x ** 2  # 12345678 + 3.14159\n\n\n"
          "Numbers 2026-12-04, ids 0x7fff, and ÜBER café naïve résumé. ") * 20
NAMED = {0: "[BOS]", 1: "[EOS]", 5: "<|im_end|>", 6: "<|im_user|>", 7: "<|im_assistant|>", 9: "<|im_system|>",
         10: "<|im_middle|>", 13: "<|tool_calls_section_begin|>"}


def _learn(text: str, num_merges: int) -> dict[bytes, int]:
    """Ranks learned by byte-pair merges over `text`'s pieces (every byte first, each new token the next rank)."""
    ranks = {bytes([b]): b for b in range(256)}
    pieces = [[bytes([b]) for b in piece.encode()] for piece in regex.findall(KIMI_PATTERN, text)]
    for _ in range(num_merges):
        pairs = collections.Counter(pair for piece in pieces for pair in zip(piece, piece[1:]))
        if not pairs:
            break
        (left, right), _ = pairs.most_common(1)[0]
        ranks[left + right] = len(ranks)
        for piece in pieces:
            i = 0
            while i < len(piece) - 1:
                if piece[i] == left and piece[i + 1] == right:
                    piece[i:i + 2] = [left + right]
                i += 1
    return ranks


@pytest.fixture(scope="module")
def kimi_folder(tmp_path_factory) -> tuple[Path, tiktoken.Encoding]:
    """A folder of Kimi's shape (its tokenizer class, 258 special tokens some named) and tiktoken's encoding of it."""
    folder, ranks = tmp_path_factory.mktemp("kimi"), _learn(CORPUS, 400)
    (folder / VOCAB_FILE).write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    decoder = {str(len(ranks) + i): {"content": name, "special": True} for i, name in NAMED.items()}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TikTokenTokenizer", "added_tokens_decoder": decoder, "bos_token": "[BOS]",
        "eos_token": "[EOS]", "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "chat_template": "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"}))
    specials = {NAMED.get(i - len(ranks), f"<|reserved_token_{i}|>"): i
                for i in range(len(ranks), len(ranks) + NUM_SPECIAL)}
    return folder, tiktoken.Encoding("kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


TEXTS = ["Hello world, it's the model's turn; we'd say they're done.", "中文English混合", "北京市 Pascal 汉字abc",
         "def g(y):\n\treturn y * 1234567  # ok\n\n\n   \n", "ÜBERcafé naïveRésumé 3.14159", "HTTPServerJSONData",
         "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>", "emoji 🙂🙂 and \u200b zero width", "  lead",
         "x" * 300 + " " * 70 + "y"]


def test_a_kimi_folder_encodes_and_decodes_as_tiktoken_does(kimi_folder):
    folder, reference = kimi_folder
    tokenizer = Tokenizer.from_folder(folder)
    assert tokenizer.vocab_size == reference.n_vocab
    for text in [*TEXTS, CORPUS]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, allowed_special="all"), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    last = reference.n_vocab - 1
    assert tokenizer.encode(f"<|reserved_token_{last}|>", add_special_tokens=False) == [last]
    assert tokenizer.decode(tokenizer.encode("<|im_end|>ok", add_special_tokens=False), skip_special_tokens=True) == "ok"


def test_a_tiktoken_folder_of_a_class_whose_pieces_are_unknown_is_refused_by_its_key(kimi_folder, tmp_path):
    folder, _ = kimi_folder
    (tmp_path / VOCAB_FILE).write_bytes((folder / VOCAB_FILE).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "OtherTikToken"}))
    with pytest.raises(ValueError, match="tokenizer_class: .*'OtherTikToken'.*TikTokenTokenizer"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TikTokenTokenizer"}))
    (tmp_path / VOCAB_FILE).write_text("not base64!! 0\n")
    with pytest.raises(ValueError, match="tiktoken.model: line 1"):
        Tokenizer.from_folder(tmp_path)


def test_the_tools_reach_a_kimi_template_with_their_keys_sorted_as_moonshots_class_hands_them(kimi_folder):
    folder, _ = kimi_folder
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {"type": "integer"}}}}}]
    rendered = Tokenizer.from_folder(folder).apply_chat_template([{"role": "user", "content": "!"}], tools=tools)
    listed = json.loads(rendered[:-1])
    assert list(listed[0]) == ["function", "type"] and list(listed[0]["function"]) == ["name", "parameters"]
    assert list(listed[0]["function"]["parameters"]["properties"]) == ["alpha", "zeta"]
