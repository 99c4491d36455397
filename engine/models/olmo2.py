"""OLMo 2 (`Olmo2ForCausalLM`): the Llama layer turned post-norm, and q/k normed over the whole projection; OLMo 3
(`Olmo3ForCausalLM`) the same layers, sliding and full, each type its own rope (Gemma 3's `sliding_rotary`); EXAONE 4
(`Exaone4ForCausalLM`) the post-norm layer with Llama's norms and Qwen3's q/k norms per head, its full layers NoPE
where it has sliding ones (`Exaone4DecoderLayer`); OLMoE (`OlmoeForCausalLM`) the Llama layer with Qwen3-MoE's
experts and OLMo 2's whole-projection q/k norms in Llama's order, clamped where `clip_qkv` (`OlmoeAttention`);
FlexOlmo (`FlexOlmoForCausalLM`) OLMo 2's layers with those experts in place of every MLP.

- no norm before a sublayer: each sublayer's output is normed (`post_attention_layernorm`,
  `post_feedforward_layernorm`) and then added to the residual stream; the model's final norm as Llama's.
  The stream travels as in the Llama layer, (a sublayer's output, the stream before its add), so the last add
  is fused into the final norm;
- `q_norm` and `k_norm` are RMSNorms over all of a token's query (key) heads at once, [heads x head_dim], not
  per head, before rotary. Under tensor parallelism a rank holds its heads' slice of each weight and the sum of
  squares is summed over the ranks (a KV head held by several ranks counted once);
- every norm is transformers' `Olmo2RMSNorm` (`engine.layers.FloatRMSNorm`): float32 throughout, times the
  weight, one rounding at the end.

It runs on the module path (the CPU's flat loop is the Llama layer's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType

import torch
from torch import nn

from engine.layers import FloatRMSNorm, RMSNorm, RopeRows
from engine.layers.gated_delta_net import GatedDeltaNet
from engine.model import MLP, Attention, LlamaForCausalLM, WeightLoadError
from engine.model_config import ModelConfig
from engine.models.gemma3 import sliding_rotary
from engine.models.hybrid import StatefulForCausalLM, cut_pieces
from engine.models.qwen3_moe import Qwen3MoeForCausalLM, with_experts
from engine.models.smollm3 import layer_rotary
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata, fused

__all__ = ["Exaone4ForCausalLM", "FlexOlmoForCausalLM", "Olmo2Attention", "Olmo2ForCausalLM", "Olmo3ForCausalLM",
           "OlmoHybridForCausalLM", "OlmoHybridLinearLayer", "OlmoeAttention", "OlmoeForCausalLM", "RoundedWideRMSNorm",
           "wide_norm_shard"]


class WideRMSNorm(nn.Module):
    """An RMSNorm over the whole width of `heads` heads ([T, heads, d] as [T, heads x d]), written back in place;
    this rank holds `heads` of the model's `num_heads` (`replicas` ranks hold each of them): the sum of squares is
    summed over the ranks and divided by the replicas, so the mean is the whole projection's. OLMo 2's: the weight
    times the float32 row, one rounding (`weight_first` False: MiniMax-M2's, the row rounded, then the weight)."""

    weight_first = True

    def __init__(self, heads: int, head_dim: int, eps: float, comm: Collectives, num_heads: int,
                 replicas: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads * head_dim))
        self.eps, self.comm, self.width, self.replicas = eps, comm, num_heads * head_dim, replicas

    def forward(self, heads: torch.Tensor) -> None:
        x = heads.reshape(heads.shape[0], -1)   # a view: a token's heads lie side by side in the fused qkv
        if self.comm.size == 1 and self.weight_first:
            heads.copy_(FloatRMSNorm.norm(x, self.weight, self.eps).view_as(heads))
            return
        xf = x.float()
        squares = self.comm.all_reduce(xf.pow(2).sum(-1, keepdim=True)) / self.replicas
        normed = xf * torch.rsqrt(squares / self.width + self.eps)
        out = (self.weight * normed).to(x.dtype) if self.weight_first else self.weight * normed.to(x.dtype)
        heads.copy_(out.view_as(heads))


class RoundedWideRMSNorm(WideRMSNorm):
    """MiniMax-M2's whole-projection q/k norm: transformers' Llama-order RMSNorm (the row rounded, then the weight)."""

    weight_first = False


