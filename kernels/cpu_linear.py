"""Prepacked oneDNN matmuls for the model's linear layers on a CPU device.

On the CPU, `F.linear` calls torch's default sgemm (MKL), which lays the weight out again on every
call; on the AMD EPYC development VM it also stays off the AVX-512 units. oneDNN's linear, given a
weight reordered once into its blocked layout (`mkldnn::_reorder_linear_weight`), reaches 2.3x its
rate there, and the engine's whole benchmark runs 2x faster with it (docs/PERF.md, same run). The
engine therefore packs every linear layer once, after the weights are loaded: `pack_linears(model)`
swaps each `nn.Linear` for a `PackedLinear` holding only the packed copy, and gives a model with tied
embeddings a packed LM head (the embedding table itself stays dense for the lookups).

A packed call costs about 20 us more than `F.linear` whatever its size (oneDNN's primitive dispatch), so a
small weight stays an `nn.Linear`: below `PACK_MIN_ELEMENTS` elements `F.linear` is faster at every batch
(2026-11-28, one thread: a 192 x 64 weight 4.8 vs 25.4 us at 1 row and 29.6 vs 58.9 us at 64 rows; a
1536 x 576 one 630 vs 432 us at 16 rows).

Results equal `F.linear` up to float32 rounding (summation order differs). The choice:
`CLIFFGUARD_CPU_LINEAR=onednn|torch` (default: onednn on a CPU device for float32, and for bfloat16
where oneDNN has bf16 support; torch everywhere else, CUDA included).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

CPU_LINEARS = ("onednn", "torch")

__all__ = ["CPU_LINEARS", "PACK_MIN_ELEMENTS", "PackedLinear", "pack_linears", "use_packed_linears"]

PACK_MIN_ELEMENTS = 1 << 16   # weights with fewer elements stay on F.linear (see above)


def use_packed_linears(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a model on `device` in `dtype` should run its linear layers through `PackedLinear`."""
    name = os.environ.get("CLIFFGUARD_CPU_LINEAR") or None
    if name is not None and name not in CPU_LINEARS:
        raise ValueError(f"CLIFFGUARD_CPU_LINEAR: unknown choice {name!r}; available: {', '.join(CPU_LINEARS)}")
    if name == "torch" or torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return dtype in (torch.float32, torch.bfloat16) and _packed_linear_works(dtype)


@functools.cache
def _packed_linear_works(dtype: torch.dtype) -> bool:
    """One tiny packed product against F.linear: a torch build whose oneDNN lacks these ops (or
    gets them wrong) on this CPU falls back to torch's linears instead of failing at load."""
    weight = torch.arange(12, dtype=torch.float32).view(3, 4).to(dtype)
    x = torch.ones(2, 4, dtype=dtype)
    try:
        out = PackedLinear(weight, None)(x)
    except (RuntimeError, NotImplementedError):
        return False
    return torch.equal(out, torch.nn.functional.linear(x, weight))


class PackedLinear(nn.Module):
    """`y = x W^T + b` with W held in oneDNN's packed layout (CPU only; read-only weights).

    weight: [out_features, in_features], bias: [out_features] or None; x: [..., in_features].
    The packed weight is an opaque oneDNN tensor, kept as a plain attribute (not a parameter or
    buffer), so `state_dict` and `.to()` do not see it: pack after loading, as the last step.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"PackedLinear needs a 2-d CPU weight, got {tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()
        with torch.no_grad():
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
            self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module, min_elements: int | None = None) -> int:
    """Swap every `nn.Linear` of `model` whose weight has at least `min_elements` elements (default
    `PACK_MIN_ELEMENTS`) for a `PackedLinear`; returns how many were swapped.

    A `LlamaForCausalLM` with tied embeddings (a table that large) also gets `model.lm_head`, a packed
    copy of the embedding table that `compute_logits` then uses. The dense weights of the swapped layers
    are freed.
    """
    min_elements = PACK_MIN_ELEMENTS if min_elements is None else min_elements
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.numel() >= min_elements:
                setattr(module, name, PackedLinear(child.weight, child.bias))
                swapped += 1
    config = getattr(model, "config", None)
    if (config is not None and getattr(config, "tie_word_embeddings", False)
            and model.embed_tokens.weight.numel() >= min_elements):
        model.lm_head = PackedLinear(model.embed_tokens.weight, None)
        swapped += 1
    if swapped and hasattr(model, "layers_changed"):
        model.layers_changed()
    return swapped
