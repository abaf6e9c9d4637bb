"""Rounded-up sizes for a family of calls that grows (chkpt_opt.attachment.buckets)."""

from __future__ import annotations

import torch

from chkpt_opt.attachment.buckets import bucket_size, bucket_sizes, grown_inputs
from chkpt_opt.graphs.tracer.dynamic_dims import InputDims


def test_buckets_are_at_most_an_eighth_above_the_size() -> None:
    assert [bucket_size(n) for n in (1, 8, 9, 15, 16, 17, 241, 256, 257)] == [
        1, 8, 9, 15, 16, 18, 256, 256, 288,
    ]  # fmt: skip
    for n in range(1, 5000):
        assert n <= bucket_size(n) <= n + n // 8 and bucket_size(bucket_size(n)) == bucket_size(n)


def test_inputs_grow_along_their_symbolic_dimensions_by_their_last_slice() -> None:
    dims = InputDims(
        dims={"input_ids": (4, "s0"), "attention_mask": (4, "s0"), "args[0]": (3,)},
        ranges={"s0": (2, None)},
        example={"s0": 241},
    )
    ids = torch.arange(4 * 241).reshape(4, 241)
    mask = torch.ones(4, 241, dtype=torch.long)
    mask[:, 200:] = 0
    grown = grown_inputs(dims, (torch.ones(3),), {"input_ids": ids, "attention_mask": mask})
    assert grown is not None
    (vector,), kwargs = grown
    assert kwargs["input_ids"].shape == kwargs["attention_mask"].shape == (4, 256)
    assert torch.equal(kwargs["input_ids"][:, :241], ids)
    assert torch.equal(kwargs["input_ids"][:, 241:], ids[:, -1:].expand(4, 15))
    assert int(kwargs["attention_mask"][:, 200:].sum()) == 0 and vector.shape == (3,)


def test_a_size_already_at_its_bucket_or_capped_by_its_range_does_not_grow() -> None:
    dims = InputDims(dims={"x": ("s0",)}, ranges={"s0": (2, 250)}, example={"s0": 241})
    assert bucket_sizes(dims) == {"s0": 250}
    at_bucket = InputDims(dims={"x": ("s0",)}, ranges={"s0": (2, None)}, example={"s0": 256})
    assert grown_inputs(at_bucket, (), {"x": torch.ones(256)}) is None
