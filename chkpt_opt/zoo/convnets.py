"""Convolutional networks: ResNet, U-Net, VGG and MobileNetV2 in the style of each."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from chkpt_opt.zoo.common import Built


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
