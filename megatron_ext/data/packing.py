"""Sequence packing: which samples share a sequence. Their lengths in the model's combined space
and the attention that keeps them apart are `model.packed_sequences`."""

from __future__ import annotations


def knapsack_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of total length <= `capacity`, fullest first.

    Greedy over exact knapsacks: each bin takes the subset of the samples left whose total comes
    closest to `capacity` (subset sum over the whole buffer), so the slack gathers in the last
    bins. First-fit-decreasing, the usual choice, leaves a gap in most bins instead: on LLaVA-like
    lengths (576-position images) it fills 92.9% of 4096-position packs against 98.8% here
    (bench/data_bench.py). Every index lands in exactly one bin; a sample longer than `capacity`
    gets a bin of its own.
    """
    remaining = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins = []
    while remaining:
        bin_ = _closest_subset(remaining, lengths, capacity) or [remaining[0]]
        taken = set(bin_)
        remaining = [i for i in remaining if i not in taken]
        bins.append(sorted(bin_))
    return bins


def _closest_subset(items: list[int], lengths: list[int], capacity: int) -> list[int]:
    """The subset of `items` with the largest total length <= capacity (empty if none fits).

    Reachable totals are the set bits of one integer, extended item by item; the subset is read
    back from the sets seen before each item.
    """
    within = (1 << (capacity + 1)) - 1
    reachable, before = 1, []
    for i in items:
        before.append(reachable)
        reachable = (reachable | (reachable << lengths[i])) & within
    total = reachable.bit_length() - 1
    chosen = []
    for i, earlier in zip(reversed(items), reversed(before)):
        if not (earlier >> total) & 1:  # this total needs item i
            chosen.append(i)
            total -= lengths[i]
    return chosen
