"""Model builders for the command-line tests (given to chkpt-opt as file.py:function)."""

from chkpt_opt import zoo


def small_mlp(batch: int = 512):
    """An activation-heavy chain: 12 layers of width 64 (batch 512 by default)."""
    return zoo.mlp(width=64, depth=12, batch=batch)


def raises(batch: int = 8):
    """A model function that fails (with or without ``batch=``, as max-batch calls it)."""
    raise RuntimeError("boom")


def tiny_gpt():
    """Four GPT blocks (d_model 64, seq 64, batch 4): layers for the per-layer exports."""
    return zoo.gpt(n_layer=4, d_model=64, n_head=4, seq_len=64, batch=4, vocab=256)
