"""Model builders for the command-line tests (given to chkpt-opt as file.py:function)."""

from chkpt_opt import zoo


def small_mlp():
    """An activation-heavy chain: 12 layers of width 64 on a batch of 512."""
    return zoo.mlp(width=64, depth=12, batch=512)
