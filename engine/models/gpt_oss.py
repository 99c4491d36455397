"""GPT-OSS (`GptOssForCausalLM`): Llama's attention with biases and a sink logit per head, and on every layer a
mixture of experts.

- attention: q/k/v/o carry biases; each query head's learned sink (`self_attn.sinks`) joins its softmax's
  denominator and weighs no value (`Attention.sinks`, applied by every backend's kernels), so a row may give its
  keys less than all of its weight; sliding (a window of 128) and full layers alternate (`layer_types`), one rope
  for both (YaRN by default);
- norms: float32 statistics and weight, one rounding (`FloatRMSNorm`, transformers' `GptOssRMSNorm`);
- experts: Qwen3-MoE's `SparseMoeBlock` (the Triton grouped GEMMs with the Triton ops, their biases added in
  the kernels and the activation launched between them, so decode steps are captured in CUDA graphs; elsewhere
  the grouped matmuls or the loop over the experts hit) with GPT-OSS's router (a bias; the top k of the logits,
  then their softmax in the model's dtype), each expert's biases, and its SwiGLU clamped at `swiglu_limit`
  (`ClampedSwiGLU`).

Weights: the router `mlp.router` is the block's `gate`; the experts come stacked, `mlp.experts.gate_up_proj`
[experts, hidden, 2 x intermediate] with gate and up columns interleaved (gate, up, gate, ...), `down_proj`
[experts, intermediate, hidden], and their biases: read as each expert's gate/up/down tensors
(`read_tensor`), which the Qwen3-MoE loading places and cuts per rank. OpenAI's checkpoints store the experts'
weights in MXFP4 (`gate_up_proj_blocks` / `_scales`: 4-bit e2m1 values two to a byte, the low nibble first, and
one power-of-two scale, e8m0, per 32 along the input dimension, in [out, in] orientation: `kernels.mxfp4`). Where
the model holds them so (`SparseMoeBlock.hold_packed`, the device's `quantization`: `engine.models.held_packed`) each
expert's rows go in as stored, the gate/up rows de-interleaved and each rank's rows or groups of 32 inputs cut;
elsewhere they are dequantized to the model's dtype as they are read (`dequantize_mxfp4`), exactly (every such value
is a bfloat16). The capacity plan counts what is held.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.layers import ClampedSwiGLU, FloatRMSNorm
from engine.model import WeightLoadError
from engine.model_config import ModelConfig
from engine.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock
from engine.parallel import Collectives, ShardShape
from kernels import fused
from kernels.mxfp4 import check_mxfp4, dequantize_mxfp4

__all__ = ["GptOssForCausalLM", "GptOssMoeBlock"]

_STACKED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


class GptOssMoeBlock(SparseMoeBlock):
    """`SparseMoeBlock` with GPT-OSS's routing and clamped SwiGLU (its biases come with `moe_bias`)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType) -> None:
        super().__init__(config, shard, comm, ops)
        self.act_fn = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top k of the router's logits and their softmax, in x's dtype (transformers' `GptOssTopKRouter`)."""
        top, experts = torch.topk(self.gate(x), self.top_k, dim=-1)
        return F.softmax(top, dim=-1, dtype=top.dtype), experts


class GptOssForCausalLM(Qwen3MoeForCausalLM):
    """GPT-OSS (see the module docstring): Qwen3-MoE's model and loading, with float32 norms, sinks, GPT-OSS's
    experts and its checkpoints' stacked (or MXFP4) expert tensors."""

    moe_block = GptOssMoeBlock
    norm_class = FloatRMSNorm

    def __init__(self, config: ModelConfig, shard: ShardShape | None = None, comm: Collectives | None = None,
                 ops: ModuleType = fused) -> None:
        super().__init__(config, shard, comm, ops)
        self._mxfp4: dict[str, dict[str, torch.Tensor]] = {}   # a stacked tensor's blocks or scales, until both came

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """`mlp.router.*` read as the block's `mlp.gate.*`; a stacked expert tensor as each expert's (its MXFP4
        blocks and scales once both are read, dequantized); anything else as it is."""
        if ".mlp.router." in name:
            return ((name.replace(".mlp.router.", ".mlp.gate.", 1), tensor),)
        head, sep, stored = name.partition(".mlp.experts.")
        if not sep or "." in stored:
            return ((name, tensor),)
        if stored.endswith(("_blocks", "_scales")):
            base, _, part = stored.rpartition("_")
            key = hf_name.rpartition("_")[0]   # the stored tensor's name, as an error names it
            pending = self._mxfp4.setdefault(key, {})
            pending[part] = tensor
            if len(pending) < 2:
                return ()
            del self._mxfp4[key]
            try:
                if base in ("gate_up_proj", "down_proj") and self.layers[0].mlp.packed == "mxfp4":
                    return self._packed_per_expert(hf_name, f"{head}.mlp.experts", base, pending["blocks"],
                                                   pending["scales"])
                tensor = dequantize_mxfp4(pending["blocks"], pending["scales"]).transpose(1, 2)
            except ValueError as exc:
                raise WeightLoadError(f"{hf_name}: {exc}") from None
            stored = base
        if stored not in _STACKED:
            raise WeightLoadError(f"{hf_name}: not a tensor of {self.config.architecture} with this config")
        return self.per_expert(hf_name, f"{head}.mlp.experts", stored, tensor, interleaved=True)

    def _packed_per_expert(self, hf_name: str, prefix: str, stored: str, blocks: torch.Tensor, scales: torch.Tensor
                           ) -> list[tuple[str, torch.Tensor]]:
        """MXFP4 blocks [experts, rows, groups, 16] and scales [experts, rows, groups] kept as stored, as each
        expert's packed rows and their scales (`{prefix}.{e}.gate_proj.blocks`, `....scales`): gate/up rows
        interleaved, gate first."""
        check_mxfp4(blocks, scales)
        if blocks.dim() != 4 or blocks.shape[0] != self.config.num_experts:
            raise ValueError(f"shape {tuple(blocks.shape)} is not {self.config.num_experts} experts' MXFP4 blocks")
        out = []
        for e in range(blocks.shape[0]):
            for kind, t in (("blocks", blocks[e].flatten(-2)), ("scales", scales[e])):
                if stored == "down_proj":
                    out.append((f"{prefix}.{e}.down_proj.{kind}", t))
                else:
                    out += [(f"{prefix}.{e}.gate_proj.{kind}", t[0::2]), (f"{prefix}.{e}.up_proj.{kind}", t[1::2])]
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The Llama model's loading; an MXFP4 tensor whose blocks or scales never came is named."""
        self._mxfp4.clear()
        super().load_weights(self._pairs_checked(weights))

    def _pairs_checked(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        yield from weights
        if self._mxfp4:   # before the loading's own check, which would name the parameter left unfilled
            name, parts = next(iter(self._mxfp4.items()))
            alone = next(iter(parts))
            raise WeightLoadError(f"checkpoint is missing weights: {name}_{'scales' if alone == 'blocks' else 'blocks'}"
                                  f" (MXFP4: its {alone} came alone)")
