"""Dory beyond the tiny-model parity of `test_engine_vs_hf` (its loops and nGPT layers there): a checkpoint under the
release's names (`backbone.`, an attention and an mlp block a layer), more loops than trained, and the checks of
its config."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ConfigError
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.sampling import SamplingParams
from tests.conftest import make_tiny_model
from tests.engine.test_engine_vs_hf import DORY, _hf_greedy


def _released(name: str) -> str:
    """transformers' name of a Dory tensor -> the release's (what transformers' `LayerPairCollapse` reads back)."""
    name = name.replace("model.", "backbone.", 1).replace("embed_tokens.", "embeddings.")
    name = name.replace(".self_attn.gate_proj.", ".self_attn.g_proj.")
    if (m := re.match(r"backbone\.layers\.(\d+)\.(self_attn|mlp|lambda_1|lambda_2)", name)) is not None:
        i, part = int(m[1]), m[2]
        block = {"self_attn": f"layers.{2 * i}.mixer", "mlp": f"layers.{2 * i + 1}.mixer",
                 "lambda_1": f"layers.{2 * i}.attn_alpha", "lambda_2": f"layers.{2 * i + 1}.mlp_alpha"}[part]
        name = "backbone." + block + name[m.end():]
    return name


@pytest.mark.usefixtures("one_thread")
def test_the_releases_names_and_three_loops_serve_as_transformers_runs_them(tmp_path, builtin_path):
    """The tiny model's tensors renamed to the release's layout (`backbone.layers.2i.mixer` attention,
    `backbone.layers.2i+1.mixer` MLP, the rates `attn_alpha` / `mlp_alpha`, `embeddings`, `g_proj`): the engine
    generates what transformers generates from transformers' names; then with its recurrent layers run three times
    (`n_recurrent_loops`, a config a user may raise: 10 virtual layers, each its own K/V), again transformers'."""
    import transformers

    folder = make_tiny_model(tmp_path / "dory", "dory", builtin_path, **DORY)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (7, 30)]
    expected = [_hf_greedy(hf, p, 10, eos_ids=None) for p in prompts]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        tensors = load_file(folder / shard)
        save_file({_released(k): v for k, v in tensors.items()}, folder / shard, metadata={"format": "pt"})
    index["weight_map"] = {_released(k): v for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, progress=False)
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, params)] == expected
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "n_recurrent_loops": 3}))
    three = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, progress=False)
    assert three.model_config.num_kv_layers == 10
    hf3 = transformers.AutoModelForCausalLM.from_pretrained(make_tiny_model(
        tmp_path / "dory3", "dory", builtin_path, **{**DORY, "n_recurrent_loops": 3}), dtype=torch.float32).eval()
    assert [o.outputs[0].token_ids for o in three.generate(prompts, params)] == \
        [_hf_greedy(hf3, p, 10, eos_ids=None) for p in prompts]


@pytest.mark.usefixtures("one_thread")
def test_a_cache_the_last_loop_alone_keeps_serves_as_transformers_runs_it(tmp_path, builtin_path):
    """`recurrent_kv_cache_mode: last_loop`: the recurrent layers keep K/V once (6 layers of K/V, not 8), the first
    loop writing its own into the last loop's slots for the step's tokens and attending to them, the last loop's
    overwriting them; prompts prefilled in one step and decoded: transformers' greedy tokens (whose cache in that mode
    holds the last loop's K/V of the tokens before a step)."""
    import transformers

    folder = make_tiny_model(tmp_path / "dory", "dory", builtin_path,
                             **{**DORY, "recurrent_kv_cache_mode": "last_loop"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64,
                                 max_num_batched_tokens=64, progress=False)
    assert engine.model_config.num_kv_layers == 6 and engine.model.kv_slot == [0, 1, 2, 3, 2, 3, 4, 5]
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (7, 30, 60)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 12, eos_ids=None) for p in prompts]


def test_what_dory_does_not_serve_is_refused_by_key():
    """An unknown cache mode, sections that do not add up to the layers, another activation or rope type: refused
    naming the key; the release's doubled layout read as transformers reads it."""
    base = {"architectures": ["DoryForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "n_input_layers": 2, "n_output_layers": 2, "max_position_embeddings": 256}
    config = ModelConfig.from_hf_config(base)
    assert (config.num_layers, config.dory.recurrent, config.num_kv_layers) == (8, 2, 8)
    released = {**base, "num_hidden_layers": 12, "n_input_layers": 4, "n_output_layers": 4,
                "layer_types": [t for t in ("sliding_attention",) * 3 + ("full_attention",) + ("sliding_attention",) * 2
                                for t in (t, "mlp")]}
    assert ModelConfig.from_hf_config(released).layer_types == config.layer_types
    for change, key in (({"recurrent_kv_cache_mode": "every_loop"}, "recurrent_kv_cache_mode"),
                        ({"n_recurrent_layers": 5}, "n_recurrent_layers"), ({"hidden_act": "gelu"}, "hidden_act"),
                        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
                         "rope_parameters.full_attention.rope_type"),
                        ({"layer_types": ["chunked_attention"] * 6}, "layer_types")):
        with pytest.raises(ConfigError, match=f"^{re.escape(key)}:"):
            ModelConfig.from_hf_config({**base, **change})
