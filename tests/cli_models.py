"""Model builders for the command-line tests (given to chkpt-opt as file.py:function)."""

from chkpt_opt import zoo


def small_mlp(batch: int = 512):
    """An activation-heavy chain: 12 layers of width 64 (batch 512 by default)."""
    return zoo.mlp(width=64, depth=12, batch=batch)
