"""Meta's Muse Glimmer text model (`MuseGlimmerForConditionalGeneration`'s, served as `MuseGlimmerForCausalLM`; its
config: `engine.muse_config`), transformers' `MuseGlimmerTextModel` operator for operator where it rounds:

- Gemma 2's layer (`Gemma3DecoderLayer`): Gemma's norms (1 + weight, float32) around both sublayers, the two on the
  sublayers' outputs with their own epsilon (`post_norm_eps`, 1e-8);
- AFMoE's attention (`GatedAttention`, `gate_proj` read as its gate rows: `GateProjRows`): the output gated per
  channel by a sigmoid of its own projection of the layer's input; q and k normed per head by one RMSNorm without a
  weight (Gemma 4's: float32 statistics, rounded to the heads' dtype), q then times `qk_scale_factor` in that dtype;
  q.k scaled by head_dim ** -0.5; sliding layers beside full ones, the NoPE layers (`layer_rope_theta` 0) turning
  nothing, the others by the model's one rope;
- the embeddings normed without a weight; the final norm Gemma 4's (x times its weight); the logits times
  `output_multiplier` (`logit_scale`), then soft-capped: cap x tanh(logits / cap).

Muse Spark (`MuseSparkForCausalLM`, `MuseSparkLayer`) is that model with each head's attention output normed without a
weight before the gate; the norm on the attention's output weightless, the MLP's output scaled by 1 + weight, rounded,
then normed (`InputScaledNorm`); each sublayer joined to the stream by a float32 gate (`ResidualGate`: no residual
travels beside the stream, each layer returns the stream whole); the Gemma norms' 1 + weight rounded to the weight's
dtype before the float32 product (`SparkNorm`, as transformers' `MuseSparkTextCenteredRMSNorm`). Its sparse layers
(`MuseSparkMoeBlock`) run the experts over `moe_latent_size`: the layer's input projected in and normed, each expert's
output through an `InputScaledNorm` shared by the experts (after the ranks' sum of its partial output, one collective
a layer over the step's (token, expert) rows) before it is weighed, the weighted sum projected out.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import FloatRMSNorm, GemmaRMSNorm, RopeRows
from engine.model import MLP, LlamaForCausalLM
from engine.model_config import ModelConfig
from engine.models.afmoe import GateProjRows
from engine.models.gemma3 import Gemma3DecoderLayer
from engine.models.gemma4 import pow_rms
from engine.models.lfm2 import Lfm2MoeBlock
from engine.models.qwen3_5 import GatedAttention
from engine.models.qwen3_moe import GROUPED_MM, Qwen3MoeForCausalLM
from engine.models.smollm3 import layer_rotary
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata

log = logging.getLogger("cliffguard.engine")

__all__ = ["InputScaledNorm", "MuseGlimmerForCausalLM", "MuseSparkForCausalLM", "MuseSparkMoeBlock", "ResidualGate",
           "UnitHeadNorm"]


class UnitHeadNorm(nn.Module):
    """Each head of a [num_tokens, num_heads, head_dim] view normed without a weight (`pow_rms`), then times
    `factor` in its dtype (Muse Glimmer's q: `qk_scale_factor`), written back in place."""

    def __init__(self, eps: float, factor: float = 1.0) -> None:
        super().__init__()
        self.eps, self.factor = eps, factor

    def forward(self, heads: torch.Tensor) -> None:
        normed = pow_rms(heads, self.eps)
        heads.copy_(normed * self.factor if self.factor != 1.0 else normed)

    def extra_repr(self) -> str:
        return f"eps={self.eps}, factor={self.factor}"


class UnitNorm(nn.Module):
    """x normed over its last dimension without a weight (`pow_rms`): Muse Spark's norm of the attention's output."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return pow_rms(x, self.eps)


class SparkNorm(GemmaRMSNorm):
    """Gemma's norm with 1 + weight rounded to the weight's dtype before the float32 product (transformers'
    `MuseSparkTextCenteredRMSNorm`)."""

    @staticmethod
    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight).float()).type_as(x)


class InputScaledNorm(GemmaRMSNorm):
    """x times 1 + weight (float32, rounded to x's dtype), then normed without a weight in float32 (transformers'
    `MuseSparkTextInputScaledRMSNorm`: Muse Spark's norm of the MLP's and each expert's output)."""

    @staticmethod
    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        scaled = (x.float() * (1.0 + weight).float()).to(x.dtype).float()
        return (scaled * torch.rsqrt(scaled.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class ResidualGate(nn.Module):
    """Muse Spark's join of a sublayer's output to the stream: w = gate / temperature, beta = sigmoid(w), alpha =
    sqrt(max(sigmoid(-w)(1 + beta), 1e-3)); alpha x stream + beta x output, in float32 (the gate held so:
    `float32_parameters`), rounded to the stream's dtype."""

    float32_parameters = True

    def __init__(self, hidden_size: int, temperature: float) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(hidden_size))
        self.temperature = temperature

    def forward(self, stream: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        w = self.gate / self.temperature
        beta = torch.sigmoid(w)
        alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=1e-3))
        return (alpha * stream + beta * out).to(stream.dtype)


def muse_attention(model: LlamaForCausalLM, index: int, rotary: nn.Module) -> GatedAttention:
    """Layer `index`'s attention: gated per channel, q and k normed per head without a weight, q then scaled."""
    c = model.config
    attn = GatedAttention(c, model.shard, model.comm, rotary, index)
    attn.q_norm, attn.k_norm = UnitHeadNorm(c.rms_norm_eps, c.muse[0]), UnitHeadNorm(c.rms_norm_eps)
    return attn


class MuseGlimmerForCausalLM(GateProjRows, LlamaForCausalLM):
    """Muse Glimmer's text model (see the module docstring): the Llama model's loading, cuts and head."""

    supports_flat_forward = False
    norm_init = 0.0

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        c, rotary = self.config, layer_rotary(self, index)
        layer = Gemma3DecoderLayer(c, self.shard, self.comm, rotary, ops, index)
        layer.self_attn = muse_attention(self, index, rotary)
        layer.post_attention_layernorm = GemmaRMSNorm(c.hidden_size, c.muse[1])
        layer.post_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, c.muse[1])
        return layer

    def make_norm(self, ops: ModuleType) -> nn.Module:
        return FloatRMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return pow_rms(super().embed(input_ids), self.config.rms_norm_eps)

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """The Llama model's, Gemma's norms at 0 (1 + weight), the final norm at 1 (x times its weight)."""
        super().init_random(seed, std)
        with torch.no_grad():
            self.norm.weight.fill_(1.0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits times `output_multiplier`, then soft-capped (the other order of the Llama model's)."""
        logits = self.head_logits(hidden) * self.config.logit_scale
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class MuseSparkLayer(nn.Module):
    """One Muse Spark layer (the module docstring): its sublayers joined to the stream by gates, so the stream
    travels alone (the layer's input and output; the residual None)."""

    def __init__(self, model: LlamaForCausalLM, index: int, mlp: nn.Module) -> None:
        super().__init__()
        c, rotary = model.config, layer_rotary(model, index)
        h, eps, (_, post_eps, temperature) = c.hidden_size, c.rms_norm_eps, c.muse
        self.input_layernorm = SparkNorm(h, eps)
        self.self_attn = muse_attention(model, index, rotary)
        self.self_attn.out_norm = UnitNorm(eps)
        self.post_attention_layernorm = UnitNorm(post_eps)
        self.post_attention_residual_gate = ResidualGate(h, temperature)
        self.pre_feedforward_layernorm = SparkNorm(h, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = InputScaledNorm(h, post_eps)
        self.post_feedforward_residual_gate = ResidualGate(h, temperature)

    def forward(self, hidden: torch.Tensor, residual: None, rope_rows: RopeRows,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, backend
                ) -> tuple[torch.Tensor, None]:
        """hidden: the stream [num_tokens, hidden_size] (the embeddings for the first layer) -> (the stream, None)."""
        out = self.self_attn(self.input_layernorm(hidden), rope_rows, kv_cache, meta, backend)
        hidden = self.post_attention_residual_gate(hidden, self.post_attention_layernorm(out))
        out = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))
        return self.post_feedforward_residual_gate(hidden, out), None


class StreamNorm(FloatRMSNorm):
    """Gemma 4's final norm over the stream the layers return whole (their residual None): (normed, the stream), the
    pair the Llama model's forward reads."""

    def forward(self, x: torch.Tensor, residual: None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.norm(x, self.weight, self.eps), x


class MuseSparkMoeBlock(Lfm2MoeBlock):
    """A Muse Spark sparse layer's experts (the module docstring): Qwen3-MoE's experts over `moe_latent_size`, AFMoE's
    router on float32 logits times `output_multiplier` over the hidden size. The experts' (token, expert) rows are
    made one expert a row at weight 1 by the Triton kernels with the Triton ops (nothing read back: decode graphs
    capture the layer), else by the grouped matmul (else a loop over the experts hit); then summed over the ranks,
    normed, weighed and added in increasing expert order (transformers' order)."""

    float_logits, eps = True, 1e-15

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType) -> None:
        h, width, post_eps = config.hidden_size, config.moe_latent_size, config.muse[1]
        super().__init__(replace(config, hidden_size=width), shard, comm, ops)
        self.gate = nn.Linear(h, config.num_experts, bias=False)
        self.gate.float32_parameters = True   # as transformers holds the router
        self.output_multiplier = config.logit_scale
        self.pre_expert_proj = nn.Linear(h, width, bias=False)
        self.pre_expert_norm = SparkNorm(width, config.rms_norm_eps)
        self.post_expert_norm = InputScaledNorm(width, post_eps)
        self.post_expert_proj = nn.Linear(width, h, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.gate.weight.float()) * self.output_multiplier
        scores = logits.sigmoid()
        experts = torch.topk(scores + self.expert_bias.weight, k=self.top_k, dim=-1, sorted=False)[1]   # as theirs
        weights = scores.gather(1, experts)
        return weights / (weights.sum(dim=-1, keepdim=True) + self.eps) * self.routed_scaling_factor, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        inner = self.pre_expert_norm(self.pre_expert_proj(x))
        flat = experts.flatten()
        order = flat.argsort(stable=True)   # the (token, expert) rows by expert
        token = order // self.top_k
        rows = self.post_expert_norm(self.comm.all_reduce(self._rows(inner[token], flat[order])))
        out = torch.zeros_like(inner).index_add_(0, token, (rows * weights.flatten()[order, None]).to(inner.dtype))
        return self.post_expert_proj(out)

    def _rows(self, x: torch.Tensor, pair_expert: torch.Tensor) -> torch.Tensor:
        """Each row of x [pairs, width] (sorted by expert) through its expert: this rank's part of its output."""
        if self.fused_moe is not None:   # a row one expert, at weight 1: its output as the kernels round it
            return self._experts(x, torch.ones(len(x), 1, device=x.device), pair_expert[:, None])
        if GROUPED_MM is not None and self._grouped:
            ones = torch.ones_like(pair_expert, dtype=torch.int32)
            ends = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device).scatter_add_(
                0, pair_expert, ones).cumsum(0).to(torch.int32)   # on the device: nothing read back
            try:
                h = GROUPED_MM(x, self.w13.transpose(1, 2), offs=ends)
                return GROUPED_MM(self.act_fn(h), self.w2.transpose(1, 2), offs=ends)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as exc:   # a dtype or layout the grouped matmul lacks here: the loop from now on
                log.warning("Muse Spark experts: the grouped matmul failed on %s %s (%s); looping over the experts "
                            "from now on", x.device, x.dtype, (str(exc) or type(exc).__name__).splitlines()[0])
                self._grouped = False
        out = x.new_empty(x.shape[0], self.w2.shape[1])
        for e in pair_expert.unique().tolist():
            at = (pair_expert == e).nonzero().flatten()
            w13, w2 = self._expert_weights(e, x.dtype)
            out[at] = F.linear(self.act_fn(F.linear(x[at], w13)), w2)
        return out


# Muse Spark's checkpoint names -> the model's
_SPARK_RENAMES = ((".mlp.gate.e_score_correction_bias", ".mlp.expert_bias.weight"),
                  (".mlp.experts.post_expert_norm.", ".mlp.post_expert_norm."))


class MuseSparkForCausalLM(MuseGlimmerForCausalLM, Qwen3MoeForCausalLM):
    """Muse Spark's text model (the module docstring): Glimmer's embeddings, attention and head, Qwen3-MoE's reading of
    the experts (each rank its slice of their intermediate size)."""

    moe_block = MuseSparkMoeBlock

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        c = self.config
        mlp = self.moe_block(c, self.shard, self.comm, ops) if c.is_sparse_layer(index) else \
            MLP(c, self.shard, self.comm, ops)
        return MuseSparkLayer(self, index, mlp)

    def make_norm(self, ops: ModuleType) -> nn.Module:
        return StreamNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's names as the model's (`_SPARK_RENAMES`); each layer's stacked experts ([experts, out,
        in], as transformers saves them) as each expert's; the rest as Qwen3-MoE reads it."""
        for theirs, ours in _SPARK_RENAMES:
            name = name.replace(theirs, ours)
        head, sep, stored = name.partition(".mlp.experts.")
        if sep and stored in ("gate_up_proj", "down_proj"):
            return self.per_expert(hf_name, f"{head}.mlp.experts", stored, tensor.transpose(1, 2), interleaved=False)
        return super().read_tensor(hf_name, name, tensor)
