"""The decoder layers on the CPU backend as one flat loop: four matmuls and six C calls a layer.

A decode step of a deep, narrow model on a CPU is nearly all host work, and most of it was the
module tree, not the arithmetic: each layer went through eleven `nn.Module` calls, a `split`, three
slices and the C kernels' per-call layout checks, ~110 us a layer before any arithmetic (32 layers:
3.5 ms of a step). `CpuForward` runs the same layers with what a layer needs and nothing else:

    norm (C) -> qkv matmul [-> q/k head norms (Qwen3)] -> rotary (C; not on SmolLM3's NoPE layers) -> K/V
    store (C) -> decode attention (C) [-> prefill chunks]
    -> o matmul [-> all-reduce] [x Granite's residual multiplier] -> add + norm (C) -> gate/up matmul
    -> SiLU x mul (C) -> down matmul [-> all-reduce] [x the multiplier]

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
from types import SimpleNamespace

import torch
from torch import nn

from kernels import AttentionMetadata

__all__ = ["CpuForward"]

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]   # (x, out buffer) -> x W^T + b


def _linear(module: nn.Module) -> Linear:
    """A layer's matmul as (x, out) -> result. `nn.Linear`: into `out`, the call `F.linear` makes; a packed
    layer: oneDNN's call, which allocates its own result; an FP8 one (`Fp8Linear`): its own call, alike."""
    from kernels.cpu_linear import PackedLinear

    if not isinstance(module, (nn.Linear, PackedLinear)):
        return lambda x, out: module(x)
    if isinstance(module, PackedLinear):
        packed, bias, op = module.packed_weight, module.bias, torch.ops.mkldnn._linear_pointwise
        return lambda x, out: op(x, packed, bias, "none", [], "")
    weight_t, bias = module.weight.t(), module.bias
    if bias is None:
        return lambda x, out: torch.mm(x, weight_t, out=out)
    return lambda x, out: torch.addmm(bias, x, weight_t, out=out)


class _Layer:
    __slots__ = ("norm1", "eps1", "qkv", "q_norm", "k_norm", "rope", "window", "o", "norm2", "eps2", "gate_up",
                 "down")

    def __init__(self, layer: nn.Module) -> None:
        self.norm1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.eps
        self.q_norm, self.k_norm = layer.self_attn.q_norm, layer.self_attn.k_norm   # Qwen3's, else None
        self.rope = hasattr(layer.self_attn.rotary_emb, "cos_sin_cache")   # SmolLM3's NoPE layers rotate nothing
        self.window = layer.self_attn.sliding_window or 0   # its own: Qwen's lower layers attend to all
        self.norm2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
        self.qkv = _linear(layer.self_attn.qkv_proj)
        self.o = _linear(layer.self_attn.o_proj)
        self.gate_up = _linear(layer.mlp.gate_up_proj)
        self.down = _linear(layer.mlp.down_proj)


