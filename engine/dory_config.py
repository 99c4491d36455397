"""NVIDIA's Dory (`DoryForCausalLM`, Nemotron Labs Dory 1.0) as transformers' `DoryConfig` reads its config.json: an
nGPT model (every hidden state on the unit sphere: L2 norms of no weight, residuals that interpolate towards each
sublayer's normed output at learned rates) of `n_input_layers`, then `n_recurrent_layers` run `n_recurrent_loops` times
(each loop restarting from the input section's output), then `n_output_layers`. Its layers are sliding (a window of
`sliding_window`) or full attention by `layer_types` (by default every fourth full), each type its own rope base (10,000
and 10,000,000 unless `rope_parameters` says), q and k normed to unit length and q scaled per channel after the rotary,
the output gated and normed, the MLP's gate and up scaled per channel, the head's logits per token.

The engine serves the loops unrolled: its layers are the virtual ones (`DoryShape.physical` names each one's weights),
and with `recurrent_kv_cache_mode` per_loop (the default) each keeps its own K/V, as transformers' cache does; with
last_loop only the last loop's runs keep K/V, the earlier ones attending to it (`DoryShape.kv_owner`). The released
config.json lists an attention and an mlp block a layer (`layer_types` with `mlp` entries, every count doubled): read as
transformers reads it. What we do not serve is refused naming the key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import ConfigError
from engine.config_values import read_float, read_int, read_object

__all__ = ["DoryShape", "dory_config", "dory_fields"]

DORY_THETAS = {"sliding_attention": 10_000.0, "full_attention": 10_000_000.0}   # DoryConfig's, by layer type


@dataclass(frozen=True)
class DoryShape:
    """The checkpoint's `layers` layers (`inputs`, then `recurrent` run `loops` times, then `outputs`) and the nGPT
    scales' constants: `init` (initializer_range, which the stored scales are relative to) and `alpha`
    (ngpt_alpha_init, the residual rates')."""

    layers: int
    inputs: int
    recurrent: int
    outputs: int
    loops: int
    init: float
    alpha: float
    last_loop: bool = False   # `recurrent_kv_cache_mode` last_loop: the last loop's K/V alone kept

    @property
    def num_virtual(self) -> int:
        return self.inputs + self.loops * self.recurrent + self.outputs

    def physical(self, virtual: int) -> int:
        """The checkpoint layer whose weights virtual layer `virtual` runs."""
        if virtual < self.inputs:
            return virtual
        if virtual < self.inputs + self.loops * self.recurrent:
            return self.inputs + (virtual - self.inputs) % self.recurrent
        return virtual - (self.loops - 1) * self.recurrent

    def kv_owner(self, virtual: int) -> int:
        """The virtual layer whose K/V virtual layer `virtual` keeps and attends to: itself, or with `last_loop` a
        recurrent layer's run in the last loop (an earlier loop writes its own K/V into those slots for the step's
        tokens and attends to them; the last loop's overwrite them, transformers' cache in that mode)."""
        start, looped = self.inputs, self.loops * self.recurrent
        if not self.last_loop or not start <= virtual < start + looped - self.recurrent:
            return virtual
        return start + looped - self.recurrent + (virtual - start) % self.recurrent

    def first_virtual(self, layer: int) -> int:
        """The first virtual layer running checkpoint layer `layer` (its weights' name in the model)."""
        return layer if layer < self.inputs + self.recurrent else layer + (self.loops - 1) * self.recurrent

    def num_params(self, hidden: int, q: int, kv: int, inter: int, vocab_rows: int, vocab: int, tied: bool) -> int:
        """A rank's: each checkpoint layer's q/k/v/o and output gate (`q` and `kv` its widths), its two per-channel
        query and gate scales, its MLP (`inter` rows) and two per-row scales, its two residual rates; the table, the
        head of `vocab_rows` and its per-token logit scale (whole)."""
        attn = hidden * (q + 2 * kv) + q * hidden + hidden * q + 2 * q
        mlp = 3 * hidden * inter + 2 * inter
        head = 0 if tied else vocab_rows * hidden
        return self.layers * (attn + mlp + 2 * hidden) + vocab_rows * hidden + head + vocab


def dory_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json under the Llama reading's keys: its ropes by layer type set aside (`dory_fields` reads them), and
    the released layout (an attention and an mlp block a layer) as transformers reads it: `mlp` entries dropped from
    `layer_types`, the layer counts halved."""
    cfg = {**cfg, "dory_ropes": read_object(cfg, "rope_parameters") or {}, "rope_parameters": None}
    kinds = cfg.get("layer_types")
    if not (isinstance(kinds, list) and "mlp" in kinds):
        return cfg
    halved = {key: read_int(cfg, key) // 2 for key in ("num_hidden_layers", "n_input_layers", "n_output_layers",
                                                      "n_recurrent_layers") if cfg.get(key) is not None}
    return {**cfg, **halved, "layer_types": kinds[::2]}


def dory_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The `ModelConfig` fields of a Dory config (see the module docstring): the virtual layers' count, types and
    rope bases, the window, the unit-length q/k norms and the shape of the loops."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(num_layers)]
    if not isinstance(kinds, list) or len(kinds) != num_layers or \
            any(k not in ("sliding_attention", "full_attention") for k in kinds):
        raise ConfigError(f"layer_types: sliding_attention or full_attention for each of the {num_layers} layers, "
                          f"got {kinds!r:.120}")
    inputs, outputs = read_int(cfg, "n_input_layers", 8, minimum=0), read_int(cfg, "n_output_layers", 8, minimum=0)
    recurrent = read_int(cfg, "n_recurrent_layers", max(num_layers - inputs - outputs, 0), minimum=0)
    if inputs + recurrent + outputs != num_layers:
        raise ConfigError(f"n_recurrent_layers: n_input_layers + n_recurrent_layers + n_output_layers must be "
                          f"num_hidden_layers ({num_layers}), got {inputs} + {recurrent} + {outputs}")
    mode = cfg.get("recurrent_kv_cache_mode") or "per_loop"
    if mode not in ("per_loop", "last_loop"):
        raise ConfigError(f"recurrent_kv_cache_mode: per_loop (each loop its own K/V) or last_loop (the last loop's "
                          f"alone), got {mode!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act: Dory's MLP is served with silu only, got {cfg['hidden_act']!r}")
    shape = DoryShape(layers=num_layers, inputs=inputs, recurrent=recurrent, outputs=outputs,
                      loops=read_int(cfg, "n_recurrent_loops", 2), init=read_float(cfg, "initializer_range", 0.0177),
                      alpha=read_float(cfg, "ngpt_alpha_init", 0.05), last_loop=mode == "last_loop")
    thetas = {kind: _theta(cfg, kind) for kind in set(kinds)}
    virtual = [kinds[shape.physical(v)] for v in range(shape.num_virtual)]
    return {"num_layers": shape.num_virtual, "layer_types": tuple(virtual), "dory": shape, "qk_norm": True,
            "sliding_window": read_int(cfg, "sliding_window", 1024),
            "layer_rope_thetas": tuple(thetas[kind] for kind in virtual)}


def _theta(cfg: dict[str, Any], kind: str) -> float:
    """A layer type's rope base: `rope_parameters[kind].rope_theta` (or one `rope_parameters` for both types; default
    scaling alone), else DoryConfig's."""
    ropes = cfg.get("dory_ropes") or {}
    rope = ropes.get(kind) if isinstance(ropes.get(kind), dict) else ropes if "rope_theta" in ropes else None
    if rope is None:
        return DORY_THETAS[kind]
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_parameters.{kind}.rope_type: default is served for Dory, got {rope['rope_type']!r}")
    return read_float(rope, "rope_theta", DORY_THETAS[kind], path=f"rope_parameters.{kind}.")
