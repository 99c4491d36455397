"""EleutherAI's GPT-NeoX (`GPTNeoXForCausalLM`: GPT-NeoX-20B, Pythia, and the models trained on its code: Dolly v2,
RedPajama-INCITE, StableLM-Tuned-Alpha): multi-head attention (as many KV heads as query heads), LayerNorms of a weight
and a bias, q/k/v and `dense` (o_proj) biased where `attention_bias` (by default), an ungated biased MLP
(`dense_h_to_4h`, GELU: exact, or its tanh form where `hidden_act` says `gelu_fast` / `gelu_new`; `dense_4h_to_h`),
the first `rotary_pct` of each head turned with rotate-half pairs (q/k rows reordered as read: `partial_rotary_rows`).

Its layer is parallel by default (`use_parallel_residual`) with two norms off the same stream, unlike Cohere's one: x +
attention(norm_1(x)) + MLP(norm_2(x)) (`ungated_layer`: Cohere's layer with a norm for the MLP); else the Llama layer's
sequence. The checkpoint names the model `gpt_neox.` (`embed_in`, `final_layer_norm`, a layer's
`attention.query_key_value` holding each head's q, k and v rows one after the other, split as read) and the head
`embed_out`; the older releases' attention buffers (`attention.bias`, `attention.masked_bias`,
`attention.rotary_emb.inv_freq`) are skipped. The module path runs it."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from engine.layers import BiasLayerNorm
from engine.layers.norm import HeadLayerNorm
from engine.model import DecoderLayer, LlamaForCausalLM, WeightLoadError
from engine.model_config import ModelConfig
from engine.models.apertus import ApertusMLP, GeluTanh, Jais2ForCausalLM
from engine.models.cohere import CohereDecoderLayer
from engine.models.nemotron_h import ReluSquared
from engine.models.phi3 import partial_rotary_rows
from engine.models.smollm3 import layer_rotary

__all__ = ["GPTNeoXForCausalLM", "PersimmonForCausalLM", "checkpoint_name", "split_grouped_qkv", "split_qkv_rows",
           "ungated_layer"]

# the checkpoint's names (past `gpt_neox.`) -> the model's (before Jais 2's reading: the MLP's up_proj as its `up`)
_RENAMES = ((".attention.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
            (".mlp.dense_4h_to_h.", ".mlp.down_proj."))
_TOP_NAMES = {"embed_in.weight": "embed_tokens.weight", "embed_out.weight": "lm_head.weight",
              "final_layer_norm.weight": "norm.weight", "final_layer_norm.bias": "norm.bias"}
_BUFFERS = (".attention.bias", ".attention.masked_bias", ".attention.rotary_emb.inv_freq")   # not weights


def ungated_layer(model: LlamaForCausalLM, index: int, ops: ModuleType, act_fn: nn.Module) -> nn.Module:
    """Layer `index` of `model` with LayerNorms and an ungated MLP through `act_fn` (`ApertusMLP`): where the config's
    layer is parallel, Cohere's layer with one norm (Phi's, Falcon-7B's) or two (GPT-NeoX's, Falcon-40B's: the MLP's
    `post_attention_layernorm` of the same stream), else the Llama layer's sequence."""
    c, shard, rotary = model.config, model.shard, layer_rotary(model, index)   # GPT-BigCode's: NoPE
    if c.parallel_residual:
        layer = CohereDecoderLayer(c, shard, model.comm, rotary, ops, index)
        layer.input_layernorm = BiasLayerNorm(c.hidden_size, c.rms_norm_eps)
        if c.parallel_norms == 2:   # the MLP's own norm of the same stream
            layer.post_attention_layernorm = BiasLayerNorm(c.hidden_size, c.rms_norm_eps)
    else:
        layer = DecoderLayer(c, shard, model.comm, rotary, ops, index)
        layer.input_layernorm = BiasLayerNorm(c.hidden_size, c.rms_norm_eps)
        layer.post_attention_layernorm = BiasLayerNorm(c.hidden_size, c.rms_norm_eps)
    layer.mlp = ApertusMLP(c, shard, model.comm, act_fn)
    return layer


def checkpoint_name(name: str, prefix: str, top: dict[str, str], renames: tuple[tuple[str, str], ...],
                    blocks: str = "h.") -> str:
    """A checkpoint tensor's name past `prefix` (`gpt_neox.`, `transformer.`, `decoder.`) as the model's: `top`'s
    whole names (the embedding, the final norm), a block `{blocks}N.` as `layers.N.`, then `renames`' parts."""
    name = name.removeprefix(prefix)
    name = top.get(name, "layers." + name.removeprefix(blocks) if name.startswith(blocks) else name)
    for theirs, ours in renames:
        name = name.replace(theirs, ours)
    return name


