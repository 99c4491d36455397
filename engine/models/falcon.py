"""TII's Falcon (`FalconForCausalLM`; its config `engine.falcon_config`): GPT-NeoX's model (`ungated_layer`: a
parallel layer of one norm or two, or a sequential one; LayerNorms, an ungated MLP) under Falcon's names
(`transformer.word_embeddings`, `transformer.h.N`, `self_attention.query_key_value` grouped by KV head and split as
read by `split_grouped_qkv`, `self_attention.dense`, `ln_attn` / `ln_mlp` the two norms, `transformer.ln_f`), the whole
head rotated."""

from __future__ import annotations

from engine.models.gpt_neox import GPTNeoXForCausalLM

__all__ = ["FalconForCausalLM"]

# the checkpoint's names (past `transformer.`) -> the model's (before Jais 2's reading: the MLP's up_proj as its `up`)
_RENAMES = ((".self_attention.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
            (".mlp.dense_4h_to_h.", ".mlp.down_proj."), (".ln_attn.", ".input_layernorm."),
            (".ln_mlp.", ".post_attention_layernorm."))
_TOP_NAMES = {"word_embeddings.weight": "embed_tokens.weight", "ln_f.weight": "norm.weight", "ln_f.bias": "norm.bias"}


class FalconForCausalLM(GPTNeoXForCausalLM):
    """Falcon (see the module docstring): GPT-NeoX's reading under Falcon's names."""

    checkpoint_prefix, top_names, renames = "transformer.", _TOP_NAMES, _RENAMES
    fused_qkv, skipped = ".self_attention.query_key_value.", ()
