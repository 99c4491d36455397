"""The decoder layers on the CPU backend as one flat loop: four matmuls and six C calls a layer.

A decode step of a deep, narrow model on a CPU is nearly all host work, and most of it was the
module tree, not the arithmetic: each layer went through eleven `nn.Module` calls, a `split`, three
slices and the C kernels' per-call layout checks, ~110 us a layer before any arithmetic (32 layers:
3.5 ms of a step). `CpuForward` runs the same layers with what a layer needs and nothing else:

    norm (C) -> qkv matmul -> rotary (C) -> K/V store (C) -> decode attention (C) [-> prefill chunks]
    -> o matmul [-> all-reduce] -> add + norm (C) -> gate/up matmul -> SiLU x mul (C) -> down matmul
    [-> all-reduce]

into buffers allocated once per forward and reused by every layer (each layer's outputs are consumed
by the next op), with the layouts checked once per forward instead of once per call. The matmuls are
`torch.mm` / `torch.addmm` into those buffers (the same BLAS call `F.linear` makes, so the same
numbers), or the oneDNN packed call for the weights `kernels.cpu_linear.pack_linears` packed. The C
functions are `kernels.cpu_fused`'s and `kernels.cpu_attention`'s, with the same roundings; prefill
chunks in the step go through the backend's torch path as before.

`LlamaForCausalLM.forward` uses it where it applies (`CpuForward.build` says None elsewhere: another
backend, a dtype the C code lacks, no compiler) and rebuilds it when `pack_linears` swaps a layer.
tests/engine/test_cpu_forward.py holds it to the module path's outputs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels import AttentionMetadata

if TYPE_CHECKING:
    from engine.model import LlamaForCausalLM

__all__ = ["CpuForward"]

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]   # (x, out buffer) -> x W^T + b


def _linear(module: nn.Module) -> tuple[Linear, int]:
    """A layer's matmul as (x, out) -> result, and its output width. `nn.Linear`: into `out`, the call
    `F.linear` makes; a packed layer: oneDNN's call, which allocates its own result."""
    from kernels.cpu_linear import PackedLinear

    if isinstance(module, PackedLinear):
        packed, bias, op = module.packed_weight, module.bias, torch.ops.mkldnn._linear_pointwise
        return (lambda x, out: op(x, packed, bias, "none", [], "")), module.out_features
    weight_t, bias = module.weight.t(), module.bias
    if bias is None:
        return (lambda x, out: torch.mm(x, weight_t, out=out)), module.out_features
    return (lambda x, out: torch.addmm(bias, x, weight_t, out=out)), module.out_features


class _Layer:
    __slots__ = ("norm1", "eps1", "qkv", "o", "norm2", "eps2", "gate_up", "down")

    def __init__(self, layer: nn.Module) -> None:
        self.norm1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.eps
        self.norm2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
        self.qkv = _linear(layer.self_attn.qkv_proj)[0]
        self.o = _linear(layer.self_attn.o_proj)[0]
        self.gate_up = _linear(layer.mlp.gate_up_proj)[0]
        self.down = _linear(layer.mlp.down_proj)[0]


