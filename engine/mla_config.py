"""DeepSeek's multi-head latent attention as a config.json gives it (`MlaShape`, `read_mla`): DeepSeek V2's and V3's
(Kimi K2's, DeepSeek-R1's), GLM-4.7-Flash's (`Glm4MoeLiteForCausalLM`), Mistral Small 4's, and DeepSeek V3.2's with
its sparse attention's indexer (A.X-K2's with a gate on each head's output), each family's defaults its transformers
config class's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import ConfigError
from engine.config_values import read_bool, read_int

# one entry of a sparse attention's top-k in a decode graph: its float32 score, int64 position, bool and int8 masks
TOPK_ENTRY_BYTES = 4 + 8 + 1 + 1

# each family's latent shape where config.json names none: (q_lora_rank, kv_lora_rank, qk_nope_head_dim,
# qk_rope_head_dim, v_head_dim)
MLA_DEFAULTS = {"DeepseekV2ForCausalLM": (1536, 512, 128, 64, 128), "DeepseekV3ForCausalLM": (1536, 512, 128, 64, 128),
                "Mistral4ForCausalLM": (1024, 256, 64, 64, 128),
                "Glm4MoeLiteForCausalLM": (768, 512, 192, 64, 256),
                "DeepseekV32ForCausalLM": (1536, 512, 128, 64, 128), "GlmMoeDsaForCausalLM": (2048, 512, 192, 64, 256),
                "AXK1ForCausalLM": (1536, 512, 128, 64, 128), "AXK2ForCausalLM": (384, 128, 64, 32, 64),
                "HYV4ForCausalLM": (1536, 512, 192, 64, 256)}
# DeepSeek V3.2's, GLM-5's, A.X-K2's and HY V4's indexer where config.json names none: (index_n_heads, index_head_dim,
# index_topk)
DSA_DEFAULTS = {"DeepseekV32ForCausalLM": (64, 128, 2048), "GlmMoeDsaForCausalLM": (32, 128, 2048),
                "AXK2ForCausalLM": (16, 128, 2048), "HYV4ForCausalLM": (16, 128, 2048)}


@dataclass(frozen=True)
class MlaShape:
    """DeepSeek's multi-head latent attention: queries through a `q_lora_rank` bottleneck (0: one projection),
    keys and values from one latent of `kv_lora_rank` per token, which with the token's rotated `qk_rope_head_dim`
    key is all the cache holds (`engine.models.deepseek`); each head's q.k over `qk_nope_head_dim` +
    `qk_rope_head_dim` dimensions, its value `v_head_dim`. `rope_interleave`: the checkpoint's rotary pairs are
    (2i, 2i + 1) (DeepSeek's own; the rows are reordered as they are read).

    DeepSeek V3.2's sparse attention (`index_topk` > 0): an indexer of `index_heads` heads of `index_head_dim` scores
    every earlier token by one key of `index_head_dim` a token, and each query attends to its `index_topk` best; that
    key is kept in the cache beside the latent (`cache_dim` = `latent_dim` + `index_head_dim`). GLM-5's: the layers
    of `index_shared` have no indexer and reuse the last earlier one's choice (their rows' indexer part zeros), and
    its rotary turns interleaved pairs (`index_rope_interleave`: its rows reordered as read)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0   # 0: no indexer, every query attends to every earlier token
    index_shared: tuple[int, ...] = ()
    index_rope_interleave: bool = False
    q_gate: bool = False        # A.X-K2: q and a gate on each head's output, one projection of [normed, raw] q
    gated_norm_rank: int = 0    # A.X-K2: its norms' sigmoid gate through a bottleneck of this rank (0: plain norms)
    latent_norm_eps: float | None = None   # HY4-VL's text model: q's and the latent's norms at it (None: 1e-6)

    @property
    def latent_dim(self) -> int:
        """What attention reads of a token's cache row: its latent and its rotated key (576 for DeepSeek V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """What a token leaves in the cache: `latent_dim`, and the indexer's key where there is one (704 for V3.2)."""
        return self.latent_dim + self.index_head_dim

    def graph_scores_bytes(self, max_len: int) -> int:
        """A decode token's bytes in a sparse regime's CUDA graphs (`engine.cuda_graphs.capture_lengths`, graphs of
        sequences of up to `max_len`): the indexer's float32 score of every position, the top-k's values and positions
        and its two masks; 0 without an indexer or where `max_len` is within the dense regime."""
        return 4 * max_len + self.index_topk * TOPK_ENTRY_BYTES if 0 < self.index_topk < max_len else 0

    def num_params(self, hidden: int, heads: int, bias: bool) -> int:
        """One layer's attention with `heads` query heads: q (through its bottleneck and norm, or one projection),
        the latent's projection and norm (whole on every rank), the latent's per-head up-projection, o_proj."""
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        r, latent = self.q_lora_rank, self.kv_lora_rank
        q = hidden * r + r + r * heads * qk if r else hidden * heads * qk
        q += r * heads * (qk + 2 * self.v_head_dim) if self.q_gate else 0   # A.X-K2's: from 2r, a gate beside
        kv = hidden * self.latent_dim + latent + latent * heads * (self.qk_nope_head_dim + self.v_head_dim)
        biases = (r + self.latent_dim + hidden) if bias else 0   # q_a, kv_a and o_proj's (DeepSeek's attention_bias)
        return q + kv + heads * self.v_head_dim * hidden + biases

    def indexers_params(self, hidden: int, num_layers: int, sparse_layers: int = 0) -> int:
        """The indexers' of all `num_layers` layers (whole on every rank): each one's query from q's bottleneck, its
        key (and the key's LayerNorm), its heads' weights (`weights_proj`, float32: `num_indexer_weights`); and A.X-K2's
        norms' gates (each a bottleneck of `gated_norm_rank` and back): every layer's input norm's, and the norm's
        before each of the `sparse_layers`' experts."""
        d = self.index_head_dim
        gates = 2 * hidden * self.gated_norm_rank * (num_layers + sparse_layers)
        return (num_layers - len(self.index_shared)) * (self.q_lora_rank * self.index_heads * d + hidden * d + 2 * d) \
            + self.num_indexer_weights(hidden, num_layers) + gates

    def num_indexer_weights(self, hidden: int, num_layers: int) -> int:
        """The indexers' head weights (float32 whatever the model's dtype)."""
        return (num_layers - len(self.index_shared)) * hidden * self.index_heads if self.index_head_dim else 0


