"""How the Llama family's loading reads a quantized checkpoint's tensors before it places them (`CheckpointReading`,
a base of `engine.model.LlamaForCausalLM`): an FP8 checkpoint's weights beside their scales (`engine.fp8_weights`),
an INT4 one's packed words, scales and shapes (`engine.int4_weights`), each read as the model holds it: kept as
stored where a layer holds that format, else dequantized to the model's dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.fp8_weights import dequantized, fp8_part
from engine.int4_formats import Int4Scheme, int4_tensors
from engine.layers.fp8_linear import Fp8Linear
from engine.weights import model_tensor_name

__all__ = ["CheckpointReading", "WeightLoadError"]


class WeightLoadError(ValueError):
    """A checkpoint is missing tensors the model needs, or has them in the wrong shape."""


class CheckpointReading:
    """The reading of quantized checkpoints, for a model with `config`, `fp8_layers`, `fp8_exact`, `fp8_scales`,
    `packed_params` (the parameters held packed as stored: MXFP4 or INT4 experts), `read_tensor` and
    `_destination` (`engine.model.LlamaForCausalLM`)."""

    def _fill_fp8(self, layer: Fp8Linear, dest: torch.Tensor, tensor: torch.Tensor, hf_name: str, cut,
                  stored: tuple[int, int]) -> int:
        """This rank's cut of stored weight `hf_name` into its rows (`dest`) of FP8 projection `layer`, with the
        scales its FP8 checkpoint stored beside it (else quantized a row at a time); the scales filled."""
        row = dest.storage_offset() // layer.in_features
        try:
            values, scale = fp8_part(tensor, self.fp8_scales.pop(hf_name, None), self.config.fp8_weight_block,
                                     stored, cut, layer.block, row)
            layer.fill(row, values, scale)
        except ValueError as exc:
            raise WeightLoadError(f"{hf_name}: {exc}") from None
        return scale.numel()

    def _read_tensors(self, weights: Iterable[tuple[str, torch.Tensor]],
                      prefix: str) -> Iterator[tuple[str, str, torch.Tensor]]:
        """The checkpoint's tensors as (stored name, name read, tensor), the text model's alone (`prefix`); an FP8
        checkpoint's weights dequantized once their scales are read too (`dequantized`), an INT4 one's once its
        three tensors are (`int4_tensors`), unless the model holds them as stored."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        keep = self._keeps_fp8 if self.fp8_exact else None
        if self.config.int4_group is not None:
            weights = int4_tensors(weights, Int4Scheme.of(self.config), self._keeps_packed,
                                   torch.float32)   # rounded once, as copied
        try:
            for hf_name, tensor in weights:
                if self.config.fp8_weight_block is not None:
                    hf_name, tensor = dequantized(hf_name, tensor, pending, self.config.fp8_weight_block,
                                                  self.config.fp8_scale_suffix, keep, self.fp8_scales)
                    if tensor is None:
                        continue
                name = model_tensor_name(hf_name, prefix, self.config.bare_text_weights)
                if name is not None:   # else the vision tower, the projector
                    yield from ((hf_name, *read) for read in self.read_tensor(hf_name, name, tensor))
        except WeightLoadError:
            raise
        except ValueError as exc:
            raise WeightLoadError(str(exc)) from None
        if pending:   # an FP8 weight without its scales, or scales without their weight
            key, pair = next(iter(pending.items()))
            have = next(iter(pair))
            missing = ".weight" if have != ".weight" else self.config.fp8_scale_suffix
            raise WeightLoadError(f"{key}{missing}: missing beside {key}{have} (an FP8 weight needs its scales)")

    def _destinations(self, hf_weight: str, shape: torch.Size) -> list[str] | None:
        """The parameters this family's reading puts stored weight `hf_weight` of `shape` into (read from a meta
        tensor: the names it gives), None where it reads it as nothing or refuses it."""
        name = model_tensor_name(hf_weight, self.config.text_weights_prefix, self.config.bare_text_weights)
        if name is None:
            return None
        try:
            read = [n for n, _ in self.read_tensor(hf_weight, name, torch.empty(shape, device="meta"))]
            return [self._destination(n, hf_weight)[0] for n in read] or None
        except (ValueError, RuntimeError, NotImplementedError):   # a name or shape it refuses: refused as read
            return None

    def _fill_order(self, hf_name: str, name: str, tensor: torch.Tensor, params: dict[str, torch.Tensor],
                    orders: dict[str, str]) -> str:
        """An INT4 layer's input order (`X.perm`: GPTQ's activation order, `engine.int4_formats`) into its `perm`,
        whole: the parts of a fused layer (q, k and v; gate and up) share their input, so their orders must agree
        (`orders`: each parameter set -> the tensor that set it). Returns the parameter's name."""
        target = self._destination(name, hf_name)[0]
        if target not in params or tuple(params[target].shape) != tuple(tensor.shape):
            raise WeightLoadError(f"{hf_name}: not a tensor of {self.config.architecture} with this config")
        dest = params[target].data
        if target in orders and not torch.equal(dest, tensor.to(dest.dtype)):   # named by the tensors that say it
            raise WeightLoadError(f"{hf_name.removesuffix('.perm')}.g_idx: its inputs' groups are not in the order of "
                                  f"{orders[target].removesuffix('.perm')}.g_idx's, whose layer it is fused with in "
                                  f"{target.removesuffix('.perm')}")
        dest.copy_(tensor)
        orders.setdefault(target, hf_name)
        return target

    def _keeps_fp8(self, hf_weight: str, weight: torch.Tensor) -> bool:
        """Whether stored FP8 weight `hf_weight` goes into FP8 projections as stored (its scales with it): every tensor
        this family reads from it goes into one."""
        targets = self._destinations(hf_weight, weight.shape)
        return targets is not None and all(t in self.fp8_layers for t in targets)

    def _keeps_packed(self, hf_weight: str, shape: torch.Size) -> bool:
        """Whether stored INT4 weight `hf_weight` (of the float `shape`) goes into experts held packed, as stored."""
        targets = self._destinations(hf_weight, shape)
        return targets is not None and all(t in self.packed_params for t in targets)
