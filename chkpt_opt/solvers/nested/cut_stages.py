"""The sets of cuts :mod:`~chkpt_opt.solvers.nested.dp_nested` solves over, coarse first: a
set's solve grows steeply with its cuts, so the coarse sets give quick incumbents before
the full set (and the lowest-peak search climbs over a few of them)."""

from __future__ import annotations


def cut_stages(
    allowed: list[int], n: int, counts: tuple[int, ...], *, phases: bool
) -> tuple[list[list[int]], list[list[int]]]:
    """The cut sets a call solves over, in order: for each coarse count below the number of
    allowed cuts, every k-th allowed cut (k the stride that gives about that count), and
    with ``phases`` every phase of that stride and of the stride one shorter; then all of
    them. Also the sets the lowest-peak search climbs over: phase 0 of each count's stride,
    then all.

    Why phases: on a stack of layers, a coarse set's plan depends on where in a layer its
    cuts fall. The corpus's ``encoder_large`` (53 cuts, layers of 4 blocks) at 0.15 of its
    keep-all peak within 60 s: 1.07 s of recompute from every 3rd cut at phase 0, 0.92 s
    from every 2nd at phase 1; the deep chain at 0.75 of its smallest keep-set budget
    within 30 s: 0.910 s before, 0.755 s (its optimum: 0.742 s). Coarse sets are solved in
    a fraction of the full solve's time (``gpt_reference`` and the VGG: no slower). The
    lowest-peak search, which proves its answer over all cuts, found the same peaks with
    them but ran into its 60 s limit on ``encoder_large`` where it had finished in 42 s,
    so it climbs over phase 0 alone.

    Why fewest cuts first: on the 32-layer LoRA Llama at 768 tokens (69 blocks), a set of
    24 cuts finds a plan in 0.7 s and one of 36 (the shorter stride's) takes 35 s: in the
    order of strides, the 36-cut sets came first and a 9 s limit ended in the first one,
    with nothing."""

    def every(step: int, phase: int) -> list[int]:
        return sorted({allowed[0], *allowed[phase::step], n})

    stages: list[list[int]] = []
    primary: list[list[int]] = []
    for count in sorted(counts):
        if 2 < count < len(allowed):
            stride = -(-(len(allowed) - 1) // (count - 1))
            primary.append(every(stride, 0))
            strides = [stride - 1, stride] if phases and stride > 2 else [stride]
            for step in strides:
                for phase in range(step if phases else 1):
                    cuts = every(step, phase)
                    if cuts not in stages:
                        stages.append(cuts)
    # Fewest cuts first (a stable sort): a set's solve grows steeply with its cuts, so the
    # cheap incumbents come before the costly ones.
    return [*sorted(stages, key=len), allowed], [*primary, allowed]
