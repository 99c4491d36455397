"""Liquid AI's LFM2 (`Lfm2ForCausalLM`; its config: `engine.lfm2_config`): a pre-norm stack whose token mixer is, a
layer at a time, grouped-query attention (q and k RMS-normed per head before the rotary: the Llama attention with
Qwen3's head norms) or a gated short convolution (`ShortConvMixer`), each followed by a SwiGLU MLP; the final norm
is the checkpoint's `embedding_norm`.

A short convolution: in_proj makes B, C and x (each hidden_size wide); B x x runs through a depthwise causal
convolution of `conv_L_cache` taps (no activation) from each sequence's last inputs (its state: `StateMixer`, the
states of `engine.models.hybrid.StatefulForCausalLM`); C times that; out_proj. Under tensor parallelism each rank
holds its share of the channels (B, C and x's rows of in_proj, the convolution's rows, out_proj's columns).

The checkpoint names its parts otherwise (`read_tensor`): `operator_norm` / `ffn_norm` are the layer's two norms,
`feed_forward.w1` / `w3` / `w2` the MLP's gate / up / down, `self_attn.out_proj` / `q_layernorm` / `k_layernorm` the
attention's o_proj and head norms, `conv.conv` the convolution.

LFM2-MoE (`Lfm2MoeForCausalLM`: LFM2-8B-A1B): past the first `num_dense_layers`, each MLP is Qwen3-MoE's experts
(`feed_forward.experts.N.w1` / `w3` / `w2`) under its own router (`Lfm2MoeBlock`: `feed_forward.gate`, and the
float32 `feed_forward.expert_bias` that picks but does not weigh).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn


from engine.layers.gated_delta_net import RecurrentStates, StateMixer
from engine.lfm2_config import ShortConvShape
from engine.model import DecoderLayer
from engine.model_config import ModelConfig
from engine.models.hybrid import MixerLayerForward, StatefulForCausalLM, cut_pieces
from engine.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock, with_experts
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata

__all__ = ["Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "ShortConvMixer"]

_RENAMES = (("feed_forward.experts.", "mlp.experts."), ("feed_forward.gate.", "mlp.gate."),
            ("feed_forward.expert_bias", "mlp.expert_bias.weight"), ("operator_norm", "input_layernorm"),
            ("ffn_norm", "post_attention_layernorm"),
            ("feed_forward.w1", "mlp.gate_proj"), ("feed_forward.w3", "mlp.up_proj"),
            ("feed_forward.w2", "mlp.down_proj"), ("self_attn.out_proj", "self_attn.o_proj"),
            ("self_attn.q_layernorm", "self_attn.q_norm"), ("self_attn.k_layernorm", "self_attn.k_norm"),
            ("conv.conv.", "conv.conv1d."))


class ShortConvMixer(StateMixer):
    """One gated short convolution, its checkpoint's names: in_proj (B, C, x), the causal convolution over B x x
    (`conv1d`, no SiLU), C times its output, out_proj (its partial outputs summed over the ranks)."""

    conv_silu = False

    def __init__(self, shape: ShortConvShape, hidden_size: int, layer: int, comm: Collectives | None = None) -> None:
        super().__init__()
        self.shape = shape                       # this rank's channels under tensor parallelism
        self.layer = layer                       # its index among the model's state layers (its state's)
        self.comm = comm or Collectives()
        self.in_proj = nn.Linear(hidden_size, 3 * shape.channels, bias=shape.bias)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(shape.channels, 1, shape.kernel))
        self.conv1d.bias = nn.Parameter(torch.empty(shape.channels)) if shape.bias else None
        self.out_proj = nn.Linear(shape.channels, hidden_size, bias=shape.bias)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata, states: RecurrentStates) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size], the step's tokens sequence after sequence -> [num_tokens, hidden_size]."""
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        conv = self.scan(b * x, (), meta, states)
        return self.comm.all_reduce(self.out_proj(c * conv.to(hidden.dtype)))

    def step(self, x, extras, ssm):   # the convolution is the whole layer: no recurrence after it
        return x, ssm

    def chunk(self, x, extras, ssm):
        return x, ssm

    scans_pieces = True   # a step's chunks through one convolution (`StateMixer.convolve_pieces`)

    def chunk_pieces(self, x, extras, ssm, pieces):
        return x, ssm.new_empty(pieces.num_parts, *ssm.shape[1:])   # no recurrence: its state is empty


