"""Build a prepared energon dataset from LLaVA JSON or JSONL plus an image folder: conversations
(``task="sft"``) or preference pairs for DPO (``task="preference"``, the record shapes of `sources`).

Order of work: read the records; check each one and load its image in worker processes (in
input order); write webdataset shards ``NNNNNN.tar`` into a temporary directory, each split's
records (`splits`: by record, in input order) in shards of their own; index them there as
``energon prepare`` does non-interactively, naming each split's shards, and write the task's dataset.yaml of `shard_format`; check that the
prepared sample count is what was written; write ``build_report.json``; only then rename the
temporary directory to the output directory. A failure anywhere leaves no output behind.
"""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from megatron_ext.data.prepared import META_DIR, dir_split_counts
from megatron_ext.data.shard_format import DATASET_YAML, PREFERENCE_DATASET_YAML
from megatron_ext.data.sources import PromptLimit, Skip, preference_sample, read_records, shard_sample
from megatron_ext.data.splits import split_of_records, split_parts, split_sizes
from megatron_ext.data.tasks import PREFERENCE, SFT, TASKS
from megatron_ext.errors import UserError
from megatron_ext.fsutil import atomic_output_dir, check_output_dir
from megatron_ext.progress import progress

log = logging.getLogger(__name__)

REPORT_FILE = "build_report.json"
NAMED_SKIPS = 5  # skipped records the summary names; build_report.json lists them all


@dataclass
class BuildReport:
    input: str
    output_dir: str
    task: str = SFT
    written: int = 0
    text_only: int = 0  # written samples without an image
    multi_image: int = 0  # ... with several
    max_images: int = 0  # most images in one sample
    videos: int = 0  # written samples with a video
    shards: int = 0
    splits: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)  # reason -> count
    skipped_samples: list = field(default_factory=list)  # one dict per skipped sample

    @property
    def unit(self) -> str:
        """What one written sample is: a sample (conversation) or a pair."""
        return "pair" if self.task == PREFERENCE else "sample"

    def summary(self) -> str:
        unit = self.unit
        lines = [f"wrote {self.written} {unit}s in {self.shards} shards to {self.output_dir}",
                 f"  {self.text_only} text-only ({_share(self.text_only, self.written)}), {self.multi_image} with "
                 f"several images ({_share(self.multi_image, self.written)}, up to {self.max_images} in one {unit})",
                 f"  {self.videos} with a video ({_share(self.videos, self.written)})",
                 "splits: " + ", ".join(f"{k} {v}" for k, v in self.splits.items())]
        total = sum(self.skipped.values())
        lines.append(f"skipped {total} {unit}s" + (":" if total else ""))
        lines += [f"  {count:6d}  {reason}" for reason, count in sorted(self.skipped.items(), key=lambda kv: -kv[1])]
        lines += [f"  {Skip(**skip).describe(unit)}" for skip in self.skipped_samples[:NAMED_SKIPS]]
        if total > NAMED_SKIPS:
            lines.append(f"  and {total - NAMED_SKIPS} more in {REPORT_FILE}")
        return "\n".join(lines)


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def parse_split_ratio(text: str) -> str:
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) != 3 or any(p < 0 for p in parts) or parts[0] <= 0:
        raise UserError(f"--split-ratio {text!r} must be three non-negative numbers train,val,test with train > 0, e.g. 9,1,0")
    return ",".join(f"{p:g}" for p in parts)


def _samples(work, records: list, num_workers: int):
    """`work((index, record))` (a ShardSample or a Skip) for every record, in input order, on
    `num_workers` processes."""
    if num_workers <= 1:
        yield from map(work, enumerate(records))
        return
    with multiprocessing.get_context("fork").Pool(num_workers) as pool:
        yield from pool.imap(work, enumerate(records), chunksize=16)


def _write_shards(samples, out: Path, splits: list[str], samples_per_shard: int, strict: bool,
                  report: BuildReport) -> dict[str, list[int]]:
    """Write the samples, record `i` into split `splits[i]`, each split into shards of its own;
    returns the shard numbers of each split."""
    import webdataset as wds

    skipped, shards = Counter(), {}
    with wds.ShardWriter(str(out / "%06d.tar"), maxcount=samples_per_shard, verbose=0) as writer:
        for index, sample in enumerate(progress(samples, total=len(splits), desc="writing shards", unit="sample")):
            if isinstance(sample, Skip):
                if strict:
                    raise UserError(f"{report.input}: {sample.describe(report.unit)} (--strict stops at the first bad {report.unit})")
                skipped[sample.reason] += 1
                report.skipped_samples.append(asdict(sample))
                continue
            split = splits[index]
            if writer.count and split not in shards:
                writer.next_stream()  # a new split starts a new shard
            writer.write(sample.parts)
            numbers = shards.setdefault(split, [])
            if writer.shard - 1 not in numbers:  # the number of the shard just written to
                numbers.append(writer.shard - 1)
            report.written += 1
            report.text_only += sample.num_images == 0
            report.multi_image += sample.num_images > 1
            report.max_images = max(report.max_images, sample.num_images)
            report.videos += sample.num_videos > 0
    report.skipped = dict(skipped)
    return shards