def split_grouped_qkv(config: ModelConfig, hf_name: str, head: str, suffix: str, tensor: torch.Tensor
                      ) -> list[tuple[str, torch.Tensor]]:
    """A fused q/k/v weight or bias whose rows are grouped by KV head, each group its query heads' rows, then its key
    head's, then its value head's (GPT-NeoX's and Falcon's original layout: a KV head a query head; Falcon-7B's one
    group; Falcon-40B's one a KV head), as `{head}.self_attn.q_proj/k_proj/v_proj.{suffix}`, q and k reordered for
    a partial rotary (`partial_rotary_rows`)."""
    c = config
    heads, kv, d = c.num_heads, c.num_kv_heads, c.head_dim
    if tensor.shape[0] != (heads + 2 * kv) * d:
        raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the config ({heads} query "
                              f"heads and {kv} key and value heads of {d} rows, grouped by key head)")
    groups = tensor.reshape(kv, heads // kv + 2, d, *tensor.shape[1:])
    parts = (groups[:, :-2], groups[:, -2], groups[:, -1])
    return [(name, partial_rotary_rows(c, name, part.reshape(-1, *tensor.shape[1:])))
            for name, part in zip((f"{head}.self_attn.{proj}.{suffix}" for proj in ("q_proj", "k_proj", "v_proj")),
                                  parts)]


def split_qkv_rows(config: ModelConfig, hf_name: str, head: str, suffix: str, tensor: torch.Tensor
                   ) -> list[tuple[str, torch.Tensor]]:
    """A fused q/k/v weight whose rows are all of q's, then k's, then v's (DBRX's and MPT's `Wqkv`), as
    `{head}.self_attn.q_proj/k_proj/v_proj.{suffix}`."""
    c = config
    sizes = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)
    if tensor.shape[0] != sum(sizes):
        raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the config "
                              f"({' + '.join(map(str, sizes))} rows of q, k and v)")
    return [(f"{head}.self_attn.{proj}.{suffix}", part)
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), tensor.split(sizes))]


class GPTNeoXForCausalLM(Jais2ForCausalLM):
    """GPT-NeoX (see the module docstring): Jais 2's LayerNorms, ungated MLP and reading, its own layer and names. Its
    kin (Falcon, BLOOM, MPT, Persimmon) read their checkpoints the same way under their own names: the class
    attributes below."""

    checkpoint_prefix, blocks = "gpt_neox.", "h."   # the model's prefix, a layer's (`checkpoint_name`)
    top_names, renames = _TOP_NAMES, _RENAMES
    fused_qkv = ".attention.query_key_value."       # the fused q/k/v tensor's name, split by `split_qkv`
    split_qkv = staticmethod(split_grouped_qkv)
    skipped = _BUFFERS                               # names not read
    turned_norms = False                             # q/k norms reordered as q/k rows are for a partial rotary

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        act = self.config.hidden_act   # exact GELU, OPT's ReLU, else GELU's tanh form
        act_fn = nn.GELU() if act == "gelu" else nn.ReLU() if act == "relu" else GeluTanh()
        return ungated_layer(self, index, ops, act_fn)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's names as the model's (`checkpoint_name`); the fused q/k/v (weight or bias) as its q_proj,
        k_proj and v_proj rows (`split_qkv`: GPT-NeoX's `split_grouped_qkv`, a group a head); the rest (where
        `turned_norms`, q/k norms reordered for a partial rotary: Persimmon's) as Jais 2's reading."""
        if name.endswith(self.skipped):
            return ()
        name = checkpoint_name(name, self.checkpoint_prefix, self.top_names, self.renames, self.blocks)
        head, fused, suffix = name.partition(self.fused_qkv)
        if fused:
            return self.split_qkv(self.config, hf_name, head, suffix, tensor)
        if self.turned_norms:
            tensor = partial_rotary_rows(self.config, name, tensor)
        return super().read_tensor(hf_name, name, tensor)


# Persimmon's names -> the model's (before Jais 2's reading)
_PERSIMMON_RENAMES = ((".self_attn.dense.", ".self_attn.o_proj."), (".self_attn.q_layernorm.", ".self_attn.q_norm."),
                      (".self_attn.k_layernorm.", ".self_attn.k_norm."), (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
                      (".mlp.dense_4h_to_h.", ".mlp.down_proj."))
_PERSIMMON_TOP = {"final_layernorm.weight": "norm.weight", "final_layernorm.bias": "norm.bias"}


class PersimmonForCausalLM(GPTNeoXForCausalLM):
    """Adept's Persimmon (`PersimmonForCausalLM`: Persimmon-8B): GPT-NeoX's sequential layer (`use_parallel_residual`
    false) through squared ReLU, q and k normed per head before the rotary by one LayerNorm of a weight and a bias each
    (`HeadLayerNorm`, where `qk_layernorm`), half of each head turned by default. Names: a layer's
    `self_attn.query_key_value` holding each head's q, k and v rows one after the other (split as read),
    `self_attn.dense`, `self_attn.q_layernorm` / `k_layernorm` (reordered as the q/k rows are for the partial
    rotary), `mlp.dense_h_to_4h` / `dense_4h_to_h`, `final_layernorm`."""

    checkpoint_prefix, blocks = "", "layers."
    top_names, renames = _PERSIMMON_TOP, _PERSIMMON_RENAMES
    fused_qkv, skipped, turned_norms = ".self_attn.query_key_value.", (), True

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        c = self.config
        layer = ungated_layer(self, index, ops, ReluSquared())
        if c.qk_norm:
            layer.self_attn.q_norm = HeadLayerNorm(c.head_dim, c.rms_norm_eps)
            layer.self_attn.k_norm = HeadLayerNorm(c.head_dim, c.rms_norm_eps)
        return layer
