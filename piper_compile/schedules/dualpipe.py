"""DualPipeV's phase structure (DeepSeek-V3's DualPipe folded onto a V: rank r holds stage r, its
"chunk 0" on the way down, and stage 2p-1-r, its "chunk 1" on the way up).

With at least ``2p`` micro-batches a rank runs eight phases. Counts are per rank r of p:

1. ``2(p-r-1)`` forwards of chunk 0 (the warm-up that fills the V).
2. ``r+1`` pairs: chunk-0 forward, then chunk-1 forward.
3. ``p-r-1`` times: chunk-1 backward, split into input and weight gradients (so the input gradient
   leaves before the weight gradient is computed), then a chunk-1 forward.
4. The steady state, ``N-2p+r+1`` times: two overlap slots, (chunk-0 forward beside chunk-1 backward)
   then (chunk-1 forward beside chunk-0 backward). The last rank runs its very first pair one after
   the other instead: its chunk-1 backward needs that chunk-0 forward's result.
5. ``p-r-1`` times: chunk-1 backward, then the slot (chunk-1 forward beside chunk-0 backward).
6. ``r+1`` times: chunk-1 backward, then chunk-0 backward. From the middle iteration on they are
   zero-bubble steps (input gradient now, weight gradient deferred); odd ranks switch one backward
   earlier than even ranks.
7. ``p-r-1`` times: one deferred weight gradient, then a zero-bubble chunk-0 backward.
8. ``r+1`` deferred weight gradients.

Deferred weight gradients run first-in first-out. The result is a list of groups per rank (one step,
or two steps forming an overlap slot) in the vocabulary of ``greedy.list_schedule``.
"""
from __future__ import annotations

from collections import deque

Step = tuple[str, int, int]  # (PASS, stage, micro-batch)


class _Rank:
    """The steps of one rank, built phase by phase."""

    def __init__(self, rank: int, ranks: int) -> None:
        self.stage = (rank, 2 * ranks - 1 - rank)  # chunk 0, chunk 1
        self.next_f = [0, 0]
        self.next_b = [0, 0]
        self.deferred: deque[Step] = deque()
        self.groups: list[list[Step]] = []

    def f(self, chunk: int) -> Step:
        step = ("F", self.stage[chunk], self.next_f[chunk])
        self.next_f[chunk] += 1
        return step

    def b(self, chunk: int, zero_bubble: bool = False) -> list[Step]:
        """A backward of ``chunk``: whole, or (zero bubble) its input gradient now and the weight gradient
        deferred."""
        s, m = self.stage[chunk], self.next_b[chunk]
        self.next_b[chunk] += 1
        if not zero_bubble:
            return [("B", s, m)]
        self.deferred.append(("BW", s, m))
        return [("BI", s, m)]

    def run(self, *steps: Step) -> None:
        for step in steps:
            self.groups.append([step])

    def overlap(self, fwd: Step, bwd: list[Step]) -> None:
        self.groups.append([fwd, *bwd])

    def weight(self) -> None:
        self.run(self.deferred.popleft())


def dualpipe_v_groups(ranks: int, microbatches: int) -> list[list[list[Step]]]:
    """Per rank, the groups of DualPipeV for ``microbatches >= 2 * ranks``."""
    p, n = ranks, microbatches
    assert n >= 2 * p, "DualPipeV's phases need at least two micro-batches per stage"
    out = []
    for r in range(p):
        k = _Rank(r, p)
        for _ in range(2 * (p - r - 1)):  # 1
            k.run(k.f(0))
        for _ in range(r + 1):  # 2
            k.run(k.f(0), k.f(1))
        for _ in range(p - r - 1):  # 3
            k.run(*k.b(1, zero_bubble=True))
            k.weight()
            k.run(k.f(1))
        for i in range(n - 2 * p + r + 1):  # 4
            if i == 0 and r == p - 1:
                k.run(k.f(0), *k.b(1))
            else:
                k.overlap(k.f(0), k.b(1))
            k.overlap(k.f(1), k.b(0))
        for _ in range(p - r - 1):  # 5
            k.run(*k.b(1))
            k.overlap(k.f(1), k.b(0))
        zero_bubble = False
        for i in range(r + 1):  # 6
            if i == (r + 1) // 2 and r % 2 == 1:
                zero_bubble = True
            k.run(*k.b(1, zero_bubble))
            if i == (r + 1) // 2 and r % 2 == 0:
                zero_bubble = True
            k.run(*k.b(0, zero_bubble))
        for _ in range(p - r - 1):  # 7
            k.weight()
            k.run(*k.b(0, zero_bubble=True))
        while k.deferred:  # 8
            k.weight()
        assert k.next_f == [n, n] and k.next_b == [n, n], (r, k.next_f, k.next_b)
        out.append(k.groups)
    return out