class Olmo2Attention(Attention):
    """Llama's attention with the whole-projection q/k norms (`wide_norm`: their class)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb, layer: int,
                 wide_norm: type[WideRMSNorm] = WideRMSNorm) -> None:
        super().__init__(config, shard, comm, rotary_emb, layer)
        d, eps = config.head_dim, config.rms_norm_eps
        kv_replicas = max(1, shard.size // config.num_kv_heads)   # ranks holding each KV head
        self.q_norm = wide_norm(shard.num_heads, d, eps, comm, config.num_heads, 1)
        self.k_norm = wide_norm(shard.num_kv_heads, d, eps, comm, config.num_kv_heads, kv_replicas)


class OlmoeAttention(Olmo2Attention):
    """OLMoE's attention: the whole-projection q/k norms in Llama's order (`RoundedWideRMSNorm`), then, where the
    config says `clip_qkv`, q, k and v clamped to +-clip_qkv before the rotary (transformers' order)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb, layer: int) -> None:
        super().__init__(config, shard, comm, rotary_emb, layer, RoundedWideRMSNorm)

    def norm_qk(self, qkv: torch.Tensor) -> None:
        super().norm_qk(qkv)
        if self.config.clip_qkv is not None:
            qkv.clamp_(-self.config.clip_qkv, self.config.clip_qkv)


class Olmo2DecoderLayer(nn.Module):
    """One post-norm OLMo 2 block (see the module docstring)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb, ops: ModuleType,
                 layer: int) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, shard, comm, rotary_emb, layer)
        self.post_attention_layernorm = FloatRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, shard, comm, ops)
        self.post_feedforward_layernorm = FloatRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope_rows: RopeRows,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, backend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the previous layer's MLP output (the embeddings for the first, residual None), residual the
        stream before its add -> (this layer's MLP output, the stream before its add)."""
        if residual is not None:
            hidden = residual.add_(hidden)
        hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, rope_rows, kv_cache, meta, backend))
        return self.post_feedforward_layernorm(self.mlp(hidden)), hidden


class Olmo2ForCausalLM(LlamaForCausalLM):
    """The Llama model with OLMo 2's layers and norms; q_norm / k_norm weights cut per rank by heads."""

    supports_flat_forward = False

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return Olmo2DecoderLayer(self.config, self.shard, self.comm, self.rotary_emb, ops, index)

    def make_norm(self, ops: ModuleType) -> nn.Module:
        return FloatRMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A rank's heads of the q/k norms' weights; the rest as the Llama model's."""
        if self.shard.size == 1 or not name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            return super()._shard_of(hf_name, name, tensor)
        return wide_norm_shard(self.config, self.shard, hf_name, name, tensor)


