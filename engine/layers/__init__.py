"""The decoder layer's shared pieces: RMSNorm with the residual add fused (Llama's, OLMo 2's and Gemma's; Jais 2's
LayerNorm too),
per-head q/k norms, rotary embedding from a precomputed cos/sin cache, SiLU x mul, GELU-tanh x mul and GPT-OSS's
clamped SwiGLU; Llama's run
the Triton kernels or the torch versions they are given (`kernels.fused.get_fused_ops`)."""

from engine.layers.activation import ClampedSwiGLU, GeluTanhAndMul, SiluAndMul
from engine.layers.norm import BiasLayerNorm, FloatRMSNorm, GemmaHeadRMSNorm, GemmaRMSNorm, HeadRMSNorm, RMSNorm
from engine.layers.rotary import RopeRows, RotaryEmbedding

__all__ = ["BiasLayerNorm", "ClampedSwiGLU", "FloatRMSNorm", "GeluTanhAndMul", "GemmaHeadRMSNorm", "GemmaRMSNorm",
           "HeadRMSNorm", "RMSNorm", "RopeRows", "RotaryEmbedding", "SiluAndMul"]
