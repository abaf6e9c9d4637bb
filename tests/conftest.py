"""Shared fixtures: real models in plain torch (from chkpt_opt.zoo) at test sizes."""

from __future__ import annotations

import pytest
import torch

from chkpt_opt import zoo


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(2)


# Test-size versions of the reference models: small enough for CPU tests, large enough
# that activations dominate and every structure (attention, residuals, batch norm, long
# skips, dropout) is present.
MODELS = {
    "gpt": lambda: zoo.gpt(n_layer=3, d_model=64, n_head=4, seq_len=64, batch=4, vocab=256),
    "resnet": lambda: zoo.resnet(widths=(8, 16), blocks_per_stage=2, image=16, batch=4),
    "unet": lambda: zoo.unet(base=4, depth=2, image=16, batch=2),
    "hf_gpt2": lambda: zoo.hf_gpt2(n_layer=2, d_model=64, n_head=4, seq_len=32, batch=2, vocab=128),
}