def read_mla(cfg: dict[str, Any], defaults: tuple[int, int, int, int, int], interleave_key: bool,
             dsa: tuple[int, int, int] | None = None, **indexer: Any) -> MlaShape:
    """The latent shape config.json gives (`defaults`: its family's, `MLA_DEFAULTS`); `q_lora_rank` null: one q
    projection (DeepSeek-V2-Lite); `rope_interleave` read where `interleave_key` (V3's and GLM's), else True; the
    indexer's `index_n_heads`, `index_head_dim` and `index_topk` where `dsa` (their defaults, `DSA_DEFAULTS`), and
    `indexer` (GLM-5's `index_shared`, `index_rope_interleave`) as given."""
    q_lora, latent, nope, rope, v = defaults
    heads, head_dim, topk = dsa or (0, 0, 0)
    mla = MlaShape(q_lora_rank=0 if "q_lora_rank" in cfg and cfg["q_lora_rank"] is None else
                   read_int(cfg, "q_lora_rank", q_lora),
                   kv_lora_rank=read_int(cfg, "kv_lora_rank", latent),
                   qk_nope_head_dim=read_int(cfg, "qk_nope_head_dim", nope),
                   qk_rope_head_dim=read_int(cfg, "qk_rope_head_dim", rope),
                   v_head_dim=read_int(cfg, "v_head_dim", v),
                   rope_interleave=read_bool(cfg, "rope_interleave", True) if interleave_key else True,
                   index_heads=read_int(cfg, "index_n_heads", heads) if dsa else 0,
                   index_head_dim=read_int(cfg, "index_head_dim", head_dim) if dsa else 0,
                   index_topk=read_int(cfg, "index_topk", topk) if dsa else 0, **indexer)
    if mla.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim: must be even for rotary embeddings, got {mla.qk_rope_head_dim}")
    if dsa and mla.index_head_dim < mla.qk_rope_head_dim:
        raise ConfigError(f"index_head_dim: the indexer rotates qk_rope_head_dim ({mla.qk_rope_head_dim}) of its "
                          f"heads, got {mla.index_head_dim}")
    if dsa and not mla.q_lora_rank:
        raise ConfigError("q_lora_rank: DeepSeek V3.2's indexer reads q's bottleneck, got null")
    return mla
