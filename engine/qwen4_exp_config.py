"""Qwen4-Exp's text model (`Qwen4ExpForCausalLM`, the `text_config` of `Qwen4ExpForConditionalGeneration`) as
transformers' `Qwen4ExpTextConfig` reads its config.json: Qwen3.5-MoE's hybrid (Gated DeltaNet layers, experts on
every layer beside a gated shared expert) with
- a residual of `hc_count` streams a token (`Qwen4ExpShape.streams`), each sublayer reading a gated mix of them
  through a low-rank projection (`hc_lowrank`) and writing its output into each, weighed (no other norm: the mix's
  own per-stream norm is the layer's), one last mix (`hyper_connection_mixer`) before the head;
- per-layer n-gram embeddings (PLE) on the linear layers `ple_layer_ids` names (one-indexed): the token and its
  `ngram_size` - 1 predecessors (an EOS, or the sequence's start, cuts the run: the tokens before it read as EOS)
  hashed into `heads_per_ngram` tables an n-gram order, each of a prime number of rows past `ngram_vocab_size_base`
  (`ple_tables`), projected, gated by the streams and through a dilated depthwise convolution (a state a sequence);
- QSA, its every attention layer's token selection (`QsaIndexer`): the keys of each complete block of
  `indexer_compress_ratio` tokens averaged, normed and turned at the block's start, scored against the query's
  indexer heads (ReLU, summed), the best `indexer_budget` / ratio blocks and the incomplete last block attended.
What we do not serve is refused naming the key."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_int
from engine.gated_delta_config import qwen3_5_moe_fields
from engine.minimax_m3_config import BlockIndexer
from engine.rope_config import partial_rotary_factor

__all__ = ["QsaIndexer", "Qwen4ExpShape", "layer_multipliers", "ple_tables", "qwen4_exp_fields"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15   # SplitMix64's increment and mixing constants
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_LAYER_PRIME = 10007
_QSA_KEYS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


@dataclass(frozen=True)
class QsaIndexer(BlockIndexer):
    """QSA on `layers` (every attention layer): `num_heads` indexer query heads of `head_dim` against one key a
    token, blocks of `block_size` (`indexer_compress_ratio`) tokens, `topk_blocks` (`indexer_budget` / ratio)
    chosen; `local_blocks` 0 (the incomplete block is always attended, no whole one). The cache keeps each token's
    indexer key, un-normed and unturned, beside its K/V (a block's key is made from them when a query scores it)."""

    def num_params(self, hidden_size: int, kv_heads: int) -> int:
        """Each layer's `index_qk_proj` (the query heads and the key head) and its q and k norms, whole on every
        rank."""
        d = self.head_dim
        return len(self.layers) * (hidden_size * (self.num_heads + 1) * d + 2 * d)

    def graph_scores_bytes(self, max_len: int, kv_heads: int) -> int:
        """0: QSA's sparse regime runs eagerly (its selection is torch's, a sequence at a time): no graph holds it."""
        return 0

    @property
    def dense_len(self) -> int:
        """The longest context a query attends whole: (topk_blocks + 1) x block_size - 1 tokens hold at most
        topk_blocks complete blocks, each chosen."""
        return (self.topk_blocks + 1) * self.block_size - 1


@dataclass(frozen=True)
class Qwen4ExpShape:
    """Qwen4-Exp's streams and per-layer n-gram embeddings (the module docstring); `ple_layers` zero-indexed."""

    streams: int
    lowrank: int
    ple_layers: tuple[int, ...]
    ple_dim: int
    ple_kernel: int
    ngram: int
    heads_per_ngram: int
    vocab_base: int
    vocab_multiple: int
    seed: int
    eos: int
    shard_parts: int = 512   # the parts checkpoints store each table in (`split_ngram_parts`)

    @property
    def ngram_heads(self) -> int:
        return (self.ngram - 1) * self.heads_per_ngram

    @property
    def ple_head_dim(self) -> int:
        """Each n-gram table's row width."""
        return self.ple_dim // self.ngram_heads

    @property
    def conv_state_len(self) -> int:
        """The PLE convolution's inputs a sequence keeps: (kernel - 1) x dilation (the n-gram size)."""
        return (self.ple_kernel - 1) * self.ngram

    def table_split(self, ranks: int) -> int:
        """Over how many of `ranks` tensor-parallel ranks the tables' columns are split: all where they divide a
        row, else none (each rank holds them whole)."""
        return ranks if self.ple_head_dim % ranks == 0 else 1

    def table_rows(self, index: int) -> int:
        """The rows of the `index`-th PLE layer's table: its heads' primes summed, rounded up to `vocab_multiple`."""
        total = sum(ple_tables(self, index)[0])
        return -(-total // self.vocab_multiple) * self.vocab_multiple

    def num_params(self, hidden: int, num_layers: int, ranks: int = 1) -> int:
        """Every layer's two stream mixes, the last mix, and each PLE layer's table (a rank's columns of it where
        `ranks` divide its width, `table_split`), projections, norms and convolution."""
        wide = self.streams * hidden

        def mix(combine: bool) -> int:
            return wide + 2 * wide * self.lowrank + (wide * self.streams if combine else 0)

        cols = self.ple_head_dim // self.table_split(ranks)
        ple = sum(self.table_rows(i) * cols for i in range(len(self.ple_layers)))
        ple += len(self.ple_layers) * (self.ple_dim * (wide + hidden) + 3 * wide + wide * self.ple_kernel)
        return 2 * num_layers * mix(True) + mix(False) + ple

    def state_bytes(self, hidden: int, itemsize: int) -> int:
        """A sequence's PLE state: each PLE layer's convolution inputs (the streams' width, model dtype) and its last
        n-gram size - 1 token ids (float32)."""
        return len(self.ple_layers) * (self.streams * hidden * self.conv_state_len * itemsize + 4 * (self.ngram - 1))


def _splitmix64(value: int) -> int:
    value = (value + _GOLDEN) & _MASK64
    value = ((value ^ (value >> 30)) * _MIX1) & _MASK64
    value = ((value ^ (value >> 27)) * _MIX2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(shape: Qwen4ExpShape, vocab_size: int, index: int) -> list[int]:
    """The odd multipliers the `index`-th PLE layer hashes a token at each n-gram position with (SplitMix64 of the
    seed, the layer and the position), each below 2^63 / vocab_size so a product never overflows int64."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = shape.seed + _LAYER_PRIME * index
    return [2 * (_splitmix64((base + _GOLDEN * (i + 1)) & _MASK64) % half) + 1 for i in range(shape.ngram)]


def ple_tables(shape: Qwen4ExpShape, index: int) -> tuple[list[int], list[int]]:
    """The `index`-th PLE layer's heads' table sizes (consecutive primes past `vocab_base`, the heads of all PLE
    layers in turn) and their rows' offsets in its one table."""
    primes = _primes_from(shape.vocab_base, len(shape.ple_layers) * shape.ngram_heads)
    sizes = list(primes[index * shape.ngram_heads:(index + 1) * shape.ngram_heads])
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return sizes, offsets


@functools.lru_cache(maxsize=8)
def _primes_from(start: int, count: int) -> tuple[int, ...]:
    """The first `count` primes >= start."""
    found: list[int] = []
    n = start
    while len(found) < count:
        if n >= 2 and (n == 2 or n % 2) and all(n % d for d in range(3, math.isqrt(n) + 1, 2)):
            found.append(n)
        n += 1
    return tuple(found)


def qwen4_exp_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen3.5-MoE's fields (experts 512, 10 a token by default; the rotary whole unless the rope's
    `partial_rotary_factor` says) with `layer_types` read as Qwen4-Exp's (`indexed_attention`, and `full_attention`
    as its checkpoints write it, are QSA attention), its streams, PLE and QSA (`QsaIndexer`)."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        interval = read_int(cfg, "full_attention_interval", 4)
        kinds = ["indexed_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if not isinstance(kinds, list) or len(kinds) != num_layers or \
            any(k not in ("linear_attention", "indexed_attention", "full_attention") for k in kinds):
        raise ConfigError(f"layer_types: linear_attention or indexed_attention for each of the {num_layers} layers, "
                          f"got {kinds!r:.120}")
    kinds = ["linear_attention" if k == "linear_attention" else "full_attention" for k in kinds]
    gate = cfg.get("output_gate_type") or cfg.get("hidden_act", "silu")
    if gate not in ("silu", "sigmoid"):
        raise ConfigError(f"output_gate_type: silu or sigmoid (the linear layers' output gate), got {gate!r}")
    base = qwen3_5_moe_fields({"num_experts": 512, "num_experts_per_tok": 10, **cfg, "layer_types": kinds},
                              num_layers)
    base["gated_delta"] = replace(base["gated_delta"], gate_act=gate)
    rotary = int(read_int(cfg, "head_dim") * partial_rotary_factor(cfg, 1.0))
    return {**base, "partial_rotary_factor": partial_rotary_factor(cfg, 1.0),
            "norm_topk_prob": read_bool(cfg, "norm_topk_prob", True),
            "qwen4_exp": _shape(cfg, kinds), "block_indexer": _qsa(cfg, kinds, rotary)}


def _shape(cfg: dict[str, Any], kinds: list[str]) -> Qwen4ExpShape:
    streams = read_int(cfg, "hc_count", 4)
    if streams < 2:
        raise ConfigError(f"hc_count: Qwen4-Exp's residual has 2 streams or more, got {streams}")
    ple = cfg.get("ple_layer_ids") or []
    if not isinstance(ple, list) or any(not isinstance(i, int) or isinstance(i, bool) or not 1 <= i <= len(kinds)
                                        or kinds[i - 1] != "linear_attention" for i in ple):
        raise ConfigError(f"ple_layer_ids: one-indexed ids of linear_attention layers (1 .. {len(kinds)}), got "
                          f"{ple!r:.80}")
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if ple and (not isinstance(eos, int) or isinstance(eos, bool)):
        raise ConfigError(f"eos_token_id: PLE layers cut their n-grams at it, so it must be set, got {eos!r}")
    shape = Qwen4ExpShape(streams=streams, lowrank=read_int(cfg, "hc_lowrank", 320), ple_layers=tuple(sorted(
        {i - 1 for i in ple})), ple_dim=read_int(cfg, "ple_embed_dim", read_int(cfg, "hidden_size")),
        ple_kernel=read_int(cfg, "ple_conv_kernel_size", 4), ngram=read_int(cfg, "ngram_size", 3),
        heads_per_ngram=read_int(cfg, "heads_per_ngram", 8), vocab_base=read_int(cfg, "ngram_vocab_size_base",
                                                                                20_000_000),
        vocab_multiple=read_int(cfg, "make_ngram_vocab_size_divisible_by", 128),
        seed=read_int(cfg, "seed", 1234, minimum=0), eos=eos if ple else 0,
        shard_parts=read_int(cfg, "split_ngram_parts", 512))
    if shape.ple_layers and (shape.ngram < 2 or shape.ple_dim % shape.ngram_heads):
        raise ConfigError(f"ple_embed_dim: a multiple of the n-gram heads ((ngram_size - 1) x heads_per_ngram = "
                          f"{shape.ngram_heads}), got {shape.ple_dim}")
    if shape.ple_layers and read_int(cfg, "vocab_size") >= 1 << 24:
        raise ConfigError(f"vocab_size: PLE layers keep token ids in float32 state, exact below 2^24, got "
                          f"{cfg['vocab_size']}")
    return shape


def _qsa(cfg: dict[str, Any], kinds: list[str], rotary_dim: int) -> QsaIndexer:
    """QSA's indexer: every key named (transformers builds an indexer on every attention layer), one key head, a
    budget of whole blocks, the rotary within the indexer's heads."""
    missing = [key for key in _QSA_KEYS if cfg.get(key) is None]
    if missing:
        raise ConfigError(f"{missing[0]}: Qwen4-Exp's attention layers select tokens by QSA, which needs "
                          f"{', '.join(_QSA_KEYS)}")
    values = {key: read_int(cfg, key) for key in _QSA_KEYS}
    if values["indexer_kv_heads"] != 1:
        raise ConfigError(f"indexer_kv_heads: QSA has one key head, got {values['indexer_kv_heads']}")
    ratio, budget = values["indexer_compress_ratio"], values["indexer_budget"]
    if budget % ratio:
        raise ConfigError(f"indexer_budget: a multiple of indexer_compress_ratio ({ratio}), got {budget}")
    if rotary_dim > values["indexer_head_dim"]:
        raise ConfigError(f"indexer_head_dim: the rotary turns {rotary_dim} dimensions of each indexer head, got "
                          f"{values['indexer_head_dim']}")
    return QsaIndexer(layers=tuple(i for i, kind in enumerate(kinds) if kind == "full_attention"),
                      num_heads=values["indexer_n_heads"], head_dim=values["indexer_head_dim"], block_size=ratio,
                      topk_blocks=budget // ratio, local_blocks=0)
