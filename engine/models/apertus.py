"""Swiss AI's Apertus (`ApertusForCausalLM`: Apertus-8B, -70B): the Llama layer with each q and k head RMS-normed
before the rotary (Qwen3's), its norms under their own names (`attention_layernorm`, `feedforward_layernorm`), and
an MLP without a gate whose activation is xIELU (`XIELU`: two learned slopes a layer, transformers'
`XIELUActivation` in its Python form). Arcee's AFM (`ArceeForCausalLM`: AFM-4.5B) is the Llama layer with that MLP
shape, its activation squared ReLU; Inception's Jais 2 (`Jais2ForCausalLM`) is AFM's layer with LayerNorms (a weight
and a bias) and every projection biased; BigCode's StarCoder2 (`Starcoder2ForCausalLM`) is Jais 2's with GELU-tanh,
NVIDIA's Nemotron (`NemotronForCausalLM`) Jais 2's with LayerNorms of weight + 1 and a partial rotary.
The module path runs them (the CPU flat loop's MLP is the gated one).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import BiasLayerNorm
from engine.model import DecoderLayer, LlamaForCausalLM, WeightLoadError, rank_rows
from engine.model_config import ModelConfig
from engine.models.nemotron_h import ReluSquared
from engine.models.phi3 import partial_rotary_rows
from engine.parallel import Collectives, ShardShape

__all__ = ["ApertusForCausalLM", "ArceeForCausalLM", "Jais2ForCausalLM", "NemotronForCausalLM",
           "PrunedHeadForCausalLM", "Starcoder2ForCausalLM", "XIELU"]


class XIELU(nn.Module):
    """x > 0: softplus(alpha_p) x^2 + beta x; else (expm1(min(x, eps)) - x) (beta + softplus(alpha_n)) + beta x.
    alpha_p, alpha_n: the layer's learned parameters; beta and eps the checkpoint's constants (0.5, -1e-6)."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.empty(1))
        self.alpha_n = nn.Parameter(torch.empty(1))
        self.beta, self.eps = 0.5, -1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        eps = torch.tensor(self.eps, dtype=x.dtype, device=x.device)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.minimum(x, eps)) - x) * alpha_n + self.beta * x)


class ApertusMLP(nn.Module):
    """up, `act_fn` (Apertus's xIELU, Arcee's squared ReLU), down: no gate. Column-parallel up (`up`: the
    checkpoint's up_proj), row-parallel down_proj; biased where `mlp_bias`."""

    def __init__(self, config: ModelConfig, shard: ShardShape, comm: Collectives, act_fn: nn.Module) -> None:
        super().__init__()
        self.comm = comm
        self.up = nn.Linear(config.hidden_size, shard.intermediate_size, bias=config.mlp_bias)
        self.act_fn = act_fn
        self.down_proj = nn.Linear(shard.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.down_proj(self.act_fn(self.up(x))))