class Lfm2Layer(MixerLayerForward, DecoderLayer):
    """LFM2's layer: the Llama layer whose token mixer is attention (`self_attn`) or a short convolution (`conv`)."""

    mixer = "conv"

    def __init__(self, config, shard, comm, rotary_emb, ops: ModuleType, layer: int, state_index: int) -> None:
        super().__init__(config, shard, comm, rotary_emb, ops, layer)
        if config.is_linear_layer(layer):
            del self.self_attn
            self.conv = ShortConvMixer(config.state_layers.per_rank(shard.size), config.hidden_size, state_index, comm)



class Lfm2ForCausalLM(StatefulForCausalLM):
    """LFM2: `Lfm2Layer`s over `StatefulForCausalLM`'s states, the checkpoint's names read as the Llama family's."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return Lfm2Layer(self.config, self.shard, self.comm, self.rotary_emb, ops, index,
                         self.state_index.get(index, -1))

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's names as the model's (the module docstring), then read as the base class reads them."""
        if name == "embedding_norm.weight":   # the final norm, whatever the checkpoint calls it
            name = "norm.weight"
        theirs, ours = next(((t, o) for t, o in _RENAMES if f".{t}" in name), ("", ""))
        if theirs:
            name = name.replace(f".{theirs}", f".{ours}", 1)
            if ours == "mlp.experts.":   # an expert's w1 / w3 / w2: its gate / up / down
                for part, our_part in ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")):
                    name = name.replace(part, our_part)
        return super().read_tensor(hf_name, name, tensor)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A convolution layer's part on this rank: its channels' rows of B, C and x in in_proj, of the convolution,
        its columns of out_proj (whose bias is added once, on rank 0); the rest as the Llama family's."""
        if self.shard.size == 1 or ".conv." not in name:
            return super()._shard_of(hf_name, name, tensor)
        h, rank = self.config.state_layers.channels, self.shard.rank
        if name.endswith("out_proj.bias"):
            return tensor if rank == 0 else torch.zeros_like(tensor)
        if ".out_proj." in name:
            return cut_pieces(hf_name, tensor, 1, [(h, 0, True)], rank, self.shard.size)
        pieces = [(h, o, True) for o in (0, h, 2 * h)] if ".in_proj." in name else [(h, 0, True)]
        return cut_pieces(hf_name, tensor, 0, pieces, rank, self.shard.size)


class ExpertBias(nn.Module):
    """LFM2-MoE's expert bias [num_experts], added to the router's scores to pick (not to weigh), in float32 whatever
    the model's dtype, as transformers holds it (`float32_parameters`: `engine.models.build_model`)."""

    float32_parameters = True

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts))


class Lfm2MoeBlock(SparseMoeBlock):
    """Qwen3-MoE's experts with LFM2-MoE's router (`moe_router` lfm2): sigmoid scores of the logits (the model's
    dtype; float32 where `float_logits`), the top k of the scores plus the expert bias, weighed by their scores
    renormalised past `eps` (where `norm_topk_prob`) times `routed_scaling_factor`, as transformers'
    `Lfm2MoeTopKRouter` (AFMoE's: `engine.models.afmoe.AfmoeMoeBlock`)."""

    float_logits, eps = False, 1e-6

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType) -> None:
        super().__init__(config, shard, comm, ops)
        self.expert_bias = ExpertBias(config.num_experts)
        self.routed_scaling_factor = config.routed_scaling_factor

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)                                                     # [num_tokens, num_experts]
        scores = (logits.float() if self.float_logits else logits).sigmoid()
        experts = torch.topk(scores + self.expert_bias.weight, k=self.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + self.eps)
        return weights * self.routed_scaling_factor, experts


class Lfm2MoeForCausalLM(Lfm2ForCausalLM, Qwen3MoeForCausalLM):
    """LFM2-MoE (LFM2-8B-A1B): LFM2's layers, each past the first `num_dense_layers` with `Lfm2MoeBlock` for its MLP;
    its experts' `feed_forward.experts.N.w1` / `w3` / `w2`, router `feed_forward.gate` and `feed_forward.expert_bias`
    read as Qwen3-MoE's."""

    moe_block = Lfm2MoeBlock

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return with_experts(self, super().make_layer(index, ops), index, ops)
