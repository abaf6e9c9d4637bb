"""Reference models in plain PyTorch, with example inputs, for tests, examples and benchmarks.

Every builder returns ``(model, example_args, example_kwargs)`` with random weights
(seeded); the command line takes such a builder as a model spec, e.g. ``chkpt_opt.zoo:gpt``.

The builders live by family: :mod:`~chkpt_opt.zoo.transformers` (gpt, encoder, vit,
hf_gpt2), :mod:`~chkpt_opt.zoo.convnets` (resnet, unet, vgg, mobilenet),
:mod:`~chkpt_opt.zoo.chains` (mlp, relu_chain); :mod:`~chkpt_opt.zoo.common` has ``Built`` and the
parameter counts. All of them are importable from here. :mod:`~chkpt_opt.zoo.layer_level` builds
layer-level cost graphs of conv nets (VGG16/19, FCN-8, SegNet, U-Net) from layer shapes,
without a model. Hugging Face families built from
configs (Llama, GPT-2, BERT, T5, ViT, Mixtral) are in :mod:`~chkpt_opt.zoo.huggingface`
(``chkpt_opt.zoo.huggingface:llama`` as a model spec; they need ``transformers``).

Example:
    >>> model, args, kwargs = gpt(n_layer=2, d_model=64, n_head=4, seq_len=32, batch=2)
    >>> model(*args, **kwargs).shape
    torch.Size([])
"""

from chkpt_opt.zoo.chains import MLP as MLP
from chkpt_opt.zoo.chains import mlp, relu_chain
from chkpt_opt.zoo.common import Built as Built
from chkpt_opt.zoo.common import n_params, on_device, param_mib
from chkpt_opt.zoo.convnets import BasicBlock as BasicBlock
from chkpt_opt.zoo.convnets import InvertedResidual as InvertedResidual
from chkpt_opt.zoo.convnets import ResNet as ResNet
from chkpt_opt.zoo.convnets import UNet as UNet
from chkpt_opt.zoo.convnets import mobilenet, resnet, unet, vgg
from chkpt_opt.zoo.transformers import GPT as GPT
from chkpt_opt.zoo.transformers import Block as Block
from chkpt_opt.zoo.transformers import CausalSelfAttention as CausalSelfAttention
from chkpt_opt.zoo.transformers import Encoder as Encoder
from chkpt_opt.zoo.transformers import EncoderBlock as EncoderBlock
from chkpt_opt.zoo.transformers import ViT as ViT
from chkpt_opt.zoo.transformers import encoder, gpt, hf_gpt2, vit

__all__ = [
    "encoder",
    "gpt",
    "hf_gpt2",
    "mlp",
    "mobilenet",
    "n_params",
    "on_device",
    "param_mib",
    "relu_chain",
    "resnet",
    "unet",
    "vgg",
    "vit",
]
