"""The sample inspector's run: the trainer's task encoder for a checkpoint and the trainer's data
options, every sample read put through it, and what the summary and the packing table count.

The encoder is `train.batches.task_encoder`, the trainer's own, with the options a trained
checkpoint was trained with (its stored trainer options) unless a flag says otherwise, and one
GPU's sequence alignment (no sequence or context parallelism). The stage is not among them: it
chooses which weights train, and the data chooses the encoder: preference pairs get the DPO
trainer's (`data.pairs`), conversations the others'. A pair counts as one sample, of two sequences.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext.data.loader import PACKING_BUFFER
from megatron_ext.data.native_resolution_encoder import NativeResolutionTaskEncoder
from megatron_ext.errors import UserError
from megatron_ext.model.sequence_alignment import SequenceAlignment
from megatron_ext.pages.encoded_sample import Inspected, SampleReader
from megatron_ext.pages.media_views import PixelsBack
from megatron_ext.pages.native_sample import NativeSampleReader
from megatron_ext.pages.sample_sources import SampleSource
from megatron_ext.progress import progress


@dataclass(frozen=True)
class EncoderSetup:
    """Where the model comes from and the trainer options that shape its data (None: the
    checkpoint's own, else the trainer's default)."""

    megatron_load_dir: str | None = None
    tokenizer_load_dir: str | None = None
    options: dict = field(default_factory=dict)  # TrainConfig fields: seq_length, packing_seq_length, chat_template, ...


@dataclass
class InspectorEncoder:
    reader: SampleReader
    description: list[tuple[str, str]]  # what the page says it used


def build_encoder(setup: EncoderSetup, pairs: bool = False) -> InspectorEncoder:
    """The trainer's encoder for the model and options of `setup`; `pairs`: for preference pairs."""
    from megatron_ext import families
    from megatron_ext.checkpoint import layout
    from megatron_ext.config.options import TrainConfig
    from megatron_ext.config.run_plan import default_seq_length
    from megatron_ext.train.batches import task_encoder

    saved = {}
    if setup.megatron_load_dir:
        snapshot = layout.find_snapshot(setup.megatron_load_dir)
        hf_config, saved = snapshot.hf_config, snapshot.trainer_options
        tokenizer_dir = Path(setup.tokenizer_load_dir or snapshot.tokenizer_dir)
        model = str(snapshot.path)
    elif setup.tokenizer_load_dir:
        tokenizer_dir = Path(setup.tokenizer_load_dir)
        config = tokenizer_dir / "config.json"
        if not config.is_file():
            raise UserError(f"--tokenizer-load-dir {tokenizer_dir} has no config.json: give an HF LLaVA or Qwen-VL directory, "
                            "or --megatron-load-dir")
        hf_config, model = json.loads(config.read_text()), str(tokenizer_dir)
    else:
        raise UserError("--megatron-load-dir or --tokenizer-load-dir is required: the model whose inputs to show")
    if not tokenizer_dir.is_dir():
        raise UserError(f"--tokenizer-load-dir {tokenizer_dir} does not exist")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in saved.items() if k in known})
    cfg = dataclasses.replace(cfg, **{k: v for k, v in setup.options.items() if v is not None})
    cfg = dataclasses.replace(cfg, stage="dpo" if pairs else 2)  # stage 2: any stage that trains on conversations
    arch = families.read_model(hf_config)
    seq_length = cfg.seq_length or default_seq_length(arch, SequenceAlignment().total)
    encoder = task_encoder(tokenizer_dir, arch, cfg, seq_length, SequenceAlignment())
    description = [("model", model), ("samples", "preference pairs (--stage dpo)" if pairs else "conversations"),
                   ("chat template", encoder.template_name), ("sequence length", str(seq_length)),
                   ("packing", f"rows of {cfg.packing_seq_length}" if cfg.packing_seq_length else "off")]
    if isinstance(encoder, NativeResolutionTaskEncoder):
        vision = encoder.vision
        description += [("image pixels", f"{vision.min_pixels:,} to {vision.max_pixels:,} (smart resize to multiples of "
                                         f"{vision.factor} px)"), ("video frames", str(cfg.video_frames))]
        return InspectorEncoder(NativeSampleReader(encoder, arch, PixelsBack.of(encoder)), description)
    if arch.tiling is None:
        description.append(("image aspect", cfg.image_aspect))
    else:
        description.append(("video frames", str(cfg.video_frames)))
    if cfg.max_tiles_per_sequence:
        description.append(("most tiles per sequence", str(cfg.max_tiles_per_sequence)))
    return InspectorEncoder(SampleReader(encoder, arch, PixelsBack.of(encoder)), description)


@dataclass(frozen=True)
class PackedRow:
    keys: list[str]
    lengths: list[int]  # positions of each sample in it (alignment padding left out)
    capacity: int

    @property
    def length(self) -> int:
        return sum(self.lengths)

    @property
    def padding_share(self) -> float:
        return 1 - self.length / self.capacity


@dataclass
class Inspection:
    source: str
    encoder: list[tuple[str, str]]
    everything: bool  # the summary counts the whole source (--all), else the shown samples
    shown: list[Inspected] = field(default_factory=list)
    counted: list[Inspected] = field(default_factory=list)  # every sample the summary counts
    skipped: Counter = field(default_factory=Counter)  # reason -> samples
    rows: list[PackedRow] = field(default_factory=list)
    tiled: object = None  # the encoder's `anyres.FeatureLayout` (tiled models), for drawing grids
    pairs: bool = False  # the samples are preference pairs

    @property
    def unit(self) -> str:
        """What one sample is called on the page."""
        return "pair" if self.pairs else "sample"

    @property
    def scope(self) -> str:
        return f"every {self.unit} of the source (--all)" if self.everything else f"the {self.unit}s shown"

    @property
    def trained(self) -> list[Inspected]:
        return [s for s in self.counted if not s.skip_reason]


def _packed_rows(reader: SampleReader, samples: list[Inspected]) -> list[PackedRow]:
    """The rows energon's packing would make of `samples`, a packing buffer at a time, in order."""
    rows = []
    for start in range(0, len(samples), PACKING_BUFFER):
        buffer = [s.packable for s in samples[start:start + PACKING_BUFFER]]
        for pack in reader.encoder.select_samples_to_pack(buffer):
            lengths = [reader.packed_length(s) for s in pack]
            rows.append(PackedRow([s.__key__ for s in pack], lengths, reader.row_capacity))
    return rows


def run_inspection(source: SampleSource, encoder: InspectorEncoder, everything: bool, keys: tuple[str, ...]) -> Inspection:
    reader = encoder.reader
    found = Inspection(source.description, encoder.description, everything, pairs=reader.pairs)
    found.tiled = reader.tiled
    total = source.total if everything else None
    for record in progress(source.records, total=total, desc="samples", unit="sample"):
        if record.sample is None:
            sample = Inspected(record.index, record.key, record.shown, record.skip_reason, record.skip_detail,
                               record_id=record.record_id)
        else:
            sample = reader.read(record.index, record.key, record.shown, record.sample)
        found.counted.append(sample)
        if sample.shown:
            found.shown.append(sample)
        if sample.skip_reason:
            found.skipped[sample.skip_reason] += 1
    found.skipped.update(source.load_errors)
    missing = sorted(set(keys) - {s.key for s in found.shown})
    if missing:
        raise UserError(f"--keys {','.join(missing)}: not in {source.description}")
    if reader.encoder.packing:
        found.rows = _packed_rows(reader, found.trained)
    return found
