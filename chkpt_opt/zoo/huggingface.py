"""Hugging Face models built from configs with random weights (nothing is downloaded).

Each builder returns ``(model, args, kwargs)`` like :mod:`chkpt_opt.zoo`: ``model`` is a
:class:`LossOf` wrapper in train mode whose forward returns the model's training loss, so
one step is exactly ``loss.backward()``; ``model.hf`` is the Hugging Face model itself
(for ``gradient_checkpointing_enable()``). The command line takes them as model specs,
e.g. ``chkpt_opt.zoo.huggingface:llama``. Requires ``transformers``.

Families: a decoder with RoPE, grouped-query attention and RMSNorm (Llama), GPT-2, an
encoder (BERT), an encoder-decoder (T5), a vision transformer (ViT) and a mixture of
experts (Mixtral). Sizes default to 6 layers of width 256 and batches of 4 x 256 tokens
(4 images of 224 x 224 for ViT); every builder takes ``layers``, ``width``, ``batch`` and
``seq``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from chkpt_opt.zoo.common import Built

VOCAB = 2048


class LossOf(nn.Module):
    """Calls a Hugging Face model with keyword inputs and returns its ``loss``.

    Attributes:
        hf: the wrapped model.
        names: the keyword names of the positional inputs, in order.
    """

    def __init__(self, hf: nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.hf = hf
        self.names = names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.hf(**dict(zip(self.names, inputs)), use_cache=False).loss


class EncoderLossOf(LossOf):
    """:class:`LossOf` for models that take no ``use_cache`` (encoders, vision models)."""

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.hf(**dict(zip(self.names, inputs))).loss


def _tokens(batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    return ids, labels


def _built(
    make: Callable[[], nn.Module],
    wrap: type[LossOf],
    names: tuple[str, ...],
    inputs: tuple[torch.Tensor, ...],
    seed: int,
) -> Built:
    torch.manual_seed(seed)
    hf = make()
    hf.config._attn_implementation = "sdpa"
    return wrap(hf, names).train(), inputs, {}


def llama(
    *, layers: int = 6, width: int = 256, batch: int = 4, seq: int = 256, seed: int = 0
) -> Built:
    """LlamaForCausalLM: RoPE, grouped-query attention (4 heads, 2 key/value heads),
    RMSNorm, SwiGLU, SDPA."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        attn_implementation="sdpa",
    )
    return _built(
        lambda: transformers.LlamaForCausalLM(config),
        LossOf,
        ("input_ids", "labels"),
        _tokens(batch, seq, seed),
        seed,
    )


def gpt2(
    *, layers: int = 6, width: int = 256, batch: int = 4, seq: int = 256, seed: int = 0
) -> Built:
    """GPT2LMHeadModel (4 heads, dropout as configured by default)."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=width,
        n_layer=layers,
        n_head=4,
        n_positions=seq,
        attn_implementation="sdpa",
    )
    return _built(
        lambda: transformers.GPT2LMHeadModel(config),
        LossOf,
        ("input_ids", "labels"),
        _tokens(batch, seq, seed),
        seed,
    )


def bert(
    *, layers: int = 6, width: int = 256, batch: int = 4, seq: int = 256, seed: int = 0
) -> Built:
    """BertForMaskedLM (an encoder; 4 heads)."""
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=seq,
        attn_implementation="sdpa",
    )
    return _built(
        lambda: transformers.BertForMaskedLM(config),
        EncoderLossOf,
        ("input_ids", "labels"),
        _tokens(batch, seq, seed),
        seed,
    )


def t5(
    *, layers: int = 6, width: int = 256, batch: int = 4, seq: int = 256, seed: int = 0
) -> Built:
    """T5ForConditionalGeneration (an encoder-decoder): ``layers`` split evenly between
    the encoder and the decoder."""
    import transformers

    half = max(1, layers // 2)
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=width,
        d_kv=width // 4,
        d_ff=4 * width,
        num_layers=half,
        num_decoder_layers=half,
        num_heads=4,
        decoder_start_token_id=0,
    )
    return _built(
        lambda: transformers.T5ForConditionalGeneration(config),
        LossOf,
        ("input_ids", "labels"),
        _tokens(batch, seq, seed),
        seed,
    )


def vit(
    *, layers: int = 6, width: int = 256, batch: int = 4, seq: int = 224, seed: int = 0
) -> Built:
    """ViTForImageClassification on ``seq`` x ``seq`` images, patches of 16 (a vision
    transformer; 10 classes)."""
    import transformers

    config = transformers.ViTConfig(
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        image_size=seq,
        patch_size=16,
        num_labels=10,
        attn_implementation="sdpa",
    )
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, seq, seq, generator=gen)
    labels = torch.randint(0, 10, (batch,), generator=gen)
    return _built(
        lambda: transformers.ViTForImageClassification(config),
        EncoderLossOf,
        ("pixel_values", "labels"),
        (images, labels),
        seed,
    )


def mixtral(
    *, layers: int = 6, width: int = 256, batch: int = 4, seq: int = 256, seed: int = 0
) -> Built:
    """MixtralForCausalLM: a mixture of experts (4 experts, 2 per token) on a Llama-style
    decoder."""
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=seq,
        attn_implementation="sdpa",
    )
    return _built(
        lambda: transformers.MixtralForCausalLM(config),
        LossOf,
        ("input_ids", "labels"),
        _tokens(batch, seq, seed),
        seed,
    )


FAMILIES: dict[str, Callable[..., Built]] = {
    "llama": llama,
    "gpt2": gpt2,
    "bert": bert,
    "t5": t5,
    "vit": vit,
    "mixtral": mixtral,
}


LLAMA2_SIZES: dict[str, dict[str, int]] = {
    "7b": {"hidden_size": 4096, "intermediate_size": 11008, "layers": 32, "heads": 32, "kv": 32},
    "70b": {"hidden_size": 8192, "intermediate_size": 28672, "layers": 80, "heads": 64, "kv": 8},
}
"""The Llama 2 configurations (vocabulary 32000) planned on the meta device."""


def llama2_meta(
    size: str = "7b", *, batch: int = 2, seq: int = 4096, layers: int | None = None
) -> Built:
    """A Llama 2 of ``size`` (``"7b"``, ``"70b"``) on the meta device in bf16: no weights
    are allocated, so a plan of the real size costs host memory for its graph alone. The
    inputs are one rank's local batch of ``batch`` x ``seq`` tokens (loss inside)."""
    import transformers

    shape = LLAMA2_SIZES[size]
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=layers or shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"],
        max_position_embeddings=seq,
        attn_implementation="sdpa",
        use_cache=False,
    )
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return LossOf(hf, ("input_ids", "labels")).train(), (ids, ids), {}


def llama2_7b_meta() -> Built:
    """Model spec: :func:`llama2_meta` ``("7b")``, a local batch of 2 x 4096 tokens."""
    return llama2_meta("7b")


def llama2_70b_meta() -> Built:
    """Model spec: :func:`llama2_meta` ``("70b")``, a local batch of 1 x 4096 tokens."""
    return llama2_meta("70b", batch=1)