class CpuForward:
    """`LlamaForCausalLM.forward`'s layers for the CPU backend (see the module docstring). Build it with
    `build`; call it as the model's forward without the backend argument."""

    def __init__(self, model: nn.Module, fused_lib: ctypes.CDLL, attention_lib: ctypes.CDLL) -> None:
        config, attn = model.config, model.layers[0].self_attn
        dtype = model.embed_tokens.weight.dtype
        suffix = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
        self.model, self.dtype = model, dtype
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        self.hidden_size, self.intermediate = config.hidden_size, model.layers[0].mlp.intermediate_size
        self.scale = attn.scale
        self.residual_multiplier = config.residual_multiplier   # Granite's: each sublayer's output times it
        self.rms_norm = getattr(fused_lib, f"rms_norm_{suffix}")
        self.rotary = getattr(fused_lib, f"rotary_{suffix}")
        self.silu_and_mul = getattr(fused_lib, f"silu_and_mul_{suffix}")
        self.store_kv = fused_lib.store_kv
        self.decode = getattr(attention_lib, f"paged_decode_{suffix}")
        self.all_reduce = model.comm.all_reduce if model.comm.size > 1 else None
        self.layers = [_Layer(layer) for layer in model.layers]
        self.final_norm, self.final_eps = model.norm.weight, model.norm.eps

    @classmethod
    def build(cls, model: nn.Module, backend) -> CpuForward | None:
        """The flat forward for `model` on `backend`, or None where it does not apply: a backend other
        than `kernels.cpu_attention`, a model whose layers are not the Llama layer (Gemma 3's) or whose MLP
        is not SiLU-gated (the loop runs silu_and_mul: a gelu_pytorch_tanh Llama runs the modules), layers
        whose ops are not `kernels.cpu_fused` (another dtype), or C libraries that did not compile
        (`get_fused_ops` gives a model `cpu_fused` only for a dtype it runs)."""
        from kernels import cpu_attention, cpu_fused

        if not model.supports_flat_forward or backend is not cpu_attention or model.config.hidden_act != "silu" \
                or model.layers[0].input_layernorm.ops is not cpu_fused:
            return None
        chunked = any(layer.self_attn.chunk for layer in model.layers)
        if model.embed_tokens.weight.device.type != "cpu" or chunked:
            return None   # chunked layers (Llama 4's): the modules' attention takes their chunk
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

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor,
              kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> SimpleNamespace:
        """One forward's buffers (every layer reuses them) and each C call's arguments that do not change
        from layer to layer."""
        self._check(kv_caches, meta)
        dtype, n, hidden = self.dtype, int(input_ids.shape[0]), self.hidden_size
        q_size, kv_size, hd = self.q_size, self.kv_size, self.head_dim
        width = q_size + 2 * kv_size
        element = torch.empty((), dtype=dtype).element_size()
        step = SimpleNamespace(
            num_tokens=n, residual=self.model.embed(input_ids).contiguous(),   # updated in place
            normed=torch.empty(n, hidden, dtype=dtype), qkv=torch.empty(n, width, dtype=dtype),
            attn_out=torch.empty(n, self.num_heads, hd, dtype=dtype), o=torch.empty(n, hidden, dtype=dtype),
            gate_up=torch.empty(n, 2 * self.intermediate, dtype=dtype),
            act=torch.empty(n, self.intermediate, dtype=dtype), down=torch.empty(n, hidden, dtype=dtype),
            cos_sin=self.model.rotary_emb.cos_sin_cache.index_select(0, positions))   # [n, head_dim]
        step.attn_flat = step.attn_out.view(n, q_size)
        step.heads = step.qkv.view(n, width // hd, hd)
        step.qkv_ptr = step.qkv.data_ptr()
        step.k_ptr, step.v_ptr = step.qkv_ptr + q_size * element, step.qkv_ptr + (q_size + kv_size) * element
        step.query = step.qkv.view(n, width // hd, hd)[:, :self.num_heads] \
            if any(q_len > 1 for q_len in meta.query_lens_list) else None      # prefill chunks: torch's path
        step.norm_tail = (n, hidden, hidden, hidden, hidden)
        step.rotary_tail = (n, self.num_heads + self.num_kv_heads, hd, width)
        step.paged = self._reads(meta, kv_caches[0][0], width, element)
        ring = next((cache for layer, cache in zip(self.layers, kv_caches) if layer.window), None)
        step.ring = self._reads(meta.ring, ring[0], width, element) \
            if meta.ring is not None and ring is not None else step.paged   # window-bounded (engine.sliding_kv)
        return step

    def _reads(self, meta: AttentionMetadata, k_cache: torch.Tensor, width: int, element: int) -> SimpleNamespace:
        """What a layer's store and decode read of `meta` over caches shaped as `k_cache` (qkv rows of `width`
        elements of `element` bytes): the slots, the store's arguments past the pointers, the decode call's head
        (None: no decode tokens), the metadata itself."""
        from kernels import cpu_attention

        num_slots = k_cache.shape[0] * k_cache.shape[1]
        reads = SimpleNamespace(meta=meta, slots_ptr=meta.slot_mapping.data_ptr(), num_slots=num_slots,
                                store_tail=(meta.num_tokens, num_slots, self.kv_size * element, width * element,
                                            width * element), decode_head=None)
        plan = cpu_attention.decode_plan(meta)
        if plan is not None:
            rows, seqs = plan
            tables = meta.block_tables
            reads.decode_head = (tables.data_ptr(), meta.seq_lens.data_ptr(), rows.data_ptr(), seqs.data_ptr(),
                                 len(rows), width, self.num_heads, self.num_kv_heads,
                                 self.head_dim, k_cache.shape[1], tables.shape[1], self.scale)
        return reads

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        from kernels.reference import prefill_attention

        step = self._step(input_ids, positions, kv_caches, meta)
        residual, normed, qkv_buf, query = step.residual, step.normed, step.qkv, step.query
        residual_ptr, normed_ptr, qkv_ptr, out_ptr = (residual.data_ptr(), normed.data_ptr(), step.qkv_ptr,
                                                      step.attn_out.data_ptr())
        cos_sin_ptr, norm_tail = step.cos_sin.data_ptr(), step.norm_tail
        rms_norm, rotary, store_kv, decode, silu_and_mul = (self.rms_norm, self.rotary, self.store_kv, self.decode,
                                                            self.silu_and_mul)
        all_reduce, inter = self.all_reduce, self.intermediate
        scaled = self.residual_multiplier if self.residual_multiplier != 1.0 else None

        layer_input = None   # the previous layer's output (down_proj's), added into the residual by the norm
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            if layer_input is None:   # the first layer normalises the embeddings, which start the residual
                rms_norm(residual_ptr, None, layer.norm1.data_ptr(), normed_ptr, *norm_tail, layer.eps1)
            else:
                rms_norm(layer_input.data_ptr(), residual_ptr, layer.norm1.data_ptr(), normed_ptr, *norm_tail,
                         layer.eps1)
            qkv = layer.qkv(normed, qkv_buf)
            if qkv is not qkv_buf:                        # a packed layer returns its own tensor
                qkv_buf.copy_(qkv)
            if layer.q_norm is not None:                  # each q and k head normed, in place
                layer.q_norm(step.heads[:, :self.num_heads])
                layer.k_norm(step.heads[:, self.num_heads:self.num_heads + self.num_kv_heads])
            if layer.rope:
                rotary(qkv_ptr, cos_sin_ptr, *step.rotary_tail)
            reads = step.ring if layer.window else step.paged   # a sliding layer's ring, where it has one
            if store_kv(step.k_ptr, step.v_ptr, k_cache.data_ptr(), v_cache.data_ptr(), reads.slots_ptr,
                        *reads.store_tail):
                raise IndexError(f"store_kv: a slot past the cache's {reads.num_slots} slots")
            if reads.decode_head is not None and decode(qkv_ptr, k_cache.data_ptr(), v_cache.data_ptr(), out_ptr,
                                                        *reads.decode_head, layer.window):
                raise MemoryError("cpu_attention: the kernel could not allocate its score buffer")
            if query is not None:
                prefill_attention(query, k_cache, v_cache, reads.meta, self.scale, layer.window or None,
                                  step.attn_out)
            hidden = layer.o(step.attn_flat, step.o)
            if all_reduce is not None:
                hidden = all_reduce(hidden)
            if scaled is not None:
                hidden.mul_(scaled)
            rms_norm(hidden.data_ptr(), residual_ptr, layer.norm2.data_ptr(), normed_ptr, *norm_tail, layer.eps2)
            gate_up = layer.gate_up(normed, step.gate_up)
            silu_and_mul(gate_up.data_ptr(), step.act.data_ptr(), step.num_tokens, inter, gate_up.stride(0), inter)
            layer_input = layer.down(step.act, step.down)
            if all_reduce is not None:
                layer_input = all_reduce(layer_input)
            if scaled is not None:
                layer_input.mul_(scaled)
        out = torch.empty_like(normed)
        rms_norm(layer_input.data_ptr(), residual_ptr, self.final_norm.data_ptr(), out.data_ptr(), *norm_tail,
                 self.final_eps)
        return out
