"""Which records of a build go to train, val and test.

energon's own `--split-ratio` hands out whole shards, so a dataset with fewer shards than the
ratio has parts (37 records in one shard of 1000) put everything in val. The builder splits by
record instead, in input order (train first, then val, then test, as energon's shard split did for
big datasets): every non-zero share gets at least one record, each split's samples go to shards
of their own, and energon is told which shards form which split.
"""

from __future__ import annotations

import math

from megatron_ext.data.prepared import SPLITS
from megatron_ext.errors import UserError

_NOTHING = "(?!)"  # a pattern that matches no shard: energon then lists the split as empty


def split_sizes(records: int, split_ratio: str) -> dict[str, int]:
    """Records per split of `records` for a checked `split_ratio` ("9,1,0"): val and test rounded,
    at least one each where their share is not zero, train the rest; a UserError when train gets none."""
    shares = [float(x) for x in split_ratio.split(",")]
    sizes = {name: max(1, math.floor(records * share / sum(shares) + 0.5)) if share else 0
             for name, share in zip(SPLITS[1:], shares[1:])}
    train = records - sum(sizes.values())
    if train < 1:
        needed = 1 + sum(1 for share in shares[1:] if share)
        raise UserError(f"--split-ratio {split_ratio} needs at least {needed} records (one per non-zero share), "
                        f"INPUT has {records}: give more records or --split-ratio 1,0,0")
    return {SPLITS[0]: train, **sizes}


def split_of_records(sizes: dict[str, int]) -> list[str]:
    """The split of each record index, in input order."""
    return [name for name in SPLITS for _ in range(sizes[name])]


def split_parts(shards: dict[str, list[int]]) -> list[str]:
    """energon prepare's `--split-parts` values for the shard numbers of each split (consecutive
    numbers, as the builder writes them)."""
    parts = []
    for name in SPLITS:
        numbers = shards.get(name) or []
        pattern = f"{{{min(numbers):06d}..{max(numbers):06d}}}[.]tar" if numbers else _NOTHING
        parts.append(f"{name}:{pattern}")
    return parts
