"""The samples the inspector looks at: a split of a prepared energon dataset, read in order by
energon with the trainer's decoder, or LLaVA JSON / JSONL with its image folder before it is
prepared, each record checked and decoded as the dataset builder and energon would.

Both stream: a sample is read when it is reached, and reading stops after the last one wanted
unless every sample is (`--all`). Records either source cannot make a sample of (a missing image,
a malformed conversation) come out as skips with the builder's reason.

A prepared dataset may hold preference pairs (`--task preference`; `SampleSource.pairs`); LLaVA
JSON is read as conversations.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from megatron_ext.data.conversation import BadConversation
from megatron_ext.data.prepared import holds_pairs, split_counts
from megatron_ext.data.shard_format import decoded_sample
from megatron_ext.data.sources import Skip, read_records, shard_sample
from megatron_ext.errors import UserError

DATA = "DATA"  # the command's argument, named in its errors


def skip_reason(exc: Exception) -> tuple[str, str]:
    """(reason, detail) the summary groups a sample the trainer would skip by."""
    if isinstance(exc, BadConversation):
        return exc.reason, exc.detail
    message = str(exc) or type(exc).__name__
    return message.split(";")[0], message


@dataclass(frozen=True)
class Selection:
    """Which samples the page shows: `keys` when given, else `samples` drawn with `seed`."""

    samples: int
    seed: int = 0
    keys: tuple[str, ...] = ()
    everything: bool = False  # read the whole source for the summary (--all)

    def chosen(self, total: int) -> set[int] | None:
        """Indices of the shown samples among `total`; None when they are chosen by key."""
        if self.keys:
            return None
        return set(random.Random(self.seed).sample(range(total), min(self.samples, total)))


@dataclass
class Record:
    index: int  # in the split or the JSON file
    key: str  # the sample's key in a prepared dataset (the builder's: its record's index)
    shown: bool
    sample: object | None  # a decoded energon sample, or None when the source could not make one
    skip_reason: str = ""
    skip_detail: str = ""
    record_id: str = ""  # the input record's "id"


@dataclass
class SampleSource:
    description: str
    total: int
    records: Iterator[Record]
    # Samples energon's loader dropped before they reached us (a shard part that does not decode).
    load_errors: Counter = field(default_factory=Counter)
    pairs: bool = False  # its samples are preference pairs


class _Wanted:
    """Which records are shown, and when reading can stop (after the last shown one, unless `--all`)."""

    def __init__(self, selection: Selection, total: int):
        self.chosen = selection.chosen(total)
        self.keys = set(selection.keys)
        self.everything = selection.everything
        self.left = len(self.keys) if self.chosen is None else len(self.chosen)

    def shown(self, index: int, key: str) -> bool:
        shown = key in self.keys if self.chosen is None else index in self.chosen
        self.left -= shown
        return shown

    def done(self) -> bool:
        return self.left == 0 and not self.everything


def prepared_source(path: str | Path, split: str, selection: Selection) -> SampleSource:
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset

    from megatron_ext.eval.samples import DecodedSamples

    counts = split_counts(path, DATA)
    if split not in counts:
        raise UserError(f"--split {split}: {path} has no such split (it has {', '.join(counts)})")
    total = counts[split].samples
    if total == 0:
        raise UserError(f"--split {split}: {path} has no samples in it")
    # Pairs only train with --stage dpo, so a blend holding any is read as the DPO trainer reads it.
    pairs = any(holds_pairs(member) for member, _, _ in counts[split].members)
    source = SampleSource(f"{path} (split {split}, {total} samples)", total, iter(()), pairs=pairs)
    wanted = _Wanted(selection, total)

    def dropped(exc, sample, sources=None):
        source.load_errors[skip_reason(exc)[0]] += 1

    whole_split = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=dropped)
    dataset = get_val_dataset(str(path), split_part=split, worker_config=whole_split, batch_size=1,
                              task_encoder=DecodedSamples())

    def records() -> Iterator[Record]:
        for index, batch in enumerate(get_loader(dataset)):
            sample = batch[0]
            shown = wanted.shown(index, sample.__key__)
            if shown or wanted.everything:
                yield Record(index, sample.__key__, shown, sample, record_id=getattr(sample, "record_id", ""))
            if wanted.done():
                return

    source.records = records()
    return source


def json_source(path: str | Path, image_root: str | Path | None, selection: Selection) -> SampleSource:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{DATA} {path} does not exist")
    kind, items = read_records(path)
    root = Path(image_root) if image_root else path.parent
    wanted = _Wanted(selection, len(items))

    def records() -> Iterator[Record]:
        for index, item in enumerate(items):
            key = f"{index:09d}"  # the key the builder gives it
            shown = wanted.shown(index, key)
            if shown or wanted.everything:
                yield _json_record(kind, root, index, item, key, shown)
            if wanted.done():
                return

    return SampleSource(f"{path} (images in {root}, {len(items)} records)", len(items), records())


def _json_record(kind: str, root: Path, index: int, item, key: str, shown: bool) -> Record:
    made = shard_sample(kind, root, (index, item))
    if isinstance(made, Skip):
        return Record(index, key, shown, None, made.reason, made.detail, made.id)
    try:
        sample = decoded_sample(made.parts)
    except BadConversation as exc:
        return Record(index, key, shown, None, exc.reason, exc.detail, str(item.get("id", index)))
    return Record(index, key, shown, sample, record_id=sample.record_id)


def open_source(data: str | Path, split: str, image_root: str | Path | None, selection: Selection) -> SampleSource:
    """A prepared dataset directory or metadataset YAML, or a LLaVA .json / .jsonl file."""
    if Path(data).suffix in (".json", ".jsonl"):
        return json_source(data, image_root, selection)
    return prepared_source(data, split, selection)
