"""The model behind each pool: a pool's `model` (builtin, HF folder, GGUF file) resolved to a folder and
read into its `engine.model_config.ModelConfig`, or one config.json given for every pool (`cliffguard
capacity --model-config`); a pool's tokenizer (`pool_tokenizer`, its own chat template where it names one). Errors
are SpecErrors naming the pool's key, or ConfigErrors naming the option."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from engine.config import ConfigError
from engine.model_config import ModelConfig
from pools.config.spec import CliffguardConfig, PoolSpec, SpecError


def resolve_model_configs(config: CliffguardConfig, model_config: str | None = None, *,
                          folders: dict[str, Path] | None = None) -> dict[str, ModelConfig]:
    """Each local pool's `model` -> its ModelConfig (models resolved, GGUF files converted once);
    `model_config`: one config.json (or a folder holding one) used for every pool instead. `folders`
    caches each resolved model spec's folder (see `model_folder`) for the caller to reuse. A tied config
    whose checkpoint stores a head of its own is read untied: the engine serves that head."""
    if model_config is not None:
        given = read_model_config(model_config)
        return {p.model: given for p in config.local_pools}
    from engine.weights import stores_own_head

    folders = {} if folders is None else folders
    result: dict[str, ModelConfig] = {}
    for i, p in enumerate(config.pools):
        if p.is_upstream or p.model in result:
            continue
        key = f"pools[{i}].model"
        path = model_folder(p.model, key, folders)
        try:
            model = ModelConfig.from_folder(path)
            if stores_own_head(path, model.tie_word_embeddings, model.text_weights_prefix, model.bare_text_weights):
                model = replace(model, tie_word_embeddings=False)   # the head the engine serves: counted
        except (FileNotFoundError, ValueError) as exc:
            raise SpecError(f"{key}: {exc}") from None
        result[p.model] = model
    return result


def model_folder(spec: str, key: str, folders: dict[str, Path]) -> Path:
    """`engine.weights.resolve_model(spec)`, once per spec (cached in `folders`); a SpecError naming
    `key` when the model cannot be found or converted."""
    if spec not in folders:
        from engine.weights import resolve_model

        try:
            folders[spec] = resolve_model(spec)
        except (OSError, ValueError) as exc:   # OSError: not found, or a path no file system can hold
            raise SpecError(f"{key}: {exc}") from None
    return folders[spec]


def pool_tokenizer(spec: PoolSpec, i: int, folders: dict[str, Path]):
    """The `engine.tokenizer.Tokenizer` that counts pool `i`'s tokens and renders its chats: its `tokenizer`'s (else
    its `model`'s) folder's, with `chat_template`'s file in place of the folder's template where it names one. A
    file missing, unreadable, not UTF-8 or not a Jinja template is a SpecError naming `pools[i].chat_template`."""
    import jinja2

    from engine.chat_template import compile_chat_template
    from engine.tokenizer import Tokenizer

    key = f"pools[{i}].tokenizer" if spec.tokenizer else f"pools[{i}].model"
    folder = model_folder(spec.tokenizer or spec.model, key, folders)
    if spec.chat_template is None:
        return Tokenizer.from_folder(folder)
    key = f"pools[{i}].chat_template"
    try:
        source = Path(spec.chat_template).expanduser().read_text(encoding="utf-8")
        compile_chat_template(source)
    except OSError as exc:
        raise SpecError(key, f"cannot read {spec.chat_template} ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise SpecError(key, f"{spec.chat_template} is not UTF-8 text; a chat template is a Jinja file") from None
    except jinja2.TemplateSyntaxError as exc:
        raise SpecError(key, f"{spec.chat_template}: line {exc.lineno}: {exc.message}") from None
    return Tokenizer.from_folder(folder, chat_template=source)


def read_model_config(path: str) -> ModelConfig:
    """An HF config.json, or a folder holding one; errors name `--model-config`."""
    target = Path(path).expanduser()
    if target.is_dir():
        try:
            return ModelConfig.from_folder(target)
        except (FileNotFoundError, ValueError) as exc:   # ConfigError included
            raise ConfigError(f"--model-config: {path}: {exc}") from None
    if not target.is_file():
        raise FileNotFoundError(f"--model-config: no such file or folder {path}")
    try:
        return ModelConfig.from_hf_config(json.loads(target.read_text(encoding="utf-8")))
    except UnicodeDecodeError:
        raise ConfigError(f"--model-config: {path}: not UTF-8 text; an HF config.json is JSON") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--model-config: {path}: not valid JSON ({exc})") from None
    except ValueError as exc:   # ConfigError included: the key it names, in this file
        raise ConfigError(f"--model-config: {path}: {exc}") from None


def upstream_context(spec: PoolSpec, folders: dict[str, Path], i: int) -> int:
    """An upstream pool without `max_model_len`: its tokenizer model's context (config.json's), else 2^31.
    A route that starts or ends at or past that context could never be taken (in full): a SpecError saying to
    set the upstream's own `max_model_len` (one serving a longer context than its config says, say)."""
    path = folders.get(spec.tokenizer or spec.model)
    if path is None or not (path / "config.json").is_file():
        return 2**31 - 1
    try:   # the context alone: a checkpoint the engine would not serve (quantized: an upstream's) still says it
        cfg = json.loads((path / "config.json").read_bytes())
        served = {k: v for k, v in cfg.items() if k not in ("quantization_config", "compression_config")}
        context = ModelConfig.from_hf_config(served).context_length
    except (ConfigError, ValueError, AttributeError):   # not JSON, not an object, no shape of ours
        return 2**31 - 1
    for end, tokens, what in (("min", spec.route.min_prompt_tokens, "no prompt could reach it"),
                              ("max", spec.route.max_prompt_tokens, "the route's tail could never be taken")):
        if tokens is not None and tokens >= context:
            raise SpecError(f"pools[{i}].route.{end}_prompt_tokens: {tokens} is at or past {context}, the context "
                            f"in {spec.tokenizer or spec.model}'s config.json, which an upstream pool without "
                            f"max_model_len is held to; {what}: set pools[{i}].max_model_len to the context the "
                            f"upstream serves")
    return context
