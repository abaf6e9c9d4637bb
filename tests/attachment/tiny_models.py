"""Small Hugging Face models built from configs with random weights, for the attachment
tests (nothing downloaded)."""

from __future__ import annotations

from typing import Any

import torch


def tiny_llama(
    *, vocab: int, layers: int, intermediate: int = 160, max_positions: int = 256
) -> Any:
    """A Llama of width 64 (4 heads, 2 key/value heads) from its config as it ships
    (``use_cache=True``), seeded, in training mode."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()
