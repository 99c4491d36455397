"""The decoder layer's shared pieces: RMSNorm with the residual add fused, rotary embedding from a
precomputed cos/sin cache, SiLU x mul; each runs the Triton kernels or the torch versions it is given
(`kernels.fused.get_fused_ops`)."""

from engine.layers.activation import SiluAndMul
from engine.layers.norm import HeadRMSNorm, RMSNorm
from engine.layers.rotary import RopeRows, RotaryEmbedding

__all__ = ["HeadRMSNorm", "RMSNorm", "RopeRows", "RotaryEmbedding", "SiluAndMul"]
