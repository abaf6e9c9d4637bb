"""Reference models in plain PyTorch, with example inputs, for tests, examples and benchmarks.

Every builder returns ``(model, example_args, example_kwargs)`` with random weights
(seeded); the command line takes such a builder as a model spec, e.g. ``chkpt_opt.zoo:gpt``.

Example:
    >>> model, args, kwargs = gpt(n_layer=2, d_model=64, n_head=4, seq_len=32, batch=2)
    >>> model(*args, **kwargs).shape
    torch.Size([])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Built = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


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


class BasicBlock(nn.Module):
    """ResNet basic block with batch norm and in-place ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.down: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + self.down(x))


class ResNet(nn.Module):
    """A ResNet of basic blocks; returns the classification loss."""

    def __init__(self, *, widths: tuple[int, ...], blocks_per_stage: int, n_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        )
        layers: list[nn.Module] = []
        c = widths[0]
        for i, w in enumerate(widths):
            for j in range(blocks_per_stage):
                layers.append(BasicBlock(c, w, 2 if (j == 0 and i > 0) else 1))
                c = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(c, n_classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        y = self.layers(self.stem(x))
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))
        return F.cross_entropy(logits, labels)


def resnet(
    *,
    widths: tuple[int, ...] = (32, 64, 128),
    blocks_per_stage: int = 2,
    image: int = 64,
    batch: int = 16,
    n_classes: int = 10,
    seed: int = 0,
) -> Built:
    """A residual CNN with batch norm (ResNet-18 style stages)."""
    torch.manual_seed(seed)
    model = ResNet(widths=widths, blocks_per_stage=blocks_per_stage, n_classes=n_classes)
    x = torch.randn(batch, 3, image, image)
    labels = torch.randint(0, n_classes, (batch,))
    return model.train(), (x, labels), {}


def _conv_bn(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """A U-Net: an encoder, a decoder, and long skip connections between them."""

    def __init__(self, *, base: int, depth: int) -> None:
        super().__init__()
        chans = [base * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList()
        c = 3
        for w in chans[:-1]:
            self.down.append(_conv_bn(c, w))
            c = w
        self.mid = _conv_bn(c, chans[-1])
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        for w in reversed(chans[:-1]):
            self.up.append(nn.ConvTranspose2d(w * 2, w, 2, stride=2))
            self.dec.append(_conv_bn(w * 2, w))
        self.out = nn.Conv2d(chans[0], 1, 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.mid(x)
        for up, dec in zip(self.up, self.dec):
            x = dec(torch.cat([up(x), skips.pop()], dim=1))
        return F.mse_loss(self.out(x), target)


def unet(
    *, base: int = 16, depth: int = 3, image: int = 64, batch: int = 4, seed: int = 0
) -> Built:
    """A U-Net-like network with long skip connections and batch norm."""
    torch.manual_seed(seed)
    model = UNet(base=base, depth=depth)
    x = torch.randn(batch, 3, image, image)
    target = torch.randn(batch, 1, image, image)
    return model.train(), (x, target), {}


class MLP(nn.Module):
    """A plain chain of linear layers (a homogeneous chain)."""

    def __init__(self, *, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).pow(2).mean()


def mlp(*, width: int = 256, depth: int = 16, batch: int = 64, seed: int = 0) -> Built:
    """A chain: ``depth`` linear+tanh layers."""
    torch.manual_seed(seed)
    return MLP(width=width, depth=depth).train(), (torch.randn(batch, width),), {}


def vgg(
    *,
    widths: tuple[int, ...] = (16, 32, 64),
    convs_per_stage: int = 2,
    image: int = 32,
    batch: int = 8,
    n_classes: int = 10,
    seed: int = 0,
) -> Built:
    """A VGG-like chain: stages of 3x3 conv + ReLU, max-pooling between stages."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    c = 3
    for w in widths:
        for _ in range(convs_per_stage):
            layers += [nn.Conv2d(c, w, 3, padding=1), nn.ReLU()]
            c = w
        layers.append(nn.MaxPool2d(2))
    side = image // 2 ** len(widths)
    model = _Classifier(nn.Sequential(*layers), nn.Linear(c * side * side, n_classes))
    return (
        model.train(),
        (torch.randn(batch, 3, image, image), torch.randint(0, n_classes, (batch,))),
        {},
    )


class _Classifier(nn.Module):
    def __init__(self, features: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.features = features
        self.head = head

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(torch.flatten(self.features(x), 1)), labels)


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand, 3x3 depthwise, 1x1 project, ReLU6, batch norm."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = c_in * expand
        self.use_res = stride == 1 and c_in == c_out
        self.block = nn.Sequential(
            nn.Conv2d(c_in, hidden, 1, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, c_out, 1, bias=False),
            nn.BatchNorm2d(c_out),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.use_res else y


def mobilenet(
    *,
    widths: tuple[int, ...] = (16, 24, 32),
    blocks_per_stage: int = 2,
    expand: int = 4,
    image: int = 32,
    batch: int = 8,
    n_classes: int = 10,
    seed: int = 0,
) -> Built:
    """A MobileNetV2-like network of inverted residual blocks with depthwise convolutions."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [
        nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
        nn.BatchNorm2d(widths[0]),
        nn.ReLU6(inplace=True),
    ]
    c = widths[0]
    for i, w in enumerate(widths):
        for j in range(blocks_per_stage):
            layers.append(InvertedResidual(c, w, 2 if (j == 0 and i > 0) else 1, expand))
            c = w
    layers += [nn.AdaptiveAvgPool2d(1)]
    model = _Classifier(nn.Sequential(*layers), nn.Linear(c, n_classes))
    return (
        model.train(),
        (torch.randn(batch, 3, image, image), torch.randint(0, n_classes, (batch,))),
        {},
    )


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


def n_params(model: nn.Module) -> int:
    """Number of parameters."""
    return sum(p.numel() for p in model.parameters())


def param_mib(model: nn.Module) -> float:
    """Parameter memory in MiB."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


__all__ = [
    "encoder",
    "gpt",
    "hf_gpt2",
    "mlp",
    "mobilenet",
    "n_params",
    "param_mib",
    "resnet",
    "unet",
    "vgg",
    "vit",
]
