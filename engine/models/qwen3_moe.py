"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention, and on its sparse layers a mixture of experts.

A sparse layer's MLP (`SparseMoeBlock`) routes each token to `num_experts_per_tok` of `num_experts`
experts: the router's logits, their softmax in float32, the top k (renormalised to sum to 1 with
`norm_topk_prob`), rounded to the model's dtype; each expert is a SiLU-gated MLP of
`moe_intermediate_size`, and a token's output is the sum of its experts' outputs times their weights,
added in increasing expert order by the loop and the grouped matmuls (transformers' order, so on a CPU the
sums round alike; a CUDA `index_add_` adds a token's rows in no fixed order), and by the Triton kernels in
float32, each pair's product unrounded and the token's sum rounded once (in bfloat16 a near-tie may round
otherwise than transformers'). Which layers are sparse: every `decoder_sparse_step`-th, less
`mlp_only_layers` (those keep the dense MLP).

The experts run one of three ways, each giving transformers' greedy tokens on the tiny-model tests:
- with the Triton ops (CUDA, the Triton attention backend): `kernels.triton_moe.fused_moe`, two Triton
  grouped GEMMs over the (token, expert) pairs sorted by expert on the device; nothing is read back, so
  the model's decode steps are captured in CUDA graphs (`graph_safe`);
- elsewhere, grouped matmuls: the pairs sorted by expert, then `torch._grouped_mm` twice (one group an
  expert, the groups' ends computed on the device), so a step does work for the experts it uses only;
- where the grouped matmul lacks the dtype or layout (torch 2.13 builds it for float32 and bfloat16 on a
  CPU, bfloat16 on Hopper GPUs) the block falls back, for good, to a loop over the experts hit (transformers' way; that
  loop reads which experts are hit, a synchronisation on CUDA, so these two are not captured in graphs).

Weights: the checkpoint's per-expert `mlp.experts.{e}.gate_proj / up_proj / down_proj` go into two
tensors, `w13` [num_experts, 2 x intermediate, hidden] (gate rows, then up rows) and `w2` [num_experts,
hidden, intermediate]. Under tensor parallelism each rank holds every expert's slice of the
intermediate size (gate/up rows, down columns) and the partial outputs are summed; the router is whole
on every rank, so every rank routes alike. Held in FP8 (`hold_fp8`, the device's `quantization`), w13 and w2 are
e4m3 beside their block scales, filled expert by expert as a checkpoint stores them (`engine.fp8_weights`); held
packed (`hold_packed`: GPT-OSS's MXFP4, pack-quantized INT4 checkpoints'), two 4-bit codes a byte beside a scale a
group of inputs, each expert's rows (or, for down, packed inputs and scale groups) as stored, cut per rank.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable
from dataclasses import replace
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.int4_weights import dequantize_int4
from engine.layers import SiluAndMul
from engine.model import MLP, LlamaForCausalLM, WeightLoadError
from engine.model_config import ModelConfig
from engine.models.gemma3 import sliding_rotary
from engine.parallel import Collectives, ShardShape
from kernels.fp8_gemm import FP8_WEIGHT_DTYPE, dequantize_blocks, scale_grid
from kernels.mxfp4 import MXFP4_GROUP, dequantize_packed

log = logging.getLogger("cliffguard.engine")

__all__ = ["AriaTextForCausalLM", "MellumForCausalLM", "Qwen3MoeForCausalLM", "SparseMoeBlock"]

GROUPED_MM = getattr(torch, "_grouped_mm", None)   # torch's grouped matmul (group ends on the device), where built


class SparseMoeBlock(nn.Module):
    """The experts of one sparse layer and their router (see the module docstring)."""

    forward_runs_experts = False   # a subclass whose own forward runs the experts through `_experts` (LongCat-Flash's)

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType) -> None:
        super().__init__()
        self.comm, self.num_experts, self.top_k = comm, config.num_experts, config.num_experts_per_tok
        self.norm_topk_prob, self.float_weights = config.norm_topk_prob, config.moe_float_weights
        inter, hidden = shard.moe_intermediate_size, config.hidden_size
        self.gate = nn.Linear(hidden, config.num_experts, bias=config.moe_bias)   # the router
        self.w13 = nn.Parameter(torch.empty(config.num_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(config.num_experts, hidden, inter))
        self.act_fn = SiluAndMul(ops)
        self.fused_moe = _fused_moe_for(ops)   # the Triton kernels, with the Triton ops; else None
        # GPT-OSS (`moe_bias`): each expert's gate/up and down biases, added after each product (the down one on
        # one rank only: the ranks' partial outputs are summed)
        self.b13 = self.b2 = None
        if config.moe_bias:
            self.b13 = nn.Parameter(torch.empty(config.num_experts, 2 * inter))
            self.b2 = nn.Parameter(torch.empty(config.num_experts, hidden))
        # Qwen2-MoE: a shared expert every token takes (this rank's rows, its output not yet summed over the
        # ranks: the block sums once) and its gate, whole on every rank
        # (DeepSeek's shared experts: one MLP of their rows together, ungated)
        self.shared_expert = self.shared_expert_gate = None
        if shard.shared_expert_intermediate_size:
            self.shared_expert = MLP(config, replace(shard, intermediate_size=shard.shared_expert_intermediate_size),
                                     Collectives(), ops)
            if config.shared_expert_gated:
                self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self._grouped = True   # the grouped matmul until it fails for this dtype / device
        self.fp8_block: tuple[int, int] | None = None   # FP8 experts' scale blocks (`hold_fp8`)
        self.packed: str | None = None                  # "mxfp4", "int4" or "int8" experts (`hold_packed`)
        self.packed_group = 0                           # ... inputs a scale covers

    def hold_fp8(self, block: tuple[int, int]) -> None:
        """Hold the experts in FP8 (on the meta device, before the parameters are allocated): w13 and w2 in
        float8_e4m3fn beside float32 scales `w13_scale` [E, 2 x inter in blocks, hidden in blocks] and `w2_scale`,
        blocks of `block` (`kernels.fp8_gemm`; a side spanning its axis clamped to each matrix's). The Triton kernels
        dequantize each weight tile as loaded; the loop an expert's weights when it is hit (no grouped matmul)."""
        self.fp8_block, self._grouped = block, False
        for name in ("w13", "w2"):
            stacked = getattr(self, name)
            grid = scale_grid(tuple(stacked.shape[1:]), block)
            setattr(self, f"{name}_scale", nn.Parameter(torch.empty(stacked.shape[0], *grid), requires_grad=False))
        self.parameter_dtypes = {"w13": FP8_WEIGHT_DTYPE, "w2": FP8_WEIGHT_DTYPE, "w13_scale": torch.float32,
                                 "w2_scale": torch.float32}

    def hold_packed(self, kind: str, group: int = MXFP4_GROUP, zeros: bool = False) -> None:
        """Hold the experts packed as a checkpoint stores them (on the meta device, before the parameters are
        allocated): w13 [E, 2 x inter, hidden / 2] and w2 [E, hidden, inter / 2] uint8, two 4-bit codes a byte (INT8:
        [E, 2 x inter, hidden] and [E, hidden, inter], a code a byte), beside `w13_scales` [E, 2 x inter, hidden /
        group] and `w2_scales`: MXFP4's e2m1 codes and e8m0 scales (`kernels.mxfp4`, group 32) or INT4's (INT8's)
        values and scales in the model's dtype (`engine.int4_formats`; group 0: one a row), and where `zeros` their
        zero points
        `w13_zeros` and `w2_zeros` (uint8, as the scales: AWQ's). The Triton kernels decode each tile as loaded; the
        loop an expert's weights when it is hit (no grouped matmul)."""
        self.packed, self.packed_group, self._grouped = kind, group, False
        self.w13_zeros = self.w2_zeros = None
        for name in ("w13", "w2"):
            experts, rows, cols = getattr(self, name).shape
            width = cols if kind == "int8" else cols // 2
            setattr(self, name, nn.Parameter(torch.empty(experts, rows, width), requires_grad=False))
            for part in ("scales", "zeros") if zeros else ("scales",):
                setattr(self, f"{name}_{part}", nn.Parameter(torch.empty(experts, rows, cols // group if group else 1),
                                                             requires_grad=False))
        codes = ("w13", "w2", "w13_scales", "w2_scales") if kind == "mxfp4" else ("w13", "w2", "w13_zeros", "w2_zeros")
        self.parameter_dtypes = dict.fromkeys(codes, torch.uint8)

    def _expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's w13 and w2 in `dtype`, the model's (FP8 and packed ones dequantized)."""
        if self.packed == "mxfp4":
            return (dequantize_packed(self.w13[e], self.w13_scales[e], dtype),
                    dequantize_packed(self.w2[e], self.w2_scales[e], dtype))
        if self.packed:
            return tuple(dequantize_int4(getattr(self, name)[e], getattr(self, f"{name}_scales")[e], dtype,
                                         None if self.w13_zeros is None else getattr(self, f"{name}_zeros")[e],
                                         bits=8 if self.packed == "int8" else 4)
                         for name in ("w13", "w2"))
        if self.fp8_block is None:
            return self.w13[e], self.w2[e]
        return tuple(dequantize_blocks(getattr(self, name)[e], getattr(self, f"{name}_scale")[e], self.fp8_block)
                     .to(dtype) for name in ("w13", "w2"))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [num_tokens, hidden] -> (weights [num_tokens, top_k] in x's dtype, float32 for Mixtral,
        experts [num_tokens, top_k])."""
        logits = self.gate(x)                                                    # [num_tokens, num_experts]
        weights, experts = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float), self.top_k, dim=-1)
        weights = self.renormalised(weights)
        return (weights if self.float_weights else weights.to(logits.dtype)), experts

    def renormalised(self, weights: torch.Tensor) -> torch.Tensor:
        """The picks' weights [num_tokens, top_k] divided by their sum where `norm_topk_prob` (no epsilon)."""
        return weights / weights.sum(dim=-1, keepdim=True) if self.norm_topk_prob else weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden]. The collective once, at the end: a rank whose grouped matmul fell back to the
        # loop must not reduce twice.
        out = self._experts(x, *self.route(x))
        if self.shared_expert is not None:   # transformers' order: the routed sum plus the (gated) shared expert
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return self.comm.all_reduce(out)

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum (this rank's part): the Triton kernels, else the grouped matmuls, else
        the loop over the experts hit."""
        if self.fused_moe is not None and self.packed:
            return self.fused_moe(x, self.w13, self.w2, weights, experts, self.b13, self.b2, self.act_fn,
                                  self.w13_scales, self.w2_scales, (1, self.packed_group), self.packed,
                                  self.w13_zeros, self.w2_zeros)
        if self.fused_moe is not None and self.fp8_block is not None:
            return self.fused_moe(x, self.w13, self.w2, weights, experts, self.b13, self.b2, self.act_fn,
                                  self.w13_scale, self.w2_scale, self.fp8_block)
        if self.fused_moe is not None:
            return self.fused_moe(x, self.w13, self.w2, weights, experts, self.b13, self.b2, self.act_fn)
        if GROUPED_MM is not None and self._grouped:
            try:
                return self._grouped_forward(x, weights, experts)
            except torch.OutOfMemoryError:
                raise   # a step too large for the device now: not a reason to leave the grouped matmul
            except RuntimeError as exc:   # a dtype or layout the grouped matmul lacks here: the loop from now on
                log.warning("Qwen3-MoE experts: the grouped matmul failed on %s %s (%s); looping over the "
                            "experts from now on", x.device, x.dtype, (str(exc) or type(exc).__name__).splitlines()[0])
                self._grouped = False
        out = torch.zeros_like(x)
        hits = F.one_hot(experts, self.num_experts).permute(2, 1, 0)             # [num_experts, top_k, num_tokens]
        for e in hits.sum(dim=(1, 2)).nonzero().flatten().tolist():              # the experts used, in order
            slot, token = torch.where(hits[e])
            w13, w2 = self._expert_weights(e, x.dtype)
            h = _biased(F.linear(x[token], w13), self.b13, e)
            h = _biased(F.linear(self.act_fn(h), w2), self.b2, e)
            out.index_add_(0, token, (h * weights[token, slot, None]).to(x.dtype))
        return out

    def _grouped_forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The same sums without asking the device anything: the (token, expert) pairs sorted by expert, two
        grouped matmuls over them (`torch._grouped_mm`, one group an expert, the group ends on the device),
        and the weighted rows added back per token, in increasing expert order."""
        flat = experts.flatten()                                                 # [num_tokens * top_k]
        order = flat.argsort(stable=True)
        token = order // self.top_k
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        ends = counts.scatter_add_(0, flat.to(torch.int32).long(), torch.ones_like(flat, dtype=torch.int32)).cumsum(0)
        pair_expert = flat[order]
        h = GROUPED_MM(x[token], self.w13.transpose(1, 2), offs=ends.to(torch.int32))   # [pairs, 2 x inter]
        h = _biased(h, self.b13, pair_expert)
        h = GROUPED_MM(self.act_fn(h), self.w2.transpose(1, 2), offs=ends.to(torch.int32))   # [pairs, hidden]
        h = _biased(h, self.b2, pair_expert)
        out = torch.zeros_like(x)
        return out.index_add_(0, token, (h * weights.flatten()[order, None]).to(x.dtype))


def _biased(h: torch.Tensor, bias: torch.Tensor | None, expert: int | torch.Tensor) -> torch.Tensor:
    """h plus the rows of `bias` its experts own (`expert`: one index, or each row's), rounded as transformers'
    product-then-add is; h itself where the experts have no bias."""
    return h if bias is None else h + bias[expert]


def with_experts(model: Qwen3MoeForCausalLM, layer: nn.Module, index: int, ops: ModuleType) -> nn.Module:
    """`layer` (layer `index` of `model`) with its MLP the model's `moe_block` where the layer is sparse."""
    if model.config.is_sparse_layer(index):
        layer.mlp = model.moe_block(model.config, model.shard, model.comm, ops)
    return layer


def _fused_moe_for(ops: ModuleType) -> Callable[..., torch.Tensor] | None:
    """`kernels.triton_moe.fused_moe` where a layer's ops are the Triton ones (`kernels.fused.get_fused_ops`)."""
    if ops is not sys.modules.get("kernels.triton_fused"):
        return None
    from kernels.triton_moe import fused_moe

    return fused_moe


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3 with its sparse layers' MLPs replaced by `SparseMoeBlock`s; the Llama model's loading, with
    the experts' tensors routed into `w13` / `w2` and cut per rank."""

    supports_flat_forward = False
    moe_block: type[SparseMoeBlock] = SparseMoeBlock   # a sparse layer's MLP (GPT-OSS: its own subclass)

    @property
    def graph_safe(self) -> bool:
        """CUDA graphs capture it when every sparse layer runs the Triton kernels (the grouped matmul may
        fall back to the loop, which reads which experts are hit)."""
        return all(getattr(layer.mlp, "fused_moe", True) is not None for layer in self.layers)

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return with_experts(self, super().make_layer(index, ops), index, ops)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """A Qwen3-VL-MoE checkpoint's stacked experts (`ModelConfig.stacked_experts`: each layer's
        `mlp.experts.gate_up_proj` [experts, hidden, 2 x inter], gate then up, and `down_proj` [experts, inter,
        hidden], as its hub checkpoints store them; transposed, as transformers 5 saves its own) as each expert's;
        anything else as it is."""
        head, sep, stored = name.partition(".mlp.experts.")
        if not (self.config.stacked_experts and sep and stored in ("gate_up_proj", "down_proj")):
            return ((name, tensor),)
        hidden, inter = self.config.hidden_size, self.config.moe_intermediate_size
        ours = (2 * inter, hidden) if stored == "gate_up_proj" else (hidden, inter)   # transformers' own, [out, in]
        if tensor.dim() == 3 and tuple(tensor.shape[1:]) == ours and ours[0] != ours[1]:
            tensor = tensor.transpose(1, 2)   # as transformers 5 saves it: [in, out] as the hub's checkpoints store it
        return self.per_expert(hf_name, f"{head}.mlp.experts", stored, tensor, interleaved=False)

    def per_expert(self, hf_name: str, prefix: str, stored: str, tensor: torch.Tensor, interleaved: bool
                   ) -> Iterable[tuple[str, torch.Tensor]]:
        """A stacked expert tensor as each expert's, in the Qwen3-MoE names (`{prefix}.{e}.gate_proj.weight` ...):
        the gate/up columns (or bias entries) `interleaved`, gate first (GPT-OSS's), or in halves, gate first
        (Qwen3-VL-MoE's); weights transposed to [out, in]."""
        bias = stored.endswith("_bias")
        if tensor.dim() != (2 if bias else 3) or tensor.shape[0] != self.config.num_experts:
            raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} is not {self.config.num_experts} "
                                  f"experts' {'bias' if bias else 'weight'}")
        kind = "bias" if bias else "weight"
        for e, t in enumerate(tensor):
            if stored.startswith("down_proj"):
                yield f"{prefix}.{e}.down_proj.{kind}", t if bias else t.t()
            else:
                half = t.shape[-1] // 2
                gate, up = (t[..., 0::2], t[..., 1::2]) if interleaved else (t[..., :half], t[..., half:])
                yield f"{prefix}.{e}.gate_proj.{kind}", gate if bias else gate.t()
                yield f"{prefix}.{e}.up_proj.{kind}", up if bias else up.t()

    def _destination(self, name: str, hf_name: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
        head, _, kind = name.rpartition(".")
        if kind in ("blocks", "scales", "zeros") and ".mlp.experts." in name:   # packed rows into w13 / w2, scales
            target, part = self._destination(f"{head}.weight", hf_name)        # (and zero points) beside
            return (target if kind == "blocks" else f"{target}_{kind}"), part
        if ".mlp.shared_expert." in name:   # Qwen2-MoE's: gate and up into its fused rows, as a dense MLP's
            head, _, proj = name.partition(".mlp.shared_expert.")
            size = self.shard.shared_expert_intermediate_size
            if proj in ("gate_proj.weight", "up_proj.weight"):
                offset = 0 if proj.startswith("gate") else size
                return f"{head}.mlp.shared_expert.gate_up_proj.weight", lambda data: data.narrow(0, offset, size)
            return name, lambda data: data
        if ".mlp.experts." not in name:
            return super()._destination(name, hf_name)
        prefix, rest = name.split(".mlp.experts.", 1)                 # "layers.3", "17.gate_proj.weight"
        expert, _, proj = rest.partition(".")   # a fused checkpoint's "gate_up_proj": no expert index, refused
        inter = self.shard.moe_intermediate_size
        weight, _, kind = proj.partition(".")
        if not expert.isdigit() or weight not in ("gate_proj", "up_proj", "down_proj") \
                or kind not in (("weight", "bias") if self.config.moe_bias else ("weight",)):
            raise WeightLoadError(f"{hf_name}: not a tensor of {self.config.architecture} with this config")
        if int(expert) >= self.config.num_experts:
            raise WeightLoadError(f"{hf_name}: expert {int(expert)} of a config with num_experts "
                                  f"{self.config.num_experts}")
        e, mlp = int(expert), f"{prefix}.mlp"
        if weight == "down_proj":   # GPT-OSS's biases: b13 [experts, 2 x inter] and b2 [experts, hidden]
            return (f"{mlp}.w2" if kind == "weight" else f"{mlp}.b2"), lambda data: data[e]
        offset = 0 if weight == "gate_proj" else inter
        return (f"{mlp}.w13" if kind == "weight" else f"{mlp}.b13"), lambda data: data[e].narrow(0, offset, inter)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """An expert's slice of the intermediate size: gate/up rows (and biases), down columns, the down bias on
        rank 0 alone (added once, after the ranks' sum); the rest as Qwen3's."""
        shard = self.shard
        if shard.size > 1 and ".mlp.shared_expert." in name:   # its rows cut as a dense MLP's
            dim, full = (1 if "down_proj" in name else 0), self.config.shared_expert_intermediate_size
            if tensor.dim() != 2 or tensor.shape[dim] != full:
                raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the config "
                                      f"({full} along dimension {dim})")
            size = shard.shared_expert_intermediate_size
            return tensor.narrow(dim, shard.rank * size, size)
        if shard.size == 1 or ".mlp.experts." not in name:
            return super()._shard_of(hf_name, name, tensor)
        if name.endswith((".blocks", ".scales", ".zeros")):   # an expert's packed rows, or groups of inputs
            return self._packed_shard(hf_name, name, tensor)
        if name.endswith("down_proj.bias"):
            return tensor if shard.rank == 0 else torch.zeros_like(tensor)
        dim, inter = (1 if name.endswith("down_proj.weight") else 0), self.config.moe_intermediate_size
        if tensor.dim() != (1 if name.endswith(".bias") else 2) or tensor.shape[dim] != inter:
            raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the config "
                                  f"({inter} along dimension {dim})")
        return tensor.narrow(dim, shard.rank * shard.moe_intermediate_size, shard.moe_intermediate_size)

    def _packed_shard(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's share of an expert's packed gate/up rows, or of its down rows' packed inputs (two a byte or
        one, a group a scale): the intermediate size cut as the float weights' (on a group's edge: `held_packed`)."""
        size, rank, inter = self.shard.moe_intermediate_size, self.shard.rank, self.config.moe_intermediate_size
        group = MXFP4_GROUP if self.config.mxfp4_experts else self.config.int4_group
        down = ".down_proj." in name
        per = 1 if not down else (8 // self.config.int4_bits if name.endswith(".blocks") else group)
        if not per:   # down's scale a row (group 0): every rank holds it whole
            return tensor
        dim, full = (1, inter // per) if down else (0, inter)
        if tensor.dim() != 2 or tensor.shape[dim] != full:
            raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the config ({full} along "
                                  f"dimension {dim})")
        return tensor.narrow(dim, rank * size // per, size // per)


class MellumForCausalLM(Qwen3MoeForCausalLM):
    """JetBrains' Mellum: Qwen3-MoE's model whose sliding layers turn by their own rope base (`sliding_rotary`: the
    first sliding layer makes it), its multi-token-prediction layer (`mtp.`) not read."""

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = super().make_layer(index, ops)
        layer.self_attn.rotary_emb = sliding_rotary(self, index, ops)
        return layer

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return () if name.startswith("mtp.") else super().read_tensor(hf_name, name, tensor)


# Aria's checkpoints' names -> Qwen3-MoE's
_ARIA_NAMES = ((".mlp.router.", ".mlp.gate."), (".mlp.shared_experts.", ".mlp.shared_expert."),
               (".mlp.experts.fc1.weight", ".mlp.experts.gate_up_proj"),
               (".mlp.experts.fc2.weight", ".mlp.experts.down_proj"))


class AriaTextForCausalLM(Qwen3MoeForCausalLM):
    """Rhymes' Aria text model (`AriaTextForCausalLM`; its config: `engine.aria_config`): Qwen3-MoE's model without
    q/k norms, experts on every layer beside ungated shared experts; its checkpoints' `mlp.router` read as the
    router, `mlp.shared_experts` as the shared expert, its stacked experts (`mlp.experts.fc1` [experts, hidden, 2 x
    inter], gate then up, and `fc2` [experts, inter, hidden]; transformers' `gate_up_proj` / `down_proj` alike) as
    each expert's."""

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        for theirs, ours in _ARIA_NAMES:
            name = name.replace(theirs, ours)
        return super().read_tensor(hf_name, name, tensor)
