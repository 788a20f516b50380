"""Sample counts of prepared energon datasets and metadataset blends, without torch or energon.

The launcher (which must start fast and import no torch) and the trainer (``--epochs`` ->
iterations) both need to know how many samples a ``--data-path`` holds. A prepared dataset
directory records that in ``.nv-meta/.info.json`` (samples per shard) and ``.nv-meta/split.yaml``
(which shards, as brace patterns, form train / val / test); a metadataset YAML
(``__class__: MetadatasetV2``) refers to such directories or to other metadatasets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from braceexpand import braceexpand

from megatron_ext.errors import UserError

META_DIR = ".nv-meta"
PAIR_SAMPLE_CLASS = "PreferenceSample"  # shard_format's class of preference pairs
SPLITS = ("train", "val", "test")


class UncountedSamples(UserError):
    """A metadataset whose samples cannot be counted: its join entries pair samples energon's way."""


@dataclass(frozen=True)
class SplitCount:
    """Samples of one split; `members` lists (dataset directory, weight or repetitions, samples).
    `by_weight`: somewhere a weighted `blend` draws its samples at random, so the split has no passes
    (energon reads a directory, a subset or a `blend_epochized` split in passes, a weighted one only endlessly)."""

    samples: int
    members: list[tuple[str, float, int]] = field(default_factory=list)
    by_weight: bool = False


def is_prepared_dir(path: str | Path) -> bool:
    meta = Path(path) / META_DIR
    return (meta / ".info.json").is_file() and (meta / "split.yaml").is_file()


def _not_prepared(path: Path, flag: str) -> UserError:
    return UserError(
        f"{flag} {path} is not a prepared energon dataset (no {META_DIR}/.info.json and split.yaml) "
        "or a metadataset YAML; build one with scripts/data/build_energon_dataset.py or run `energon prepare` on it"
    )


def _load_yaml(path: Path, flag: str):
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"{flag} {path}: cannot read YAML: {str(exc).splitlines()[0]}") from exc


def dir_split_counts(path: str | Path, flag: str = "--data-path") -> dict[str, int]:
    """Samples per split (train/val/test and any custom split) of a prepared dataset directory."""
    path = Path(path)
    if not is_prepared_dir(path):
        raise _not_prepared(path, flag)
    meta = path / META_DIR
    try:
        shard_counts = json.loads((meta / ".info.json").read_text())["shard_counts"]
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{flag} {meta / '.info.json'} is unreadable ({exc}); re-run `energon prepare`") from exc
    split_config = _load_yaml(meta / "split.yaml", flag) or {}
    excluded = set(split_config.get("exclude") or [])
    counts = {}
    for split, patterns in (split_config.get("split_parts") or {}).items():
        shards = [shard for pattern in patterns or [] for shard in braceexpand(pattern)]
        missing = [s for s in shards if s not in shard_counts]
        if missing:
            raise UserError(f"{flag} {path}: split {split!r} names shard {missing[0]} that .info.json does not list; re-run `energon prepare`")
        counts[split] = sum(shard_counts[s] for s in shards if s not in excluded)
        # Excluded single samples are written as "<shard>/<key>".
        counts[split] -= sum(1 for e in excluded if "/" in e and e.rsplit("/", 1)[0] in shards)
    for split in SPLITS:
        counts.setdefault(split, 0)
    return counts


def _subset_range(entry: dict, flag: str) -> tuple[int, int | None] | tuple[float, float]:
    """An entry's `subset: {range: [start, end]}`: sample indices (ints; end may be "end") or percentages."""
    try:
        start, end = entry["subset"]["range"]
        if isinstance(start, int):
            return start, None if end == "end" else int(end)
        if not all(isinstance(v, str) and v.strip().endswith("%") for v in (start, end)):
            raise ValueError("percentages on both ends")
        return tuple(float(v.strip().removesuffix("%")) / 100 for v in (start, end))
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{flag}: subset {entry.get('subset')!r} must be {{range: [start, end]}} with sample "
                        "indices or percentages such as 25%") from exc


def _subset_count(total: int, absolute: tuple[int, int | None] | None, fraction: tuple[float, float]) -> int:
    """Samples energon takes from `total`: the absolute range first, then the fraction of what is left."""
    start, end = absolute or (0, total)
    end = total if end is None else min(end, total)
    left = max(end - start, 0)
    return int(left * fraction[1]) - int(left * fraction[0])


