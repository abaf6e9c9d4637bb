"""Transformers: the GPT-style decoder, the BERT-like encoder, the ViT, Hugging Face GPT-2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from chkpt_opt.zoo.common import Built


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)
        self.n_head = n_head
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.drop(self.proj(y))


class Block(nn.Module):
    """Pre-norm transformer block (GPT-2 layout)."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.fc2(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """A GPT-style decoder returning the mean cross-entropy loss of next-token prediction."""

    def __init__(
        self, *, vocab: int, n_layer: int, d_model: int, n_head: int, seq_len: int, dropout: float
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def gpt(
    *,
    n_layer: int = 8,
    d_model: int = 256,
    n_head: int = 4,
    seq_len: int = 256,
    batch: int = 8,
    vocab: int = 2048,
    dropout: float = 0.1,
    seed: int = 0,
) -> Built:
    """The GPT-style reference model (8 layers, d_model 256, 4 heads, seq 256, batch 8)."""
    torch.manual_seed(seed)
    model = GPT(
        vocab=vocab,
        n_layer=n_layer,
        d_model=d_model,
        n_head=n_head,
        seq_len=seq_len,
        dropout=dropout,
    )
    idx = torch.randint(0, vocab, (batch, seq_len))
    targets = torch.randint(0, vocab, (batch, seq_len))
    return model.train(), (idx, targets), {}


class EncoderBlock(nn.Module):
    """Bidirectional (BERT-style, post-norm) transformer encoder block."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln1 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c)
        x = self.ln1(x + self.drop(self.proj(y)))
        return self.ln2(x + self.drop(self.fc2(F.gelu(self.fc(x)))))


class Encoder(nn.Module):
    """A BERT-like encoder with a token-classification loss."""

    def __init__(
        self, *, vocab: int, n_layer: int, d_model: int, n_head: int, seq_len: int, dropout: float
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        self.blocks = nn.ModuleList(EncoderBlock(d_model, n_head, dropout) for _ in range(n_layer))
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def encoder(
    *,
    n_layer: int = 4,
    d_model: int = 128,
    n_head: int = 4,
    seq_len: int = 128,
    batch: int = 8,
    vocab: int = 1024,
    dropout: float = 0.1,
    seed: int = 0,
) -> Built:
    """A BERT-like bidirectional transformer encoder."""
    torch.manual_seed(seed)
    model = Encoder(
        vocab=vocab,
        n_layer=n_layer,
        d_model=d_model,
        n_head=n_head,
        seq_len=seq_len,
        dropout=dropout,
    )
    idx = torch.randint(0, vocab, (batch, seq_len))
    return model.train(), (idx, torch.randint(0, vocab, (batch, seq_len))), {}


class ViT(nn.Module):
    """A vision transformer: patch embedding, class token, pre-norm blocks, linear head."""

    def __init__(
        self,
        *,
        image: int,
        patch: int,
        n_layer: int,
        d_model: int,
        n_head: int,
        n_classes: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, d_model, patch, stride=patch)
        n_patches = (image // patch) ** 2
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos = nn.Parameter(torch.zeros(1, n_patches + 1, d_model))
        self.blocks = nn.ModuleList(
            _BidirectionalBlock(d_model, n_head, dropout) for _ in range(n_layer)
        )
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln(x[:, 0])), labels)


class _BidirectionalBlock(Block):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__(d_model, n_head, dropout)
        self.attn = _BidirectionalAttention(d_model, n_head, dropout)


class _BidirectionalAttention(CausalSelfAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


def vit(
    *,
    image: int = 32,
    patch: int = 4,
    n_layer: int = 4,
    d_model: int = 128,
    n_head: int = 4,
    batch: int = 8,
    n_classes: int = 10,
    dropout: float = 0.1,
    seed: int = 0,
) -> Built:
    """A ViT for small images."""
    torch.manual_seed(seed)
    model = ViT(
        image=image,
        patch=patch,
        n_layer=n_layer,
        d_model=d_model,
        n_head=n_head,
        n_classes=n_classes,
        dropout=dropout,
    )
    return (
        model.train(),
        (torch.randn(batch, 3, image, image), torch.randint(0, n_classes, (batch,))),
        {},
    )


def hf_gpt2(
    *,
    n_layer: int = 2,
    d_model: int = 128,
    n_head: int = 4,
    seq_len: int = 64,
    batch: int = 2,
    vocab: int = 1000,
    seed: int = 0,
) -> Built:
    """Hugging Face GPT-2 built from a config with random weights (needs ``transformers``).

    Nothing is downloaded. ``use_cache=False`` since a training step needs no KV cache.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=seq_len,
        n_embd=d_model,
        n_layer=n_layer,
        n_head=n_head,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, vocab, (batch, seq_len))
    return model, (), {"input_ids": ids, "labels": ids}
