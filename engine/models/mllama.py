"""Meta's Llama 3.2 Vision (`MllamaForConditionalGeneration`: Llama-3.2-11B-Vision, -90B, their Instruct releases)
served as its text model (`MllamaForCausalLM`). Its text model is Llama 3.1's with cross-attention layers among the
others (`cross_attention_layers`: every 5th from the 4th, 8 of 40 in the 11B), which attend to an image's tiles and
nothing else; on text transformers skips them (no image states, none cached), and so does the engine: it holds the
self-attention layers alone, numbered as read (the 11B's text model is Llama 3.1 8B's shape), and reads none of the
cross layers' tensors. Its embedding table has 8 rows past the vocabulary (the image token's and seven more): input
only, so the head is pruned to the vocabulary (`PrunedHeadForCausalLM`, `ModelConfig.output_vocab_size`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.models.apertus import PrunedHeadForCausalLM

__all__ = ["MllamaForCausalLM"]


class MllamaForCausalLM(PrunedHeadForCausalLM):
    """Llama 3.2 Vision's text model (see the module docstring): the checkpoint's layer i is the engine's layer i
    less the cross-attention layers before it (`ModelConfig.skipped_layers`); theirs are not read."""

    def read_tensor(self, hf_name: str, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        parts = name.split(".", 2)
        if parts[0] != "layers" or len(parts) < 3 or not parts[1].isdigit():
            return ((name, tensor),)
        index, skipped = int(parts[1]), self.config.skipped_layers
        if index in skipped:
            return ()
        return ((f"layers.{index - sum(s < index for s in skipped)}.{parts[2]}", tensor),)
