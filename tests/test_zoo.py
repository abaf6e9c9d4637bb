"""The model zoo: every builder reachable from ``chkpt_opt.zoo``, each returning a scalar loss."""

from __future__ import annotations

import pytest
import torch

from chkpt_opt import zoo
from chkpt_opt.cli.model_spec import builder
from chkpt_opt.zoo import chains, common, convnets, transformers

TINY = {
    "gpt": {"n_layer": 1, "d_model": 16, "n_head": 2, "seq_len": 8, "batch": 2, "vocab": 32},
    "encoder": {"n_layer": 1, "d_model": 16, "n_head": 2, "seq_len": 8, "batch": 2, "vocab": 32},
    "vit": {"image": 8, "patch": 4, "n_layer": 1, "d_model": 16, "n_head": 2, "batch": 2},
    "resnet": {"widths": (4, 8), "blocks_per_stage": 1, "image": 8, "batch": 2},
    "unet": {"base": 2, "depth": 1, "image": 8, "batch": 1},
    "vgg": {"widths": (4,), "convs_per_stage": 1, "image": 8, "batch": 2},
    "mobilenet": {"widths": (4, 8), "blocks_per_stage": 1, "image": 8, "batch": 2},
    "mlp": {"width": 8, "depth": 2, "batch": 2},
}
FAMILIES = {
    transformers: ("gpt", "encoder", "vit", "hf_gpt2"),
    convnets: ("resnet", "unet", "vgg", "mobilenet"),
    chains: ("mlp", "relu_chain"),
    common: ("n_params", "on_device", "param_mib"),
}


def test_every_public_name_comes_from_its_family_module() -> None:
    exported = {name for names in FAMILIES.values() for name in names}
    assert set(zoo.__all__) == exported
    for module, names in FAMILIES.items():
        for name in names:
            assert getattr(zoo, name) is getattr(module, name)
            assert builder("chkpt_opt.zoo", name) is getattr(module, name)  # the CLI spec


@pytest.mark.parametrize("name", sorted(TINY))
def test_builder_returns_a_training_model_and_a_scalar_loss(name: str) -> None:
    model, args, kwargs = getattr(zoo, name)(**TINY[name])
    assert model.training and isinstance(args, tuple) and kwargs == {}
    loss = model(*args, **kwargs)
    assert loss.shape == torch.Size([])
    assert zoo.n_params(model) > 0 and zoo.param_mib(model) > 0


def test_on_device_moves_the_model_and_every_tensor_input() -> None:
    model = torch.nn.Linear(2, 2)
    built = (model, (torch.ones(1, 2), 3), {"mask": torch.zeros(2), "flag": True})
    moved, args, kwargs = zoo.on_device(built, "meta")
    assert moved.weight.device.type == "meta"
    assert args[0].device.type == "meta" and args[1] == 3
    assert kwargs["mask"].device.type == "meta" and kwargs["flag"] is True
