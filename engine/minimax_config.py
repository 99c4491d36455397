"""MiniMax-Text-01's and MiniMax-M1's config.json (`MiniMaxForCausalLM`, as transformers' `MiniMaxConfig` reads it;
the releases' own `MiniMaxText01ForCausalLM` and `MiniMaxM1ForCausalLM` read under transformers' names by
`minimax_config`): lightning attention layers (`layer_types` linear_attention; the releases' `attn_type_list` 0) between
grouped-query attention layers, Mixtral's experts on every layer, and each sublayer joined to the stream DeepNorm's
way, stream x alpha + output x beta, the stream the sublayer's normed input (post-norm).

A lightning layer keeps no K/V: each running sequence carries a float32 matrix a head, [head_dim, head_dim]
(`LightningShape`; `kernels.lightning`), which the capacity plan counts per sequence beside the attention layers' KV.
MiniMax-Text-01's: 70 of its 80 layers, 64 heads of 128, 4 MiB a layer, 280 MiB a sequence. What we do not serve is
refused naming the key."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_float, read_int
from engine.deepseek_config import check_silu
from engine.lfm2_config import check_layer_kinds
from engine.mamba_config import state_bytes

__all__ = ["LightningShape", "minimax_config", "minimax_fields"]

# the releases' residual factors -> transformers' names
FACTORS = {"layernorm_full_attention_alpha": "full_attn_alpha_factor",
           "layernorm_full_attention_beta": "full_attn_beta_factor",
           "layernorm_linear_attention_alpha": "linear_attn_alpha_factor",
           "layernorm_linear_attention_beta": "linear_attn_beta_factor",
           "layernorm_mlp_alpha": "mlp_alpha_factor", "layernorm_mlp_beta": "mlp_beta_factor"}
# MiniMaxConfig's where config.json names none
DEFAULTS = {"vocab_size": 32_000, "hidden_size": 4096, "intermediate_size": 14_336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131_072,
            "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0, "bos_token_id": 1, "eos_token_id": 2}


@dataclass(frozen=True)
class LightningShape:
    """The lightning attention layers' shape, `num_heads` heads of `head_dim` for q, k and v alike (tensor
    parallelism splits the heads: `per_rank`), and the model's residual factors, (alpha, beta) of the full attention
    sublayers, of the lightning ones and of the MLPs (`scales`). A head's decay rate is fixed by its index and the
    layer's depth (`slopes`). Its state per sequence is one float32 matrix a head; it has no convolution
    (`conv_state_shape` empty)."""

    num_heads: int
    head_dim: int
    factors: tuple[float, float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    total_heads: int = 0   # the model's heads (0: num_heads), which the slopes run over

    def __post_init__(self) -> None:
        heads = self.total_heads or self.num_heads
        if heads & (heads - 1):
            raise ConfigError(f"num_attention_heads: lightning attention is served with a power of two heads (its "
                              f"slopes, 2 ** (-8 i / heads), agree with the releases' only there), got {heads}")

    def split_error(self, size: int) -> str | None:
        return None if self.num_heads % size == 0 else \
            f"{size} does not divide the model's {self.num_heads} lightning attention heads"

    def per_rank(self, size: int) -> LightningShape:
        return self if size == 1 else replace(self, num_heads=self.num_heads // size, total_heads=self.num_heads)

    def scales(self, sublayer: str) -> tuple[float, float]:
        """(alpha, beta) of a `full_attention`, `linear_attention` or `mlp` sublayer."""
        i = {"full_attention": 0, "linear_attention": 2, "mlp": 4}[sublayer]
        return self.factors[i], self.factors[i + 1]

    def slopes(self, layer: int, num_layers: int, rank: int = 0) -> list[float]:
        """This rank's heads' decay rates in layer `layer` of `num_layers` (transformers' `get_slope_rate`): head i's
        2 ** (-8 (i + 1) / heads), times 1 - layer / (num_layers - 1 + 1e-5) + 1e-5."""
        heads = self.total_heads or self.num_heads
        factor = 1 - layer / (num_layers - 1 + 1e-5) + 1e-5
        first = rank * self.num_heads
        return [(1 / 2 ** (8 / heads)) ** (i + 1) * factor for i in range(first, first + self.num_heads)]

    @property
    def width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return 0, 0

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return self.num_heads, self.head_dim, self.head_dim

    def num_params(self, hidden_size: int) -> int:
        """qkv_proj, output_gate, out_proj and the output norm."""
        return 5 * hidden_size * self.width + self.width

    def state_bytes(self, itemsize: int) -> int:
        return state_bytes(self, itemsize)


def minimax_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json under transformers' names, `MiniMaxConfig`'s defaults where it names none: the releases'
    `attn_type_list` (0 lightning, 1 full) as `layer_types`, their `layernorm_*_alpha` / `_beta` as the residual
    factors (`FACTORS`), `postnorm` (the stream the normed input, as transformers always runs it) checked."""
    cfg = DEFAULTS | {FACTORS.get(key, key): value for key, value in cfg.items() if value is not None}
    if not read_bool(cfg, "postnorm", True):
        raise ConfigError("postnorm: MiniMax is served post-norm (each sublayer's normed input its residual, as the "
                          "releases and transformers run it), got false")
    kinds = cfg.get("attn_type_list")
    if cfg.get("layer_types") is None and kinds is not None:
        if not isinstance(kinds, list) or any(k not in (0, 1) or isinstance(k, bool) for k in kinds):
            raise ConfigError(f"attn_type_list: 0 (lightning) or 1 (full attention) for each layer, got {kinds!r:.120}")
        cfg["layer_types"] = ["linear_attention" if k == 0 else "full_attention" for k in kinds]
    return cfg


def minimax_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The layer kinds (by default full and lightning in turn, full first), the lightning shape with the residual
    factors, Mixtral's experts on every layer (`num_local_experts` (8) of `intermediate_size`, 2 a token, the top k
    renormalised, in float32); the
    releases' `rotary_dim` (each full attention head's dimensions the rotary turns: half of MiniMax-Text-01's) as a
    partial rotary, every dimension where config.json names none, as transformers turns them."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if i % 2 == 0 else "linear_attention" for i in range(num_layers)]
    check_layer_kinds(kinds, num_layers, "linear_attention", "MiniMax")
    check_silu(cfg, "MiniMax")
    if cfg.get("sliding_window") is not None:
        raise ConfigError(f"sliding_window: MiniMax is served with full attention layers that see every key (the "
                          f"releases' null), got {cfg['sliding_window']!r}")
    if read_int(cfg, "shared_intermediate_size", 0, minimum=0):
        raise ConfigError(f"shared_intermediate_size: MiniMax is served without a shared expert (as transformers runs "
                          f"it), got {cfg['shared_intermediate_size']!r}")
    heads = read_int(cfg, "num_attention_heads")
    head_dim = read_int(cfg, "head_dim", None) or read_int(cfg, "hidden_size") // heads
    factors = tuple(read_float(cfg, f"{kind}_{part}_factor", 1.0, positive=False)
                    for kind in ("full_attn", "linear_attn", "mlp") for part in ("alpha", "beta"))
    rotary = read_int(cfg, "rotary_dim", None)
    return {"num_experts": read_int(cfg, "num_local_experts", 8), "num_experts_per_tok": read_int(cfg,
            "num_experts_per_tok", 2), "moe_intermediate_size": read_int(cfg, "intermediate_size"),
            "norm_topk_prob": True, "moe_float_weights": True, "layer_types": tuple(kinds),
            "state_layers": LightningShape(num_heads=heads, head_dim=head_dim, factors=factors),
            "partial_rotary_factor": 1.0 if rotary is None else rotary / head_dim}
