"""Tencent's HY V4 config.json (`HYV4ForCausalLM`: Hy4-preview) as transformers' `HYV4Config` reads it.

Its layers are DeepSeek V3.2's (latent attention made sparse by an indexer, DeepSeek V3's grouped sigmoid experts
beside a shared one past the dense first layer), with four changes the model (`engine.models.hy_v4`) makes:
- the residual stream is `hc_mult` streams (`HyperConnections`): each sublayer reads a mix of them and writes its
  output into each, weighted per token by a small projection of all of them (independent hyper-connections: no
  Sinkhorn-projected mixing of the streams, unlike DeepSeek V4's), and the head reads a last mix;
- each head's output is gated by sigmoid(`gate_proj`) of the layer's input, per channel, and every head has a learned
  attention sink (a logit in its softmax's denominator);
- the indexer rotates the last `qk_rope_head_dim` of its heads (V3.2's the first), and the layers `indexer_types`
  calls `shared` reuse the last full one's choice (GLM-5's way); the latent attention's rotary turns halves;
- the routed experts' SwiGLU is clamped at `swiglu_limit` (the gate from above, up both ways), the shared expert's
  and the dense MLPs' not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.config import ConfigError
from engine.config_values import read_float, read_int
from engine.deepseek_config import check_silu, dense_first, grouped_experts, shared_indexers
from engine.mla_config import DSA_DEFAULTS, MLA_DEFAULTS, read_mla

__all__ = ["HY_V4_DEFAULTS", "HY_V4_VL_TEXT", "HyperConnections", "hy_v4_fields"]

ARCH = "HYV4ForCausalLM"
# HYV4Config's where config.json names none (Hy4-preview's shape; its attention: `MLA_DEFAULTS`, `DSA_DEFAULTS`)
HY_V4_DEFAULTS = {"vocab_size": 120_832, "hidden_size": 2816, "intermediate_size": 6912, "num_hidden_layers": 34,
                  "num_attention_heads": 32, "max_position_embeddings": 262_144, "rms_norm_eps": 1e-5,
                  "bos_token_id": 120_000, "eos_token_id": 120_025}
# HY4-VL's text model (`HYV4VLForConditionalGeneration`'s `hy_v4_vl_text`): HYV4VLTextConfig's defaults where they
# differ from HYV4Config's (a composite checkpoint's text_config may be saved as its difference from them)
HY_V4_VL_TEXT = {"hidden_size": 6144, "intermediate_size": 18_432, "moe_intermediate_size": 2048,
                 "num_hidden_layers": 78, "num_attention_heads": 64, "q_lora_rank": 2048, "index_n_heads": 32}
HY_V4_EXPERTS = dict(n_routed_experts=256, moe_intermediate_size=768, num_experts_per_tok=8, n_group=1, topk_group=1,
                     norm_topk_prob=True, first_k_dense_replace=1, routed_scaling_factor=2.827, n_shared_experts=1)


@dataclass(frozen=True)
class HyperConnections:
    """`streams` residual streams a token (`hc_mult`); a sublayer's output written into stream s times `magnitude` x
    sigmoid(its post logit) + `eps`, its input the streams' sum each times sigmoid(its pre logit) + `eps`. Each mix
    (`fn` [2 x streams, streams x hidden], a `base` and two `scale`s; the head's `hc_fn` [streams, streams x hidden],
    `hc_base`, one `hc_scale`) is whole on every rank, in float32 as transformers keeps it."""

    streams: int
    magnitude: float
    eps: float

    def num_params(self, hidden: int, num_layers: int) -> int:
        """Every layer's two mixes (attention's, the MLP's) and the head's."""
        n = self.streams
        return num_layers * 2 * (2 * n * n * hidden + 2 * n + 2) + n * n * hidden + n + 1


def hy_v4_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """HY V4's `ModelConfig` fields (the module docstring): `layer_types` all `indexed_attention`, the dense layers
    first (`mlp_layer_types`, else the first), `indexer_types` full or shared (by default the first full, then every
    4th from the second), experts by DeepSeek V3's router in `n_group` groups."""
    check_silu(cfg, "HY V4")
    kinds = cfg.get("layer_types")
    if kinds is not None and kinds != ["indexed_attention"] * num_layers:
        raise ConfigError(f"layer_types: HY V4 is served with indexed_attention on every layer, got {kinds!r:.80}")
    shared = _shared_indexers(cfg, num_layers)
    mla = read_mla(cfg, MLA_DEFAULTS[ARCH], interleave_key=False, dsa=DSA_DEFAULTS[ARCH], index_shared=shared)
    experts = grouped_experts({**cfg, "first_k_dense_replace": dense_first(cfg, 1)}, HY_V4_EXPERTS, "deepseek_v3",
                              grouped=True)
    limit = read_float(cfg, "swiglu_limit", 10.0, positive=False)
    hyper = HyperConnections(streams=read_int(cfg, "hc_mult", 4), magnitude=read_float(cfg, "hc_magnitude", 2.0),
                             eps=read_float(cfg, "hc_eps", 1e-6, positive=False))
    vl = cfg.get("model_type") == "hy_v4_vl_text"   # HY4-VL's: interleaved pairs rotated (its rows reordered as
    # read, the indexer's too), q's and the latent's norms at the model's epsilon
    mla = replace(mla, rope_interleave=vl, index_rope_interleave=vl,
                  latent_norm_eps=read_float(cfg, "rms_norm_eps", 1e-5) if vl else None)
    return {"mla": mla, "head_dim": mla.cache_dim, "num_kv_heads": 1,
            "attention_sinks": True, "swiglu_limit": limit if limit > 0 else None, "hyper_connections": hyper,
            "stacked_experts": True,   # stacked as transformers saves them, or per expert
            **experts}


def _shared_indexers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The layers `indexer_types` calls `shared` (HYV4Config's default: all but the first and every 4th from the
    second); the first must be full (`shared_indexers`)."""
    kinds = cfg.get("indexer_types")
    if kinds is None:
        kinds = ["full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(num_layers)]
    return shared_indexers(kinds, num_layers)