def run_energon_prepare(path: Path, shards: dict[str, list[int]], num_workers: int, dataset_yaml: dict = DATASET_YAML) -> None:
    """Index the shards in `path`, `shards` naming the shard numbers of each split, and name the
    sample type they hold (`dataset_yaml`): what `energon prepare PATH --non-interactive
    --skip-dataset-yaml --split-parts ...` does, called in this process (a command of its own would
    import torch and energon again, seconds of every build)."""
    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors import BaseWebdatasetFactory

    tars = sorted(str(tar.relative_to(path)) for tar in path.glob("*.tar"))
    patterns = [tuple(part.split(":", 1)) for part in split_parts(shards)]
    try:
        BaseWebdatasetFactory.prepare_dataset(
            EPath(path), tars, split_parts_patterns=patterns, shuffle_seed=None, workers=max(1, num_workers),
            progress_fn=lambda items, total=None: iter(progress(items, total=total, desc="indexing shards", unit="shard")))
    except Exception as exc:  # noqa: BLE001 - whatever energon raises, said in one line
        raise UserError(f"energon prepare failed on the new shards: {type(exc).__name__}: {exc}") from exc
    (path / META_DIR / "dataset.yaml").write_text(yaml.safe_dump(dataset_yaml, sort_keys=False))


def _check_splits(report: BuildReport, sizes: dict[str, int], shards: dict[str, list[int]], split_ratio: str) -> None:
    """A UserError when every record of a split the ratio asked for was skipped."""
    first = 0
    for name, size in sizes.items():
        if size and not shards.get(name):
            raise UserError(f"--split-ratio {split_ratio}: every record of the {name} split (records {first}-{first + size - 1}"
                            f" of INPUT) was skipped; fix them (--strict names the first) or change --split-ratio")
        first += size


def _prompt_limit(task: str, tokenizer_load_dir, seq_length: int | None) -> PromptLimit | None:
    """The --tokenizer-load-dir / --seq-length check of preference prompts, its tokenizer loaded."""
    if tokenizer_load_dir is None and seq_length is None:
        return None
    if task != PREFERENCE:
        raise UserError("--tokenizer-load-dir and --seq-length apply to --task preference")
    if tokenizer_load_dir is None or seq_length is None:
        raise UserError("--tokenizer-load-dir and --seq-length go together")
    if seq_length < 1:
        raise UserError(f"--seq-length {seq_length} must be at least 1")
    limit = PromptLimit(str(Path(tokenizer_load_dir).expanduser()), seq_length)
    limit.load()
    return limit


def build_energon_dataset(
    input_path: str | Path,
    output_dir: str | Path,
    image_root: str | Path | None = None,
    split_ratio: str = "9,1,0",
    samples_per_shard: int = 1000,
    num_workers: int = 4,
    strict: bool = False,
    force: bool = False,
    task: str = SFT,
    tokenizer_load_dir: str | Path | None = None,
    seq_length: int | None = None,
) -> BuildReport:
    """Write a prepared energon dataset to `output_dir`; returns what was written and skipped.
    `task` "preference" writes preference pairs, skipping those whose prompt alone reaches
    `seq_length` tokens of the tokenizer in `tokenizer_load_dir` when both are given."""
    if task not in TASKS:
        raise UserError(f"--task {task!r} must be one of {', '.join(TASKS)}")
    input_path = Path(input_path).expanduser().resolve()
    output_dir = check_output_dir(output_dir, force, "--output-dir")
    split_ratio = parse_split_ratio(split_ratio)
    limit = _prompt_limit(task, tokenizer_load_dir, seq_length)
    kind, records = read_records(input_path)
    image_root = Path(image_root).expanduser().resolve() if image_root else input_path.parent
    if not image_root.is_dir():
        raise UserError(f"--image-root {image_root} is not a directory")
    if task == PREFERENCE:  # the three record shapes are told apart per record, in JSON and JSONL alike
        work, dataset_yaml = functools.partial(preference_sample, limit, image_root), PREFERENCE_DATASET_YAML
    else:
        work, dataset_yaml = functools.partial(shard_sample, kind, image_root), DATASET_YAML
    report = BuildReport(input=str(input_path), output_dir=str(output_dir), task=task)
    if not records:
        raise UserError(f"{input_path}: no usable {report.unit}s: the input is empty")
    sizes = split_sizes(len(records), split_ratio)
    with atomic_output_dir(output_dir) as tmp:
        shards = _write_shards(_samples(work, records, num_workers), tmp, split_of_records(sizes), samples_per_shard,
                               strict, report)
        if report.written == 0:
            reasons = ", ".join(f"{r} ({n})" for r, n in report.skipped.items())
            raise UserError(f"{input_path}: no usable {report.unit}s: {reasons}")
        _check_splits(report, sizes, shards, split_ratio)
        report.shards = len(list(tmp.glob("*.tar")))
        run_energon_prepare(tmp, shards, num_workers, dataset_yaml)
        report.splits = dir_split_counts(tmp, "--output-dir")
        prepared = sum(report.splits.values())
        if prepared != report.written:
            raise UserError(f"energon prepare indexed {prepared} {report.unit}s, {report.written} were written")
        (tmp / REPORT_FILE).write_text(json.dumps(asdict(report), indent=1, ensure_ascii=False))
    return report