class CpuForward:
    """`LlamaForCausalLM.forward`'s layers for the CPU backend (see the module docstring). Build it with
    `build`; call it as the model's forward without the backend argument."""

    def __init__(self, model: LlamaForCausalLM, fused_lib: ctypes.CDLL, attention_lib: ctypes.CDLL) -> None:
        config, attn = model.config, model.layers[0].self_attn
        dtype = model.embed_tokens.weight.dtype
        suffix = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
        self.model, self.dtype = model, dtype
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        self.hidden_size, self.intermediate = config.hidden_size, model.layers[0].mlp.intermediate_size
        self.scale, self.window = attn.scale, config.sliding_window or 0
        self.rms_norm = getattr(fused_lib, f"rms_norm_{suffix}")
        self.rotary = getattr(fused_lib, f"rotary_{suffix}")
        self.silu_and_mul = getattr(fused_lib, f"silu_and_mul_{suffix}")
        self.store_kv = fused_lib.store_kv
        self.decode = getattr(attention_lib, f"paged_decode_{suffix}")
        self.all_reduce = model.comm.all_reduce if model.comm.size > 1 else None
        self.layers = [_Layer(layer) for layer in model.layers]
        self.final_norm, self.final_eps = model.norm.weight, model.norm.eps

    @classmethod
    def build(cls, model: LlamaForCausalLM, backend) -> CpuForward | None:
        """The flat forward for `model` on `backend`, or None where it does not apply: a backend other
        than `kernels.cpu_attention`, layers whose ops are not `kernels.cpu_fused` (another dtype), or C
        libraries that did not compile."""
        from kernels import cpu_attention, cpu_fused

        if backend is not cpu_attention or model.layers[0].input_layernorm.ops is not cpu_fused:
            return None
        if model.embed_tokens.weight.device.type != "cpu" or not cpu_fused.supports(model.embed_tokens.weight.dtype):
            return None
        fused_lib, attention_lib = cpu_fused.load_library(), cpu_attention.load_library()
        if fused_lib is None or attention_lib is None:
            return None
        return cls(model, fused_lib, attention_lib)

    def _check(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> None:
        """The layouts the C calls assume, once per forward (every layer's caches are alike)."""
        k_cache, v_cache = kv_caches[0]
        expect = (self.num_kv_heads, self.head_dim)
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if tuple(cache.shape[2:]) != expect or cache.dtype != self.dtype or not cache.is_contiguous():
                raise ValueError(f"{name}: [blocks, block_size, {expect[0]}, {expect[1]}] contiguous "
                                 f"{self.dtype} expected, got {tuple(cache.shape)} {cache.dtype}")
        for name in ("block_tables", "seq_lens"):
            tensor = getattr(meta, name)
            if tensor.dtype != torch.int32 or not tensor.is_contiguous() or tensor.device.type != "cpu":
                raise ValueError(f"meta.{name}: contiguous int32 on the CPU expected")
        slots = meta.slot_mapping
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            raise ValueError("meta.slot_mapping: contiguous int64 expected")

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        from kernels import cpu_attention
        from kernels.reference import prefill_attention

        model, dtype = self.model, self.dtype
        self._check(kv_caches, meta)
        num_tokens, hidden_size = int(input_ids.shape[0]), self.hidden_size
        nh, nkv, hd, q_size, kv_size = self.num_heads, self.num_kv_heads, self.head_dim, self.q_size, self.kv_size
        qkv_width = q_size + 2 * kv_size
        element = torch.empty((), dtype=dtype).element_size()

        residual = model.embed(input_ids).contiguous()            # the residual stream, updated in place
        normed = torch.empty(num_tokens, hidden_size, dtype=dtype)
        qkv_buf = torch.empty(num_tokens, qkv_width, dtype=dtype)
        attn_out = torch.empty(num_tokens, nh, hd, dtype=dtype)
        attn_flat = attn_out.view(num_tokens, q_size)
        o_buf = torch.empty(num_tokens, hidden_size, dtype=dtype)
        gate_up_buf = torch.empty(num_tokens, 2 * self.intermediate, dtype=dtype)
        act = torch.empty(num_tokens, self.intermediate, dtype=dtype)
        down_buf = torch.empty(num_tokens, hidden_size, dtype=dtype)
        cos_sin = model.rotary_emb.cos_sin_cache.index_select(0, positions)   # [num_tokens, head_dim]

        plan = cpu_attention._decode_plan(meta)
        has_prefill = any(q_len > 1 for q_len in meta.query_lens_list)
        block_tables, seq_lens, slots = meta.block_tables, meta.seq_lens, meta.slot_mapping
        k0 = kv_caches[0][0]
        block_size, num_slots = k0.shape[1], k0.shape[0] * k0.shape[1]
        # the step's constant arguments of each C call, after the per-layer pointers
        norm_tail = (num_tokens, hidden_size, hidden_size, hidden_size, hidden_size)
        rotary_tail = (num_tokens, nh + nkv, hd, qkv_width)
        store_tail = (num_tokens, num_slots, kv_size * element, qkv_width * element, qkv_width * element)
        if plan is not None:
            rows, seqs = plan
            decode_head = (block_tables.data_ptr(), seq_lens.data_ptr(), rows.data_ptr(), seqs.data_ptr(), len(rows),
                           qkv_width, nh, nkv, hd, block_size, block_tables.shape[1], self.scale, self.window)
        qkv_ptr, normed_ptr, out_ptr = qkv_buf.data_ptr(), normed.data_ptr(), attn_out.data_ptr()
        k_ptr, v_ptr = qkv_ptr + q_size * element, qkv_ptr + (q_size + kv_size) * element
        query = qkv_buf.view(num_tokens, qkv_width // hd, hd)[:, :nh] if has_prefill else None
        rms_norm, rotary, store_kv, decode, silu_and_mul = (self.rms_norm, self.rotary, self.store_kv, self.decode,
                                                            self.silu_and_mul)
        all_reduce, window = self.all_reduce, self.window or None

        layer_input = None   # the previous layer's output (down_proj's), added into the residual by the norm
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            if layer_input is None:   # the first layer normalises the embeddings, which start the residual
                rms_norm(residual.data_ptr(), None, layer.norm1.data_ptr(), normed_ptr, *norm_tail, layer.eps1)
            else:
                rms_norm(layer_input.data_ptr(), residual.data_ptr(), layer.norm1.data_ptr(), normed_ptr, *norm_tail,
                         layer.eps1)
            qkv = layer.qkv(normed, qkv_buf)
            if qkv is not qkv_buf:                        # a packed layer returns its own tensor
                qkv_buf.copy_(qkv)
            rotary(qkv_ptr, cos_sin.data_ptr(), *rotary_tail)
            if store_kv(k_ptr, v_ptr, k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), *store_tail):
                raise IndexError(f"store_kv: a slot past the cache's {num_slots} slots")
            if plan is not None and decode(qkv_ptr, k_cache.data_ptr(), v_cache.data_ptr(), out_ptr, *decode_head):
                raise MemoryError("cpu_attention: the kernel could not allocate its score buffer")
            if has_prefill:
                prefill_attention(query, k_cache, v_cache, meta, self.scale, window, attn_out)
            hidden = layer.o(attn_flat, o_buf)
            if all_reduce is not None:
                hidden = all_reduce(hidden)
            rms_norm(hidden.data_ptr(), residual.data_ptr(), layer.norm2.data_ptr(), normed_ptr, *norm_tail,
                     layer.eps2)
            gate_up = layer.gate_up(normed, gate_up_buf)
            silu_and_mul(gate_up.data_ptr(), act.data_ptr(), num_tokens, self.intermediate, gate_up.stride(0),
                         self.intermediate)
            layer_input = layer.down(act, down_buf)
            if all_reduce is not None:
                layer_input = all_reduce(layer_input)
        out = torch.empty(num_tokens, hidden_size, dtype=dtype)
        rms_norm(layer_input.data_ptr(), residual.data_ptr(), self.final_norm.data_ptr(), out.data_ptr(), *norm_tail,
                 self.final_eps)
        return out
