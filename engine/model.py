"""One model file for the Llama family: Llama 2/3 (llama3 and YaRN rope scaling), Qwen2 (q/k/v bias), Qwen3 (each q
and k head RMS-normed before rotary), Mistral (sliding window); grouped-query attention; tied or untied embeddings.
The variants in `engine.models` build on it.

The forward pass takes the whole step's tokens flat, `[num_tokens]`, sequence after sequence, with no padding;
attention reads and writes the paged KV cache through `AttentionMetadata`. Only the rows that will be sampled go
through the LM head (`compute_logits`). The norms, the rotary embedding and SiLU x mul are `engine.layers`, fused
kernels on CUDA (`kernels.triton_fused`) and as few torch operators as the numerics allow elsewhere (`kernels.fused`).

Under tensor parallelism (`engine.parallel`) each rank builds the same classes with its `ShardShape`: its query and KV
heads, its slice of the MLP and of the vocabulary; `load_weights` takes each rank's slice of the checkpoint's tensors,
and the forward pass sums the row-parallel outputs (o_proj, down_proj, the embedding) and gathers the logits with the
group's `Collectives`. With one rank every collective is the identity and the shapes are the model's own.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint_reading import CheckpointReading, WeightLoadError
from engine.int4_weights import code_std
from engine.model_config import ModelConfig
from engine.layers import GeluTanhAndMul, HeadRMSNorm, RMSNorm, RopeRows, RotaryEmbedding, SiluAndMul
from engine.layers.fp8_linear import Fp8Linear
from engine.parallel import Collectives, ShardShape
from kernels import AttentionMetadata, fused
from kernels.mxfp4 import mxfp4_scale

log = logging.getLogger("cliffguard.engine")
# An FP8 checkpoint's per-layer KV scales, as its exporters name them (`LlamaForCausalLM._kv_scale`)
KV_SCALE_NAMES = (".k_scale", ".v_scale", ".kv_scale", ".k_proj.output_scale", ".v_proj.output_scale")


class Attention(nn.Module):
    """Column-parallel q/k/v (this rank's heads), row-parallel o_proj (summed over the ranks). `rotary_emb`
    is the model's instance for this layer's attention type, shared by those layers; `layer` its index
    (its window, `ModelConfig.layer_window`); `head_norm` the q/k norm's class where the model has one."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: RotaryEmbedding,
                 layer: int = 0, head_norm: type[HeadRMSNorm] = HeadRMSNorm) -> None:
        super().__init__()
        self.config, self.comm = config, comm
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.q_size = shard.num_heads * config.head_dim
        self.kv_size = shard.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = head_norm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = head_norm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary_emb = rotary_emb
        self.scale = config.attention_scale
        self.softcap = config.attn_logit_softcapping or 0.0   # Gemma 2: each score capped (0: none)
        # GPT-OSS: this rank's heads' sink logits, each in its head's softmax denominator (None: no sinks)
        self.sinks = nn.Parameter(torch.empty(shard.num_heads)) if config.attention_sinks else None
        self.sliding_window = config.layer_window(layer)
        self.chunk = config.layer_chunk(layer)   # Llama 4's chunked layers: a query sees its chunk of positions
        # An FP8 cache stores K / k_scale and V / v_scale (the checkpoint's, else measured at start by
        # engine.kv_scales, else 1.0); other caches ignore them. kv_observer: that measurement's hook.
        self.k_scale = self.v_scale = 1.0
        self.kv_observer = None

    def forward(self, hidden: torch.Tensor, rope_rows: RopeRows, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend) -> torch.Tensor:
        num_heads, num_kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden).view(-1, num_heads + 2 * num_kv_heads, self.config.head_dim)  # [T, heads, d]
        self.position_qk(qkv, rope_rows)
        q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
        out = self.attend(q, k, v, kv_cache, meta, backend)
        return self.comm.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata, backend) -> torch.Tensor:
        """k and v stored in the layer's cache (seen first by an FP8 cache's scale measurement), then q's attention
        over it -> [num_tokens, num_heads, head_dim]."""
        k_cache, v_cache = kv_cache
        meta = meta.for_layer(self.sliding_window)   # a window-bounded cache's ring (engine.sliding_kv)
        if self.kv_observer is not None:
            self.kv_observer(k, v)
        backend.store_kv(k, v, k_cache, v_cache, meta, k_scale=self.k_scale, v_scale=self.v_scale)
        return backend.paged_attention(q, k_cache, v_cache, meta, self.scale, self.sliding_window,
                                       k_scale=self.k_scale, v_scale=self.v_scale, softcap=self.softcap,
                                       sinks=self.sinks, chunk=self.chunk)

    def position_qk(self, qkv: torch.Tensor, rope_rows: RopeRows) -> None:
        """q and k of qkv [T, heads, d] normed (where the model norms them), then turned by the rotary, in place
        (Hunyuan overrides it: the other order)."""
        self.norm_qk(qkv)
        self.rotary_emb(qkv[:, :self.num_heads + self.num_kv_heads], rope_rows)

    def norm_qk(self, qkv: torch.Tensor) -> None:
        """The q and k heads of qkv [T, heads, d] normed in place before rotary, where the model norms them (Qwen3,
        Gemma: each head by `head_norm`; OLMo 2 overrides it: the whole projection)."""
        if self.q_norm is not None:
            self.q_norm(qkv[:, :self.num_heads])
            self.k_norm(qkv[:, self.num_heads:self.num_heads + self.num_kv_heads])


