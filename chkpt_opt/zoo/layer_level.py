"""Layer-level training graphs of conv nets, built from layer shapes in pure Python.

One node per layer, the granularity at which Checkmate, Moccasin and rotor report: a
convolution with its bias and ReLU is one node, and so are a max-pool, an unpool, an
upsample, a concat, a skip addition, a fully connected layer and the loss. The networks:
VGG16 and VGG19 (chains), FCN-8 (VGG16 with the pool3 and pool4 skips to the upsampling
head), SegNet (VGG16 encoder, its pooling indices kept until the decoder's unpool) and a
U-Net with a VGG-style encoder (skips concatenated in the decoder).

What each node saves is what PyTorch's autograd saves for the fused layer, activations only
(weights are parameters, counted in the graph's ``param_bytes``):

=================  =======================================================================
conv + bias + ReLU  the conv's input and the ReLU's output (the last conv of a head, which
                    has no ReLU: its input only)
max-pool           its input and its indices (int64, a buffer the node owns,
                    ``"<node>:buf0"``); SegNet's unpool saves those indices too
unpool             the indices of its pool (it reads them: no edge from the pool, whose
                    pooled output it does not read)
upsample, concat,  nothing
addition
transposed conv    its input
linear (+ ReLU)    its input (and its output with the ReLU)
loss               its log-softmax (a buffer the size of the logits)
=================  =======================================================================

FLOPs come from the shapes (a multiply-add is two); times are FLOPs over
:data:`FLOPS_PER_S`, as the synthetic graphs derive theirs. Everything is fp32 and
deterministic.

Example:
    >>> g = vgg16_layers(batch=2, image=32, n_classes=10)
    >>> g.number_of_nodes(), g.graph["outputs"]
    (22, ['loss'])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from chkpt_opt.graphs.costgraph import CostGraph, check_graph, new_graph, node_attrs

FLOPS_PER_S = 1e12
"""Throughput that turns FLOPs into seconds (one TFLOP/s for every layer)."""

FLOAT_BYTES = 4
INDEX_BYTES = 8

VGG16_STAGES = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512))
VGG19_STAGES = ((64, 64), (128, 128), (256,) * 4, (512,) * 4, (512,) * 4)

Shape = tuple[int, int, int]
"""(channels, height, width) of one sample."""


@dataclass
class _Net:
    """A layer graph under construction: its nodes, their shapes and the parameters."""

    name: str
    batch: int
    graph: CostGraph = field(init=False)
    shapes: dict[str, Shape] = field(default_factory=dict)
    param_bytes: int = 0
    largest_param_bytes: int = 0
    n_tensors: int = 0

    def __post_init__(self) -> None:
        self.graph = new_graph(self.name, tracer="layer-level", cost_model="flops/1e12")

    def nbytes(self, shape: Shape, element_bytes: int = FLOAT_BYTES) -> int:
        channels, height, width = shape
        return self.batch * channels * height * width * element_bytes

    def elements(self, shape: Shape) -> int:
        return self.nbytes(shape, 1)

    def add(
        self,
        name: str,
        op: str,
        inputs: list[str],
        shape: Shape,
        *,
        fwd_flops: int,
        bwd_flops: int,
        saved_inputs: tuple[str, ...] = (),
        save_output: bool = False,
        buffers: tuple[int, ...] = (),
        saved_extra: tuple[str, ...] = (),
        weights: tuple[int, ...] = (),
        module_path: str = "",
        out_bytes: int | None = None,
    ) -> str:
        """Adds one layer reading ``inputs``; returns its name.

        ``saved_inputs`` are inputs whose outputs the layer saves, ``buffers`` the bytes of
        buffers it owns and saves, ``saved_extra`` earlier storages it saves and reads
        without an edge, ``weights`` the element counts of its parameters.
        """
        out_bytes = self.nbytes(shape) if out_bytes is None else out_bytes
        saved: dict[str, int] = {}
        for u in saved_inputs:
            if u in self.graph:  # the network's input is resident, not a storage
                saved.update(self.graph.nodes[u]["outputs"])
        for sid in saved_extra:
            owner = sid.split(":")[0]
            saved[sid] = self.graph.nodes[owner]["saved"][sid]
        if save_output:
            saved[name] = out_bytes
        for k, nbytes in enumerate(buffers):
            saved[f"{name}:buf{k}"] = nbytes
        weight_bytes = [FLOAT_BYTES * w for w in weights]
        self.param_bytes += sum(weight_bytes)
        self.largest_param_bytes = max([self.largest_param_bytes, *weight_bytes])
        self.n_tensors += len(weights)
        first = not any(u in self.graph for u in inputs)
        bwd_flops = bwd_flops // 2 if first else bwd_flops  # no gradient for the input
        self.graph.add_node(
            name,
            **node_attrs(
                index=self.graph.number_of_nodes(),
                op=op,
                outputs={name: out_bytes},
                saved=saved,
                n_saved=len(saved) + len(weights),
                module_path=module_path,
                grad_bytes=out_bytes,
                param_grad_bytes=sum(weight_bytes),
                fwd_flops=fwd_flops,
                bwd_flops=bwd_flops,
                fwd_time_s=fwd_flops / FLOPS_PER_S,
                bwd_time_s=bwd_flops / FLOPS_PER_S,
            ),
        )
        for u in inputs:
            if u in self.graph:
                self.graph.add_edge(u, name)
        self.shapes[name] = shape
        return name

    def conv(
        self,
        name: str,
        x: str,
        channels: int,
        *,
        kernel: int = 3,
        relu: bool = True,
        path: str = "",
    ) -> str:
        """A stride-1, same-padding convolution with bias (and ReLU)."""
        c_in, height, width = self.shapes[x]
        shape = (channels, height, width)
        macs = self.elements(shape) * c_in * kernel * kernel
        weights = (channels * c_in * kernel * kernel, channels)
        return self._weighted(name, "conv", x, shape, macs, weights, relu=relu, path=path)

    def _weighted(
        self,
        name: str,
        kind: str,
        x: str,
        shape: Shape,
        macs: int,
        weights: tuple[int, ...],
        *,
        relu: bool,
        path: str,
    ) -> str:
        """A conv or linear layer of ``macs`` multiply-adds: saves its input (and, with the
        ReLU, its output); its backward computes the input's and the weight's gradients."""
        act = self.elements(shape) * (2 if relu else 1)
        return self.add(
            name,
            f"layer.{kind}_relu" if relu else f"layer.{kind}",
            [x],
            shape,
            fwd_flops=2 * macs + act,
            bwd_flops=4 * macs + act,
            saved_inputs=(x,),
            save_output=relu,
            weights=weights,
            module_path=path,
        )

    def pool(self, name: str, x: str, *, path: str = "") -> str:
        """A 2x2 max-pool of stride 2, saving its input and indices."""
        channels, height, width = self.shapes[x]
        shape = (channels, height // 2, width // 2)
        return self.add(
            name,
            "layer.max_pool",
            [x],
            shape,
            fwd_flops=4 * self.elements(shape),
            bwd_flops=self.elements(self.shapes[x]),
            saved_inputs=(x,),
            buffers=(self.nbytes(shape, INDEX_BYTES),),
            module_path=path,
        )

    def unpool(self, name: str, x: str, pool: str, *, path: str = "") -> str:
        """Max-unpool of ``x`` by the indices of ``pool`` (to the shape of pool's input)."""
        pool_input = next(iter(self.graph.predecessors(pool)))
        shape = (self.shapes[x][0], *self.shapes[pool_input][1:])
        return self.add(
            name,
            "layer.max_unpool",
            [x],
            shape,
            fwd_flops=self.elements(shape),
            bwd_flops=self.elements(self.shapes[x]),
            saved_extra=(f"{pool}:buf0",),
            module_path=path,
        )

    def upsample(self, name: str, x: str, *, path: str = "") -> str:
        """Nearest-neighbour upsampling by 2 (saves nothing)."""
        channels, height, width = self.shapes[x]
        shape = (channels, 2 * height, 2 * width)
        flops = self.elements(shape)
        return self.add(
            name, "layer.upsample", [x], shape, fwd_flops=flops, bwd_flops=flops, module_path=path
        )

    def deconv(self, name: str, x: str, channels: int, factor: int, *, path: str = "") -> str:
        """A transposed convolution upsampling by ``factor`` (kernel ``2 * factor``)."""
        c_in, height, width = self.shapes[x]
        kernel = 2 * factor
        macs = self.elements(self.shapes[x]) * channels * kernel * kernel
        return self.add(
            name,
            "layer.conv_transpose",
            [x],
            (channels, factor * height, factor * width),
            fwd_flops=2 * macs,
            bwd_flops=4 * macs,
            saved_inputs=(x,),
            weights=(channels * c_in * kernel * kernel,),
            module_path=path,
        )

    def merge(self, name: str, op: str, xs: list[str], *, path: str = "") -> str:
        """``layer.add`` (same shapes) or ``layer.concat`` (along channels); saves nothing."""
        shapes = [self.shapes[x] for x in xs]
        channels = sum(s[0] for s in shapes) if op == "layer.concat" else shapes[0][0]
        shape = (channels, *shapes[0][1:])
        flops = self.elements(shape)
        return self.add(name, op, xs, shape, fwd_flops=flops, bwd_flops=flops, module_path=path)

    def linear(self, name: str, x: str, features: int, *, relu: bool = True) -> str:
        """A fully connected layer over the flattened ``x`` (and ReLU)."""
        c_in = self.elements(self.shapes[x]) // self.batch
        macs = self.batch * c_in * features
        weights = (features * c_in, features)
        return self._weighted(
            name, "linear", x, (features, 1, 1), macs, weights, relu=relu, path="classifier"
        )

    def loss(self, x: str, *, label_bytes: int) -> CostGraph:
        """The softmax cross-entropy loss over ``x``'s channels; finishes the graph."""
        logits = self.nbytes(self.shapes[x])
        self.add(
            "loss",
            "layer.cross_entropy",
            [x],
            (1, 1, 1),
            fwd_flops=5 * self.elements(self.shapes[x]),
            bwd_flops=3 * self.elements(self.shapes[x]),
            buffers=(logits,),
            out_bytes=FLOAT_BYTES,
        )
        graph = self.graph
        graph.graph.update(
            outputs=["loss"],
            param_bytes=self.param_bytes,
            trainable_param_bytes=self.param_bytes,
            largest_param_bytes=self.largest_param_bytes,
            n_trainable_tensors=self.n_tensors,
            input_bytes=self.nbytes(self.shapes["input"]) + label_bytes,
        )
        check_graph(graph)
        return graph


def _start(name: str, batch: int, image: int) -> _Net:
    if batch < 1 or image < 32 or image % 32:
        raise ValueError(
            f"layer graph {name!r}: batch {batch} and image {image} must be >= 1 and a "
            "multiple of 32 (five 2x2 pools); pass e.g. batch=8, image=224."
        )
    net = _Net(name, batch)
    net.shapes["input"] = (3, image, image)
    return net


def _vgg_features(net: _Net, stages: tuple[tuple[int, ...], ...]) -> list[str]:
    """The VGG convolutions and pools; returns each stage's pool."""
    x, pools = "input", []
    for s, widths in enumerate(stages, start=1):
        for k, channels in enumerate(widths, start=1):
            x = net.conv(f"conv{s}_{k}", x, channels, path=f"features.block{s}")
        x = net.pool(f"pool{s}", x, path=f"features.block{s}")
        pools.append(x)
    return pools


def _vgg(
    name: str, stages: tuple[tuple[int, ...], ...], batch: int, image: int, n_classes: int
) -> CostGraph:
    net = _start(name, batch, image)
    x = _vgg_features(net, stages)[-1]
    x = net.linear("fc6", x, 4096)
    x = net.linear("fc7", x, 4096)
    x = net.linear("fc8", x, n_classes, relu=False)
    return net.loss(x, label_bytes=batch * INDEX_BYTES)


def vgg16_layers(*, batch: int = 32, image: int = 224, n_classes: int = 1000) -> CostGraph:
    """VGG16 (Simonyan and Zisserman, configuration D): 13 convs, 5 pools, 3 FC, loss."""
    return _vgg(f"vgg16_layers_b{batch}_i{image}", VGG16_STAGES, batch, image, n_classes)


def vgg19_layers(*, batch: int = 32, image: int = 224, n_classes: int = 1000) -> CostGraph:
    """VGG19 (configuration E): 16 convs, 5 pools, 3 FC, loss."""
    return _vgg(f"vgg19_layers_b{batch}_i{image}", VGG19_STAGES, batch, image, n_classes)


def fcn8_layers(*, batch: int = 32, image: int = 224, n_classes: int = 21) -> CostGraph:
    """FCN-8s (Long et al.): VGG16 features, fc6/fc7 as convs, and the head that adds the
    scores of pool4 and pool3 to the upsampled coarse scores (two long skips)."""
    net = _start(f"fcn8_layers_b{batch}_i{image}", batch, image)
    pools = _vgg_features(net, VGG16_STAGES)
    x = net.conv("fc6", pools[4], 4096, kernel=7, path="head")
    x = net.conv("fc7", x, 4096, kernel=1, path="head")
    x = net.conv("score_fr", x, n_classes, kernel=1, relu=False, path="head")
    x = net.deconv("upscore2", x, n_classes, 2, path="head")
    s4 = net.conv("score_pool4", pools[3], n_classes, kernel=1, relu=False, path="head")
    x = net.merge("fuse_pool4", "layer.add", [x, s4], path="head")
    x = net.deconv("upscore_pool4", x, n_classes, 2, path="head")
    s3 = net.conv("score_pool3", pools[2], n_classes, kernel=1, relu=False, path="head")
    x = net.merge("fuse_pool3", "layer.add", [x, s3], path="head")
    x = net.deconv("upscore8", x, n_classes, 8, path="head")
    return net.loss(x, label_bytes=batch * image * image * INDEX_BYTES)


def segnet_layers(*, batch: int = 32, image: int = 224, n_classes: int = 21) -> CostGraph:
    """SegNet (Badrinarayanan et al.) without batch norm: a VGG16 encoder whose pools'
    indices are kept until the mirrored decoder's unpools, 13 decoder convs, loss."""
    net = _start(f"segnet_layers_b{batch}_i{image}", batch, image)
    pools = _vgg_features(net, VGG16_STAGES)
    x = pools[-1]
    decoder = ((512, 512, 512), (512, 512, 256), (256, 256, 128), (128, 64), (64, n_classes))
    for s, widths in zip(range(5, 0, -1), decoder, strict=True):
        x = net.unpool(f"unpool{s}", x, pools[s - 1], path=f"decoder.block{s}")
        for k, channels in enumerate(widths, start=1):
            last = s == 1 and k == len(widths)
            x = net.conv(f"dconv{s}_{k}", x, channels, relu=not last, path=f"decoder.block{s}")
    return net.loss(x, label_bytes=batch * image * image * INDEX_BYTES)


def unet_layers(
    *, batch: int = 32, image: int = 256, n_classes: int = 2, base: int = 64, depth: int = 4
) -> CostGraph:
    """U-Net (Ronneberger et al., same padding): ``depth`` levels of two convs and a pool,
    two bottleneck convs, then per level an upsample, the concat with the encoder's skip and
    two convs; a 1x1 conv to the classes and the loss."""
    net = _start(f"unet_layers_b{batch}_i{image}", batch, image)
    x, skips = "input", []
    for level in range(depth):
        width = base * 2**level
        x = net.conv(f"enc{level + 1}_1", x, width, path=f"down{level + 1}")
        x = net.conv(f"enc{level + 1}_2", x, width, path=f"down{level + 1}")
        skips.append(x)
        x = net.pool(f"pool{level + 1}", x, path=f"down{level + 1}")
    x = net.conv("mid_1", x, base * 2**depth, path="mid")
    x = net.conv("mid_2", x, base * 2**depth, path="mid")
    for level in range(depth, 0, -1):
        width = base * 2 ** (level - 1)
        x = net.upsample(f"up{level}", x, path=f"up{level}")
        x = net.merge(f"cat{level}", "layer.concat", [x, skips[level - 1]], path=f"up{level}")
        x = net.conv(f"dec{level}_1", x, width, path=f"up{level}")
        x = net.conv(f"dec{level}_2", x, width, path=f"up{level}")
    x = net.conv("head", x, n_classes, kernel=1, relu=False, path="head")
    return net.loss(x, label_bytes=batch * image * image * INDEX_BYTES)


LAYER_GRAPHS: dict[str, Callable[..., CostGraph]] = {
    "vgg16": vgg16_layers,
    "vgg19": vgg19_layers,
    "fcn8": fcn8_layers,
    "segnet": segnet_layers,
    "unet": unet_layers,
}
"""The layer-level builders by family name."""
