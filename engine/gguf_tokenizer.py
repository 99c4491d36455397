"""The tokenizer files of a model folder converted from a GGUF file (`engine.weights.convert_gguf`).

transformers' GGUF tokenizer reader writes tokenizer.json and tokenizer_config.json; this makes the config
self-contained (the chat template in it, tokens as strings, `add_bos_token` as the GGUF says) and gives the
pre-tokenizers that reader does not know their rule (`DIGITS_FIRST`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["DIGITS_FIRST", "write_tokenizer"]

# `tokenizer.ggml.pre` names whose text is split into single digits before GPT-2's byte-level rule (llama.cpp's
# STARCODER group; SmolLM2's own tokenizer.json: Digits(individual) then ByteLevel). transformers' GGUF reader
# knows none of them: it wrote GPT-2's rule alone, so "\n\n1" ran "\n", "\n", "1" where the model read "\n\n", "1".
DIGITS_FIRST = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_DIGITS_THEN_BYTES = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}


def write_tokenizer(gguf_path: Path, out_dir: Path, add_bos_token: bool | None, pre: str | None) -> None:
    """tokenizer.json and a self-contained tokenizer_config.json, via transformers' GGUF tokenizer reader; the
    pre-tokenizer of a `pre` in DIGITS_FIRST as the model's own tokenizer has it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the GGUF is local; never reach for the hub
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
    if pre in DIGITS_FIRST:
        path = out_dir / "tokenizer.json"
        data = json.loads(path.read_text(encoding="utf-8"))
        data["pre_tokenizer"] = _DIGITS_THEN_BYTES
        path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key in ("is_local", "local_files_only"):  # describe this load, not the tokenizer
        config.pop(key, None)
    template = out_dir / "chat_template.jinja"  # transformers >= 5 writes the template beside the config
    if "chat_template" not in config and template.is_file():
        config["chat_template"] = template.read_text()
    for key in ("bos_token", "eos_token"):
        if isinstance(config.get(key), dict):  # an AddedToken written out as a dict
            config[key] = config[key]["content"]
    config["add_bos_token"] = bool(add_bos_token if add_bos_token is not None
                                   else getattr(tokenizer, "add_bos_token", False))
    config_path.write_text(json.dumps(config, indent=2) + "\n")