class MLP(nn.Module):
    """Column-parallel gate/up (this rank's intermediate rows), row-parallel down_proj; the gate's
    activation by `hidden_act` (SiLU on the fused ops, or GELU-tanh)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, ops: ModuleType) -> None:
        super().__init__()
        self.comm = comm
        self.intermediate_size = shard.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=config.mlp_bias)
        self.act_fn = SiluAndMul(ops) if config.hidden_act == "silu" else GeluTanhAndMul()
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.down_proj(self.act_fn(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    """One pre-norm block. The residual stream travels beside the hidden states (vLLM's way), so each
    residual add is fused into the norm that follows it: on CUDA a layer is ten kernels (add+norm, qkv,
    rotary, store_kv, attention, o_proj, add+norm, gate_up, silu x mul, down)."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, rotary_emb: RotaryEmbedding,
                 ops: ModuleType, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = Attention(config, shard, comm, rotary_emb, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = MLP(config, shard, comm, ops)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope_rows: RopeRows,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, backend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [num_tokens, hidden_size], the previous layer's output (the embeddings, with residual
        None, for the first layer) -> (this layer's output, the residual stream before it is added)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope_rows, kv_cache, meta, backend)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def rank_rows(tensor: torch.Tensor, rank: int, rows: int) -> torch.Tensor:
    """Rank `rank`'s `rows` rows of a tensor cut in equal shares of rows (the vocabulary's: the embedding, a head), the
    last rank's tail past the tensor zeros."""
    part = tensor.new_zeros(rows, *tensor.shape[1:])
    start = rank * rows
    part[:max(0, min(tensor.shape[0] - start, rows))] = tensor[start:start + rows]
    return part


class LlamaForCausalLM(CheckpointReading, nn.Module):
    """The Llama-family decoder. Build it on the meta device, then `load_weights` or `init_random`.

    `shard` and `comm`: this rank's part of a tensor-parallel group (default: the whole model, one rank).
    `ops`: the fused small ops every layer runs (`kernels.fused.get_fused_ops`; default the torch ones).
    A variant (`engine.models`) changes its layers (`make_layer`), final norm (`make_norm`) and forward.
    """

    supports_flat_forward = True   # engine.cpu_forward's loop runs these layers on the CPU backend
    norm_class: type[nn.Module] | None = None   # a family's own norm (hidden_size, eps) in place of RMSNorm
    graph_safe = True              # its forward reads nothing back from the device: CUDA graphs can capture it
    graph_max_len: int | None = None   # the longest sequence a captured decode step holds (None: max_model_len)
    graph_sparse_regime = False    # past graph_max_len too, at lengths it is given (engine.cuda_graphs.capture_lengths)
    norm_init = 1.0                # a norm's weight in `init_random` (Gemma's 1 + weight: 0)

    def __init__(self, config: ModelConfig, shard: ShardShape | None = None, comm: Collectives | None = None,
                 ops: ModuleType = fused) -> None:
        super().__init__()
        self.config = config
        self.shard = shard = shard or ShardShape.of(config)
        self.comm = comm = comm or Collectives()
        # Built on the meta device and filled later: an explicit (empty) weight skips nn.Embedding's random
        # init, whose meta kernel imports torch._dynamo (over a second of every worker's start).
        self.embed_tokens = nn.Embedding(shard.vocab_rows, config.hidden_size,
                                         _weight=torch.empty(shard.vocab_rows, config.hidden_size))
        self.rotary_emb = self.make_rotary(ops)
        self.layers = nn.ModuleList(self.make_layer(i, ops) for i in range(config.num_layers))
        self.norm = self.make_norm(ops)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, shard.vocab_rows, bias=config.lm_head_bias)
        self._flat: tuple[object, object] | None = None   # (backend, its engine.cpu_forward.CpuForward or None)
        self.kv_scales_from_checkpoint = False   # an FP8 cache's scales: the checkpoint's (`_kv_scale`), not measured
        self.kv_scales_read: set[tuple[int, str]] = set()   # (layer, "k_scale" / "v_scale") the checkpoint brought
        # FP8 projections (`engine.models.build_model`): weight name -> layer; whether they hold an FP8 checkpoint's
        # values and scales as stored (else quantized as read); stored scales read, waiting for their weights
        self.fp8_layers: dict[str, Fp8Linear] = {}
        self.fp8_exact, self.fp8_scales = False, {}
        self.packed_params: set[str] = set()   # held packed as stored: MXFP4, INT4 experts, INT4 projections' weights

    def make_rotary(self, ops: ModuleType) -> RotaryEmbedding:
        return RotaryEmbedding(self.config, ops)

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        return self.with_own_norms(DecoderLayer(self.config, self.shard, self.comm, self.rotary_emb, ops, index))

    def make_norm(self, ops: ModuleType) -> nn.Module:
        if self.norm_class is not None:
            return self.norm_class(self.config.hidden_size, self.config.rms_norm_eps)
        return RMSNorm(self.config.hidden_size, self.config.rms_norm_eps, ops)

    def with_own_norms(self, layer: nn.Module) -> nn.Module:
        """A Llama layer with its two norms the family's `norm_class` where it has one (the final norm too:
        `make_norm`)."""
        if self.norm_class is not None:
            layer.input_layernorm = self.norm_class(self.config.hidden_size, self.config.rms_norm_eps)
            layer.post_attention_layernorm = self.norm_class(self.config.hidden_size, self.config.rms_norm_eps)
        return layer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> [num_tokens, hidden_size]; vocab-parallel: each rank looks up the ids in its
        rows (zeros for the others) and the ranks' rows are summed."""
        if self.shard.size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.shard.vocab_start
        mine = (local >= 0) & (local < self.shard.num_vocab_rows_used)
        hidden = self.embed_tokens(torch.where(mine, local, 0)) * mine.unsqueeze(-1).to(self.embed_tokens.weight.dtype)
        return self.comm.all_reduce(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size].

        On the CPU backend the layers run as `engine.cpu_forward.CpuForward`'s flat loop (the same ops
        without the module calls); elsewhere through the modules."""
        if self._flat is None or self._flat[0] is not backend:
            from engine.cpu_forward import CpuForward

            self._flat = (backend, CpuForward.build(self, backend))
        if self._flat[1] is not None and kv_caches[0][0].dtype == self.embed_tokens.weight.dtype:   # not FP8
            return self._flat[1](input_ids, positions, kv_caches, meta)
        hidden, residual = self.embed(input_ids), None
        rows: dict[int, RopeRows] = {}   # the step's cos/sin, once per rotary embedding (Gemma 3's layers have two)
        for layer, kv_cache in zip(self.layers, kv_caches):
            rotary = layer.self_attn.rotary_emb
            if id(rotary) not in rows:
                rows[id(rotary)] = rotary.rows(positions)
            hidden, residual = layer(hidden, residual, rows[id(rotary)], kv_cache, meta, backend)
        return self.norm(hidden, residual)[0]

    @property
    def flat_forward(self):
        """The `engine.cpu_forward.CpuForward` the last forward ran, or None (the module path, or none yet)."""
        return None if self._flat is None else self._flat[1]

    def layers_changed(self) -> None:
        """A layer's module was swapped (`kernels.cpu_linear.pack_linears`): the flat forward is rebuilt."""
        self._flat = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_rows, hidden_size] -> logits [num_rows, vocab_size] in the model's dtype (the sampler reads
        them in float32, a chunk of rows at a time: `engine.sampler`; a float32 copy of every row here would be
        the step's largest tensor): the head's (`head_logits`), soft-capped and scaled where the config says."""
        logits = self.head_logits(hidden)
        if (cap := self.config.final_logit_softcapping) is not None:   # Gemma 2: cap x tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        if self.config.logits_scaling != 1.0:   # Granite
            logits = logits / self.config.logits_scaling
        if self.config.logit_scale != 1.0:   # Cohere
            logits = logits * self.config.logit_scale
        return logits

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits. A tied model has no `lm_head` until `kernels.cpu_linear.pack_linears` gives it a packed
        copy of the embedding table; before that the table itself is the head. Vocab-parallel: each rank's columns
        are gathered, and the padding past the vocabulary dropped. Every rank calls it."""
        if "lm_head" in self._modules:
            logits = self.lm_head(hidden)
        else:
            logits = F.linear(hidden, self.embed_tokens.weight)
        if self.shard.size > 1:
            logits = self.comm.all_gather_last(logits)[:, :self.shard.vocab_size]
        return logits

    # --- weights ---------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters, each cut to this rank's shard; every
        parameter must be filled whole, once: a part filled twice (a tensor stored twice, which would hide a
        missing one) is refused. A tied model's stored `lm_head.weight` that is not the embedding table
        becomes the head (`_untie`)."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        parts: dict[tuple[str, int], str] = {}   # (parameter, storage offset of the part) -> the tensor that filled it
        stored_head: torch.Tensor | None = None
        orders: dict[str, str] = {}   # an INT4 layer's input order (GPTQ's activation order) -> the tensor that set it
        prefix = self.config.text_weights_prefix   # a multimodal checkpoint: its text model's tensors only
        for hf_name, name, tensor in self._read_tensors(weights, prefix):
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                stored_head = self._shard_of(hf_name, name, tensor)
                continue
            if name.endswith(KV_SCALE_NAMES):   # an FP8 checkpoint's per-layer KV scales
                self._kv_scale(hf_name, name, tensor)
                continue
            if name.endswith(".perm"):   # whole on every rank, one for a fused layer's parts
                target = self._fill_order(hf_name, name, tensor, params, orders)
                filled[target] = params[target].numel()
                continue
            target, part = self._destination(name, hf_name)
            if target not in params:
                raise WeightLoadError(f"{hf_name}: not a tensor of {self.config.architecture} with this config")
            fp8 = self.fp8_layers.get(target)   # an FP8 projection's weight
            table = params[target].dtype == torch.int32 and not tensor.is_floating_point()   # DeepSeek V4's hash tables
            if (not tensor.is_floating_point() or tensor.element_size() == 1 and fp8 is None) and not table \
                    and not tensor.dtype == params[target].dtype == torch.uint8:   # MXFP4 codes, held as stored
                raise WeightLoadError(f"{hf_name}: {tensor.dtype} weights (a quantized checkpoint) are not supported")
            stored = tuple(tensor.shape)
            tensor = self._shard_of(hf_name, name, tensor)
            dest = part(params[target].data)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise WeightLoadError(
                    f"{hf_name}: shape {tuple(tensor.shape)} does not match the config's {tuple(dest.shape)}")
            if (target, dest.storage_offset()) in parts:
                raise WeightLoadError(f"{hf_name}: fills the part of {target} that "
                                      f"{parts[target, dest.storage_offset()]} filled (a tensor stored twice)")
            parts[target, dest.storage_offset()] = hf_name
            if fp8 is not None:
                filled[f"{target}_scale"] = filled.get(f"{target}_scale", 0) + self._fill_fp8(
                    fp8, dest, tensor, hf_name, lambda t, n=name, h=hf_name: self._shard_of(h, n, t), stored)
            else:
                with torch.no_grad():
                    dest.copy_(tensor)
            filled[target] = filled.get(target, 0) + dest.numel()
        if stored_head is not None and filled.get("embed_tokens.weight") == self.embed_tokens.weight.numel():
            self._untie(stored_head)
        elif stored_head is not None and not filled.get("embed_tokens.weight"):   # the head alone stands for both
            self._tie_from_head(stored_head)                                       # (safetensors' `save_model`)
            filled["embed_tokens.weight"] = self.embed_tokens.weight.numel()
        missing = [_missing(name, [hf for (target, _), hf in parts.items() if target == name])
                   for name, param in params.items() if filled.get(name, 0) != param.numel()]
        if missing:
            raise WeightLoadError(f"checkpoint is missing weights: {', '.join(missing[:8])}"
                                  + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))

    def _tie_from_head(self, head: torch.Tensor) -> None:
        """A tied checkpoint that stores the shared table under `lm_head.weight` only (safetensors'
        `save_model` keeps one name of tied tensors, the first in order): it is the embedding too, as
        transformers 5 ties such a checkpoint."""
        embed = self.embed_tokens.weight
        if tuple(head.shape) != tuple(embed.shape):
            raise WeightLoadError(f"lm_head.weight: shape {tuple(head.shape)} does not match the config's "
                                  f"{tuple(embed.shape)}")
        with torch.no_grad():
            embed.copy_(head)

    def _untie(self, head: torch.Tensor) -> None:
        """config.json ties the head to the embedding, yet the checkpoint stores an `lm_head.weight` (this
        rank's rows: `head`). The same table (a redundant copy, as some exporters write): nothing to do.
        Another one (a fine-tune that trained the head alone and kept the flag): it is the head, as
        transformers 5 reads such a checkpoint (it unties with a warning), not the embedding."""
        embed = self.embed_tokens.weight
        if tuple(head.shape) != tuple(embed.shape):
            raise WeightLoadError(f"lm_head.weight: shape {tuple(head.shape)} does not match the config's "
                                  f"{tuple(embed.shape)}")
        if torch.equal(head.to(embed.device, embed.dtype), embed.data):
            return
        log.warning("lm_head.weight: config.json says tie_word_embeddings, but the checkpoint's head differs from "
                    "its embedding table; serving the stored head (as transformers does)")
        self.lm_head = nn.Linear(self.config.hidden_size, embed.shape[0], bias=False, device=embed.device,
                                 dtype=embed.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(head)
        self.config = replace(self.config, tie_word_embeddings=False)

    def _kv_scale(self, hf_name: str, name: str, tensor: torch.Tensor) -> None:
        """`layers.N.self_attn.k_scale` or `v_scale` (under `attn`, `k_proj` / `v_proj` too), `kv_scale` (both, as
        AutoFP8 wrote them) or `k_proj.output_scale` / `v_proj.output_scale` (ModelOpt's, Quark's): the scale an
        FP8 cache stores that layer's K (V) over, as vLLM reads them. One positive, finite number."""
        parts = name.split(".")
        if parts[0] != "layers" or not parts[1].isdigit() or int(parts[1]) >= len(self.layers) or tensor.numel() != 1:
            raise WeightLoadError(f"{hf_name}: not a per-layer KV scale of this model (shape {tuple(tensor.shape)})")
        value = float(tensor.float().reshape(()))
        if not (math.isfinite(value) and value > 0):
            raise WeightLoadError(f"{hf_name}: a KV scale must be positive and finite, got {value}")
        kind = parts[-2][0] + "_scale" if parts[-1] == "output_scale" else parts[-1]   # k_proj.output_scale: k's
        for attr in ("k_scale", "v_scale") if kind == "kv_scale" else (kind,):
            setattr(self.layers[int(parts[1])].self_attn, attr, value)
            self.kv_scales_read.add((int(parts[1]), attr))
        self.kv_scales_from_checkpoint = True

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """A checkpoint tensor (`name` without "model."; `hf_name` as stored, which errors name) as this
        family's loading reads it: itself. A family whose checkpoints name a module otherwise (Mixtral's experts)
        renames it, one that stores fused what the cuts take apart (Phi-3's qkv_proj) splits it, here."""
        return ((name, tensor),)

    def _destination(self, name: str, hf_name: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
        """Where checkpoint tensor `name` (without "model."; `hf_name` as stored, which errors name) goes: our
        parameter's name, and the part of it (a view of its data) the tensor fills: q/k/v into the fused qkv_proj's
        rows, gate/up into gate_up_proj's, in this rank's sizes (`cut_shape`'s: a layer's own where it has one);
        anything else the whole parameter of the same name."""
        shard, c = self.cut_shape(name)
        q, kv, inter = shard.num_heads * c.head_dim, shard.num_kv_heads * c.head_dim, shard.intermediate_size
        fused = {  # HF suffix -> (our suffix, row offset, rows)
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
            "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
            "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
            "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
        }
        for hf_part, (ours, offset, size) in fused.items():
            if f".{hf_part}." in f".{name}":
                return name.replace(hf_part, ours), lambda data: data.narrow(0, offset, size)
        return name, lambda data: data

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of one checkpoint tensor (itself with one rank), cut in the shape `cut_shape` gives."""
        shard, c = self.cut_shape(name)
        if shard.size == 1:
            return tensor
        if name.endswith("self_attn.sinks"):   # GPT-OSS's, MiMo-V2-Flash's, Granite SWA's: a logit per query head
            if tuple(tensor.shape) != (c.num_heads,):
                raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the config "
                                      f"({c.num_heads} heads)")
            return shard.heads_of(tensor)
        d = c.head_dim
        part = name.rsplit(".", 1)[0].split(".", 2)[-1] if name.startswith("layers.") else name.rsplit(".", 1)[0]
        is_bias = name.endswith(".bias")
        cuts = {  # part -> (dim, full size along it, start, length)
            "self_attn.q_proj": (0, c.num_heads * d, shard.head_start * d, shard.num_heads * d),
            "self_attn.k_proj": (0, c.num_kv_heads * d, shard.kv_head_start * d, shard.num_kv_heads * d),
            "self_attn.v_proj": (0, c.num_kv_heads * d, shard.kv_head_start * d, shard.num_kv_heads * d),
            "mlp.gate_proj": (0, c.intermediate_size, shard.rank * shard.intermediate_size, shard.intermediate_size),
            "mlp.up_proj": (0, c.intermediate_size, shard.rank * shard.intermediate_size, shard.intermediate_size),
            "self_attn.o_proj": (1, c.num_heads * d, shard.head_start * d, shard.num_heads * d),
            "mlp.down_proj": (1, c.intermediate_size, shard.rank * shard.intermediate_size, shard.intermediate_size),
        }
        if part in ("embed_tokens", "lm_head"):
            if tensor.shape[0] != c.vocab_size:
                raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the config's "
                                      f"vocab_size {c.vocab_size}")
            return rank_rows(tensor, shard.rank, shard.vocab_rows)
        if part not in cuts:
            return tensor   # norms: every rank holds all of them
        dim, full, start, length = cuts[part]
        if is_bias and dim == 1:   # a row-parallel layer's bias is added once, after the sum: on rank 0
            return tensor if shard.rank == 0 else torch.zeros_like(tensor)
        dim = 0 if is_bias else dim
        if dim == 1 and name.endswith((".blocks", ".scales", ".zeros")):   # integers held as stored: whole groups
            per = 8 // self.config.int4_bits if name.endswith(".blocks") else self.config.int4_group
            # a scale a row (group 0): every rank holds the row's
            full, start, length = (full // per, start // per, length // per) if per else (1, 0, 1)
        if tensor.dim() <= dim or tensor.shape[dim] != full:
            raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the config "
                                  f"({full} along dimension {dim})")
        return tensor.narrow(dim, start, length)

    def layer_of(self, name: str) -> nn.Module | None:
        """The layer a `layers.N.` tensor (its name without "model.") belongs to (None: another tensor, or past the
        model's layers)."""
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) < len(self.layers):
            return self.layers[int(parts[1])]
        return None

    def cut_shape(self, name: str) -> tuple[ShardShape, ModelConfig]:
        """(this rank's shard, the config) tensor `name` is cut in: the model's (Gemma 4's full layers have their own
        attention shape)."""
        return self.shard, self.config

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights (normal, std) and unit norms: for benchmarks of model shapes we cannot download.
        Each rank of a tensor-parallel group draws its own shard (from `seed` and its rank)."""
        gen = torch.Generator(device="cpu").manual_seed(seed + 7919 * self.shard.rank)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):   # every norm, q/k norms included
                    param.fill_(self.norm_init)
                elif name.endswith(("weight_scale", "w13_scale", "w2_scale")):   # FP8 values of about 1, times std
                    param.fill_(std)
                elif name.endswith(("w13_scales", "w2_scales", ".scales")):   # packed weights': codes drawn alike
                    param.fill_(mxfp4_scale(std) if param.dtype == torch.uint8
                                else std / code_std(self.config.int4_bits))   # about std
                elif name.endswith((".zeros", "_zeros")):   # integer zero points: the codes' middle
                    param.fill_(1 << (self.config.int4_bits - 1))
                elif name.endswith(".perm"):   # an INT4 layer's input order: as they come
                    param.copy_(torch.arange(param.numel()))
                elif param.dtype in (torch.float8_e4m3fn, torch.uint8):   # FP8 values; MXFP4's codes, two a byte
                    param.copy_(torch.randint(0, 256, param.shape, generator=gen) if param.dtype == torch.uint8
                                else torch.randn(param.shape, generator=gen))
                else:
                    param.copy_(torch.randn(param.shape, generator=gen) * std)


def _missing(name: str, filled_by: list[str]) -> str:
    """A parameter the checkpoint left unfilled, with the tensors that filled its other parts (a fused one's: the
    q and v of a qkv whose k is missing), so the tensor that is not there can be told."""
    if not filled_by:
        return name
    shown = ", ".join(filled_by[:3]) + (f" and {len(filled_by) - 3} more" if len(filled_by) > 3 else "")
    return f"{name} (filled in part, by {shown})"
