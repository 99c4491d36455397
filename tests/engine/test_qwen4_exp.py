"""Qwen4-Exp beyond the tiny-model parity of `test_engine_vs_hf` (its residual streams, PLE and QSA there): n-grams
cut at an EOS inside a prompt, the sigmoid output gate, the checks of its config and checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ConfigError
from engine.checkpoint_reading import WeightLoadError
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.sampling import SamplingParams
from tests.conftest import make_tiny_model
from tests.engine.test_engine_vs_hf import (QWEN4_EXP, _hf_greedy, assert_preempted_batch_answers,
                                             preempting_engine)


@pytest.mark.usefixtures("one_thread")
def test_ngrams_cut_at_an_eos_and_a_sigmoid_gate_match_transformers(tmp_path, builtin_path):
    """transformers reads an EOS inside a sequence as the end of a run: the tokens before it hash as EOS into the
    n-grams after it (`_shift_right_ignore_eos`). Prompts with an EOS first, in the middle and twice in a row, one
    of them past the indexer's dense regime, on a model whose linear layers gate their output by a sigmoid, two
    streams and its tables in one stored part: what transformers generates. Six sequences preempting one another
    (recomputed: their PLE and linear states rebuilt) answer as transformers does too."""
    import transformers

    folder = make_tiny_model(tmp_path / "qwen4", "qwen4_exp_text", builtin_path,
                             **{**QWEN4_EXP, "output_gate_type": "sigmoid", "hc_count": 2, "split_ngram_parts": 1})
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64,
                                 max_num_batched_tokens=64, progress=False)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (6, 9, 30)]
    prompts[0][0] = 2
    prompts[1][4] = 2
    prompts[2][10:12] = [2, 2]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 12, eos_ids=None) for p in prompts]
    states = engine.runner.model.states   # a row of the linear layers' and the PLE layers' states: what the plan counts
    row = [t[0] for t in (*states.conv, *states.ssm, *states.extra.conv, *states.extra.ssm)]
    assert sum(t.numel() * t.element_size() for t in row) == engine.model_config.state_bytes_per_seq(torch.float32)
    assert_preempted_batch_answers(preempting_engine(folder, "recompute"), hf, gen, "recompute")


def test_what_qwen4_exp_does_not_serve_is_refused_by_key(tmp_path, builtin_path):
    """QSA's keys (all of them, one key head, a budget of whole blocks), PLE only on linear layers with an EOS to
    cut at, a known output gate: each refused naming its key; a checkpoint whose PLE hashing differs from the one
    the config makes (its stored multipliers) is refused naming the tensor."""
    folder = make_tiny_model(tmp_path / "qwen4", "qwen4_exp_text", builtin_path, **QWEN4_EXP)
    cfg = json.loads((folder / "config.json").read_text())
    for change, key in (({"indexer_budget": None}, "indexer_budget"), ({"indexer_kv_heads": 2}, "indexer_kv_heads"),
                        ({"indexer_budget": 10}, "indexer_budget"), ({"ple_layer_ids": [2]}, "ple_layer_ids"),
                        ({"eos_token_id": None}, "eos_token_id"), ({"output_gate_type": "gelu"}, "output_gate_type"),
                        ({"indexer_head_dim": 4}, "indexer_head_dim"), ({"hc_count": 1}, "hc_count")):
        with pytest.raises(ConfigError, match=f"^{key}:"):
            ModelConfig.from_hf_config({**cfg, **change})
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.ple.ple_embedding.layer_multipliers"
    tensors = load_file(folder / index[name])
    tensors[name] = tensors[name] + 2
    save_file(tensors, folder / index[name])
    with pytest.raises(WeightLoadError, match=f"^{name}: does not match"):
        LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=16, progress=False)


def test_a_ple_layers_one_token_pieces_and_chunks_run_at_once_as_each_sequence_alone(tmp_path, builtin_path):
    """A PLE layer's step of test_hybrid's `SPLIT_*` (chunks resuming from a state with snapshots inside, a decode, a
    one-token piece ending on a snapshot's boundary, a one-token prompt, a new prompt with snapshots before its first
    token and after its last): the one-token pieces at once (`RecurrentStates.split`) and the chunks at once
    (`RecurrentStates.pieces`), both shared by the PLE states beside the linear layers'; outputs, token histories,
    convolution inputs and snapshots as each sequence alone, its chunk part by part."""
    from engine.layers.gated_delta_net import RecurrentStates
    from engine.models.qwen4_exp import PleLayer, PleStateShape
    from tests.engine.test_hybrid import (SPLIT_QUERY_LENS, SPLIT_ROWS_HELD, SPLIT_SLOTS,
                                         assert_split_step_is_each_sequence_alone)

    folder = make_tiny_model(tmp_path, "qwen4_exp_text", builtin_path, **QWEN4_EXP)
    model = LLMEngine.from_args(str(folder), dtype="float32", block_size=8, num_blocks=64, progress=False).model
    ple, s = next(m for m in model.modules() if isinstance(m, PleLayer)), model.config.qwen4_exp
    gen = torch.Generator().manual_seed(5)
    streams = torch.randn(sum(SPLIT_QUERY_LENS), s.streams * model.config.hidden_size, generator=gen)
    ids = torch.randint(3, 500, (sum(SPLIT_QUERY_LENS),), generator=gen)
    shape = PleStateShape((s.streams * model.config.hidden_size, s.conv_state_len), (s.ngram - 1,))
    conv = torch.randn(SPLIT_ROWS_HELD + 2, *shape.conv_state_shape, generator=gen)
    # the last tokens of each row
    held = torch.randint(3, 500, (SPLIT_ROWS_HELD + 2, s.ngram - 1), generator=gen).float()

    def make_states():
        extra = RecurrentStates(shape, len(s.ple_layers), torch.float32, torch.device("cpu"))
        states = RecurrentStates(model.state_shape(), len(model.state_index), torch.float32, torch.device("cpu"),
                                 extra=extra)
        states.reserve(SPLIT_ROWS_HELD)
        states.reserve_snapshots(SPLIT_SLOTS)
        extra.conv[ple.index].copy_(conv)
        extra.ssm[ple.index].copy_(held)
        extra.conv[ple.index][extra.zero_row] = 0   # nothing writes the zero row
        extra.ssm[ple.index][extra.zero_row] = 0
        return states

    def run(tokens, meta, states):
        return ple(streams[tokens], ids[tokens], meta, states.extra)

    def each_part_alone(tokens, meta, states):   # a chunk's parts one by one
        ple.scans_pieces = False
        try:
            return run(tokens, meta, states)
        finally:
            del ple.scans_pieces

    i = ple.index
    assert_split_step_is_each_sequence_alone(
        run, make_states, lambda st: (st.extra.conv[i], st.extra.ssm[i], st.extra.snap_conv[i], st.extra.snap_ssm[i]),
        each_part_alone)
