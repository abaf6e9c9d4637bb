"""Attributes of a module by the dotted path an fx ``get_attr`` node names.

The one place both the tracer (:mod:`chkpt_opt.graphs.tracer`, which reads parameters and
buffers of the captured module) and codegen (:mod:`chkpt_opt.codegen`, whose regions fetch
the module's current tensors at every call) resolve such a path. It imports nothing of
chkpt_opt, so both may sit above it.
"""

from __future__ import annotations

from typing import Any

import torch


def fetch_attr(root: torch.nn.Module, target: str) -> Any:
    """The attribute of ``root`` at the dotted path ``target`` (an fx get_attr target)."""
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value
