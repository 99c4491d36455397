"""ERNIE 4.5's dense models (`Ernie4_5ForCausalLM`): the Llama layer, with biases on every projection where
`use_bias` (q/k/v/o and the MLP's) and a rotary that pairs dimensions 2i and 2i + 1 (GPT-J's interleaved form),
served as Cohere's is: each q and k head's rows reordered evens first as the weights are read
(`engine.models.cohere.InterleavedRotaryWeights`), so the engine's rotary rotates the same pairs and q.k is
unchanged. The layer being Llama's, the CPU's flat loop runs it.
"""

from __future__ import annotations

from engine.models.cohere import InterleavedRotaryWeights

__all__ = ["Ernie45ForCausalLM"]


class Ernie45ForCausalLM(InterleavedRotaryWeights):
    """The Llama model with ERNIE 4.5's q/k rows reordered as read (see the module docstring)."""