def _entry_members(entry: dict, base: Path, split: str, flag: str,
                   fraction: tuple[float, float] = (0.0, 1.0)) -> list[tuple[str, float, int]]:
    """(dataset directory, weight or repetitions, samples) of each dataset a metadataset entry uses;
    `fraction` is the relative subset its parents take (energon nests them)."""
    if not isinstance(entry, dict):
        raise UserError(f"{flag}: metadataset entry {entry!r} is not a mapping")
    if "join" in entry:
        raise UncountedSamples(f"{flag}: cannot count samples of a metadataset with join entries; give --train-iters "
                               "instead of --epochs")
    absolute = None
    if "subset" in entry:
        subset = _subset_range(entry, flag)
        if isinstance(subset[0], int):
            absolute = subset
        else:  # a fraction of the parent's fraction
            width = fraction[1] - fraction[0]
            fraction = (fraction[0] + subset[0] * width, fraction[0] + subset[1] * width)
    leaf = "path" in entry and Path(entry["path"]).suffix not in (".yaml", ".yml")
    if absolute and not leaf:
        raise UserError(f"{flag}: a subset of sample indices applies to one dataset directory, not to {entry}")
    for key, factor in (("blend", "weight"), ("blend_epochized", "repetitions")):
        if key in entry:
            return [(p, float(item.get(factor, 1.0)), n)
                    for item in entry[key] for p, _, n in _entry_members(item, base, split, flag, fraction)]
    if "path" not in entry:
        raise UserError(f"{flag}: metadataset entry {entry} has no 'path'")
    target = Path(entry["path"]).expanduser()
    target = target if target.is_absolute() else base / target
    split = entry.get("split_part", split)
    if not leaf:
        return _metadataset_split(target, split, flag, fraction).members
    return [(str(target), 1.0, _subset_count(dir_split_counts(target, flag).get(split, 0), absolute, fraction))]


def _metadataset_split(path: Path, split: str, flag: str, fraction: tuple[float, float] = (0.0, 1.0)) -> SplitCount:
    config = _load_yaml(path, flag)
    if not isinstance(config, dict) or not isinstance(config.get("splits"), dict):
        raise UserError(f"{flag} {path} is not an energon metadataset (expected __class__: MetadatasetV2 with a `splits:` mapping)")
    entry = config["splits"].get(split)
    if entry is None:
        return SplitCount(0)
    members = _entry_members(entry, path.parent, split, flag, fraction)
    # One epoch of a blend_epochized split repeats each member; a weighted blend has no epoch of
    # its own, so one pass over every member is what counts.
    epochized = isinstance(entry, dict) and "blend_epochized" in entry
    total = sum(n * factor if epochized else n for _, factor, n in members)
    return SplitCount(int(round(total)), members, _draws_by_weight(entry, path.parent, split, flag))


def _draws_by_weight(entry: dict, base: Path, split: str, flag: str) -> bool:
    """Whether a weighted `blend` is in `entry` or in the metadatasets it names (checked by
    `_entry_members` already: every entry is a mapping)."""
    if "blend" in entry:
        return True
    if "blend_epochized" in entry:
        return any(_draws_by_weight(item, base, split, flag) for item in entry["blend_epochized"])
    target = Path(entry["path"]).expanduser()
    target = target if target.is_absolute() else base / target
    if target.suffix not in (".yaml", ".yml"):
        return False
    nested = _load_yaml(target, flag)["splits"].get(entry.get("split_part", split))
    return nested is not None and _draws_by_weight(nested, target.parent, split, flag)


def split_counts(path: str | Path, flag: str = "--data-path") -> dict[str, SplitCount]:
    """Samples per split of a prepared dataset directory or a metadataset YAML."""
    path = Path(path).expanduser()
    if path.is_dir():
        return {split: SplitCount(n, [(str(path), 1.0, n)]) for split, n in dir_split_counts(path, flag).items()}
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        return {split: _metadataset_split(path, split, flag) for split in SPLITS}
    if not path.exists():
        raise UserError(f"{flag} {path} does not exist")
    raise _not_prepared(path, flag)


def require_split(path: str | Path, split: str, flag: str = "--data-path") -> int:
    """Samples in `split`; a one-line UserError when there are none."""
    count = split_counts(path, flag)[split].samples
    if count == 0:
        raise UserError(f"{flag} {path} has no samples in its {split!r} split")
    return count


def holds_pairs(dataset_dir: str | Path) -> bool:
    """Whether a prepared dataset directory holds preference pairs: its dataset.yaml names the sample
    type `shard_format.PreferenceSample` (read as text here: the launcher imports no energon)."""
    described = Path(dataset_dir) / META_DIR / "dataset.yaml"
    if not described.is_file():  # energon's loader reports the missing file
        return False
    sample_type = (yaml.safe_load(described.read_text()) or {}).get("sample_type") or {}
    return sample_type.get("__class__") == PAIR_SAMPLE_CLASS