class PrunedHeadForCausalLM(LlamaForCausalLM):
    """The Llama model with a head pruned to the vocabulary's first `output_vocab_size` ids, where the config sets it
    (Apertus 1.5's text tokens, Llama 3.2 Vision's vocabulary before its image token; the ids past them are input
    only): the head holds those rows (a rank its share, as the table's are cut) and the logits of the ids past them
    are -inf, so the logits keep the vocabulary's width (what the sampler, penalties and grammars index) and a pruned
    id is never sampled."""

    def __init__(self, config: ModelConfig, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        if config.output_vocab_size:
            self.lm_head = nn.Linear(config.hidden_size, self.head_rows, bias=False)

    @property
    def head_rows(self) -> int:
        """Rows of this rank's share of a pruned head."""
        return -(-self.config.output_vocab_size // self.shard.size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.config.output_vocab_size:
            return super().compute_logits(hidden)
        logits = self.lm_head(hidden)
        if self.shard.size > 1:
            logits = self.comm.all_gather_last(logits)
        kept = self.config.output_vocab_size
        return F.pad(logits[:, :kept], (0, self.config.vocab_size - kept), value=float("-inf"))

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A pruned head's rows cut as the table's (the last rank's tail padding)."""
        if name == "lm_head.weight" and self.config.output_vocab_size:
            kept, rows = self.config.output_vocab_size, self.head_rows
            if tuple(tensor.shape) != (kept, self.config.hidden_size):
                raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} is not the pruned head's "
                                      f"({kept}, {self.config.hidden_size}) of output_vocab_size {kept}")
            return rank_rows(tensor, self.shard.rank, rows)
        return super()._shard_of(hf_name, name, tensor)


class ApertusForCausalLM(PrunedHeadForCausalLM):
    """Apertus (see the module docstring); `activation` its MLP's. Apertus 1.5's head is pruned to its text tokens
    (`PrunedHeadForCausalLM`)."""

    supports_flat_forward = False
    activation: type[nn.Module] = XIELU

    def make_layer(self, index: int, ops: ModuleType) -> nn.Module:
        layer = DecoderLayer(self.config, self.shard, self.comm, self.rotary_emb, ops, index)
        layer.mlp = ApertusMLP(self.config, self.shard, self.comm, self.activation())
        return self.with_own_norms(layer)

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The norms' and up_proj's names as the Llama layer's and `ApertusMLP`'s; xIELU's constants (`beta`, `eps`,
        buffers of transformers') set on the layer's activation."""
        if name.endswith((".act_fn.beta", ".act_fn.eps")):
            parts = name.split(".")
            if parts[0] != "layers" or not parts[1].isdigit() or int(parts[1]) >= len(self.layers) or \
                    tensor.numel() != 1:
                raise WeightLoadError(f"{hf_name}: not a layer's xIELU constant (shape {tuple(tensor.shape)})")
            setattr(self.layers[int(parts[1])].mlp.act_fn, parts[-1], float(tensor.float().reshape(())))
            return ()
        return ((name.replace(".attention_layernorm.", ".input_layernorm.")
                 .replace(".feedforward_layernorm.", ".post_attention_layernorm.")
                 .replace(".mlp.up_proj.", ".mlp.up."), tensor),)

    def _shard_of(self, hf_name: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`up` cut as the Llama MLP's up_proj; xIELU's slopes whole on every rank."""
        return super()._shard_of(hf_name, name.replace(".mlp.up.", ".mlp.up_proj."), tensor)


class ArceeForCausalLM(ApertusForCausalLM):
    """Arcee's AFM (see the module docstring): Apertus's model and reading, its MLP's activation squared ReLU (no
    q/k norms: `ModelConfig.qk_norm` is Apertus's alone)."""

    activation = ReluSquared


class Jais2ForCausalLM(ArceeForCausalLM):
    """Jais 2 (see the module docstring): AFM's model with LayerNorms in place of its RMSNorms."""

    norm_class = BiasLayerNorm


class GeluTanh(nn.Module):
    """GELU's tanh approximation (transformers' `gelu_pytorch_tanh`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


class Starcoder2ForCausalLM(Jais2ForCausalLM):
    """StarCoder2 (see the module docstring): Jais 2's model, its MLP's activation GELU-tanh, its MLP's tensors
    under their own names (`c_fc`, `c_proj`)."""

    activation = GeluTanh

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return super().read_tensor(hf_name, name.replace(".mlp.c_fc.", ".mlp.up_proj.")
                                   .replace(".mlp.c_proj.", ".mlp.down_proj."), tensor)


class NemotronForCausalLM(Jais2ForCausalLM):
    """Nemotron (Nemotron-4, Minitron; see the module docstring): Jais 2's model whose LayerNorms scale by weight + 1
    (the stored weight plus one, as read: transformers adds it in the weight's dtype too), the first
    `partial_rotary_factor` of each head turned with rotate-half pairs (q/k rows reordered as read)."""

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.endswith(("layernorm.weight", "norm.weight")):
            tensor = tensor + 1.0
        return super().read_tensor(hf_name, name, partial_rotary_rows(self.config, name, tensor))