def wide_norm_shard(c: ModelConfig, shard: ShardShape, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's heads of a whole-projection q or k norm's weight [heads x head_dim] (OLMo 2's, MiniMax-M2's)."""
    d = c.head_dim
    full, start, length = (c.num_heads * d, shard.head_start * d, shard.num_heads * d) if ".q_norm." in name \
        else (c.num_kv_heads * d, shard.kv_head_start * d, shard.num_kv_heads * d)
    if tensor.shape != (full,):
        raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the config ({full},)")
    return tensor.narrow(0, start, length)


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3: OLMo 2's model, its sliding layers (`layer_types`) turned by their own rope (`sliding_rotary`)."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return Olmo2DecoderLayer(self.config, self.shard, self.comm, sliding_rotary(self, index, ops), ops, index)


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    """OLMo 2's post-norm block with transformers' `Exaone4RMSNorm` (Llama's order) on each sublayer's output and
    the Llama attention's q/k norms per head (`ModelConfig.qk_norm`)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb, ops: ModuleType,
                 layer: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = Attention(config, shard, comm, rotary_emb, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = MLP(config, shard, comm, ops)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class Exaone4ForCausalLM(LlamaForCausalLM):
    """EXAONE 4: the Llama model with `Exaone4DecoderLayer`s, each turned by the model's rotary or, on a full layer
    beside sliding ones, none (`no_rope_layers`: SmolLM3's `NoRope`)."""

    supports_flat_forward = False

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return Exaone4DecoderLayer(self.config, self.shard, self.comm, layer_rotary(self, index), ops, index)


class OlmoeForCausalLM(Qwen3MoeForCausalLM):
    """OLMoE: Qwen3-MoE's experts on every layer (the softmax's top 8 of 64, not renormalised by default) under the
    Llama layer, with `OlmoeAttention`; its q/k norms' weights cut per rank as OLMo 2's."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = super().make_layer(index, ops)
        layer.self_attn = OlmoeAttention(self.config, self.shard, self.comm, self.rotary_emb, index)
        return layer

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.shard.size > 1 and name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            return wide_norm_shard(self.config, self.shard, hf_name, name, tensor)
        return super()._shard_of(hf_name, name, tensor)


class FlexOlmoForCausalLM(OlmoeForCausalLM):
    """AI2's FlexOlmo (FlexOlmo-7x7B-1T): OLMo 2's post-norm layers and whole-projection q/k norms (`Olmo2DecoderLayer`)
    with Qwen3-MoE's experts in place of every MLP (the softmax's top 5 of 7, renormalised where `norm_topk_prob`)."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = Olmo2DecoderLayer(self.config, self.shard, self.comm, self.rotary_emb, ops, index)
        return with_experts(self, layer, index, ops)

    def make_norm(self, ops: ModuleType) -> nn.Module:
        return FloatRMSNorm(self.config.hidden_size, self.config.rms_norm_eps)


class OlmoHybridLinearLayer(nn.Module):
    """OLMo Hybrid's pre-norm Gated DeltaNet block (its attention blocks are OLMo 2's post-norm ones), its residual
    stream beside the hidden states as `Olmo2DecoderLayer`'s."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType,
                 state_index: int) -> None:
        super().__init__()
        self.input_layernorm = FloatRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.linear_attn = GatedDeltaNet(config.gated_delta.per_rank(shard.size), config.hidden_size,
                                         config.rms_norm_eps, state_index, comm)
        self.post_attention_layernorm = FloatRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, shard, comm, ops)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope_rows: None, states, meta, backend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden, residual = self.post_attention_layernorm(self.linear_attn(hidden, meta, states), residual)
        return self.mlp(hidden), residual


class OlmoHybridForCausalLM(StatefulForCausalLM):
    """OLMo Hybrid: OLMo 2's post-norm attention blocks (NoPE where the config names no rope) between pre-norm Gated
    DeltaNet blocks whose q, k, v, gate (`g_proj`), b and a projections are stored apart, read into one in_proj; its
    gated norm `o_norm`, its output `o_proj`. Tensor parallelism cuts a linear block as Qwen3.5's: each rank its key
    heads' q and k, their value heads' v, gate, b, a and decay parameters and o_proj columns."""

    def __init__(self, config: ModelConfig, shard: ShardShape | None = None, comm: Collectives | None = None,
                 ops: ModuleType = fused) -> None:
        super().__init__(config, shard, comm, ops)
        self._conv_pending: dict[str, dict[str, torch.Tensor]] = {}   # a layer's q/k/v convolutions as they come

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        if self.config.is_linear_layer(index):
            return OlmoHybridLinearLayer(self.config, self.shard, self.comm, ops, self.state_index[index])
        return Olmo2DecoderLayer(self.config, self.shard, self.comm, layer_rotary(self, index), ops, index)

    def make_norm(self, ops: ModuleType) -> nn.Module:
        return FloatRMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's names of a linear block's norms (`attention_layer_norm`, `feedforward_layer_norm`),
        output and gated norm as the model's."""
        for theirs, ours in ((".attention_layer_norm.", ".input_layernorm."),
                             (".feedforward_layer_norm.", ".post_attention_layernorm."),
                             (".linear_attn.o_proj.", ".linear_attn.out_proj."),
                             (".linear_attn.o_norm.", ".linear_attn.norm.")):
            name = name.replace(theirs, ours)
        head, sep, part = name.partition(".linear_attn.")
        if sep and part in ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"):
            return self._conv_part(head, part[0], tensor)
        return ((name, tensor),)

    def _conv_part(self, head: str, which: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """q's, k's and v's convolutions, held until the three have come, then read as conv1d's channels in that
        order (whatever each one's rows: transformers saves its own concatenation cut in three equal parts)."""
        parts = self._conv_pending.setdefault(head, {})
        parts[which] = tensor
        if len(parts) < 3:
            return ()
        del self._conv_pending[head]
        return ((f"{head}.linear_attn.conv1d.weight", torch.cat([parts["q"], parts["k"], parts["v"]])),)

    def _destination(self, name: str, hf_name: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
        """q, k, v, g, b and a into in_proj's rows (this rank's)."""
        s = self.config.gated_delta.per_rank(self.shard.size)
        qkv = {"q": (0, s.key_dim), "k": (s.key_dim, s.key_dim), "v": (2 * s.key_dim, s.value_dim)}
        rows = {f"{x}_proj": span for x, span in qkv.items()} | {
            "g_proj": (s.conv_dim, s.value_dim), "b_proj": (s.conv_dim + s.value_dim, s.num_v_heads),
            "a_proj": (s.conv_dim + s.value_dim + s.num_v_heads, s.num_v_heads)}
        for part, (offset, size) in rows.items():
            if f".linear_attn.{part}." in name:
                return name.replace(part, "in_proj"), lambda data, o=offset, n=size: data.narrow(0, o, n)
        return super()._destination(name, hf_name)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a linear block: its key heads' q and k rows (and convolution channels), its value
        heads' v, g, b and a rows, decay parameters and o_proj columns (the gated norm whole); the rest as OLMo 2's
        (its q/k norms' weights a rank's heads)."""
        if self.shard.size > 1 and name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            return wide_norm_shard(self.config, self.shard, hf_name, name, tensor)
        if self.shard.size == 1 or ".linear_attn." not in name or name.endswith("norm.weight"):
            return super()._shard_of(hf_name, name, tensor)
        s = self.config.gated_delta
        keys, values, heads = [(s.key_dim, 0, True)], [(s.value_dim, 0, True)], [(s.num_v_heads, 0, True)]
        qkv = [(s.key_dim, 0, True), (s.key_dim, s.key_dim, True), (s.value_dim, 2 * s.key_dim, True)]
        parts = {"q_proj": (0, keys), "k_proj": (0, keys), "v_proj": (0, values), "g_proj": (0, values),
                 "b_proj": (0, heads), "a_proj": (0, heads), "conv1d": (0, qkv), "dt_bias": (0, heads),
                 "A_log": (0, heads), "out_proj": (1, values)}
        part = parts.get(name.split(".linear_attn.")[1].split(".")[0])
        if part is None:
            raise WeightLoadError(f"{hf_name}: not a tensor of {self.config.architecture} with this config")
        return cut_pieces(hf_name, tensor, *part, self.shard.rank, self.shard.size)
