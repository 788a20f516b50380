"""Everything the trainer decides before it touches a GPU: defaults, derived sizes, and validation.

`make_plan` turns the command line into a `RunPlan` or raises one UserError naming the flag, so a
bad launch fails in a second instead of after model construction. It is the one home of the run's
defaults and checks: the launcher (run.py) makes the same plan before anything starts and renders
the trainer's command from it, so both accept and refuse the same things in the same words. Imports
no torch: run.py --dry-run stays fast.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from megatron_ext import families
from megatron_ext.checkpoint import layout
from megatron_ext.config.execution_choices import Execution, resolve_execution
from megatron_ext.config.objective_specs import objective_of
from megatron_ext.config.options import TrainConfig
from megatron_ext.config.tokenizer_files import TokenizerFiles
from megatron_ext.data.prepared import SplitCount, UncountedSamples, holds_pairs, split_counts
from megatron_ext.errors import UserError
from megatron_ext.lora.settings import lora_settings
from megatron_ext.model.arch import LlavaArch
from megatron_ext.model.backends import compute_dtype

DEFAULT_MAX_SEQ_LENGTH = 2048


def default_seq_length(arch: LlavaArch, alignment: int) -> int:
    """Without --seq-length: min(2048, the model's maximum) rounded down to the layout's alignment."""
    default = min(DEFAULT_MAX_SEQ_LENGTH, arch.text.max_position_embeddings)
    return default - default % alignment


@dataclass(frozen=True)
class RunPlan:
    """Each value is kept once; what follows from others (lengths, micro batches) is computed from them."""

    # The options: as given, with the stage's defaults, the tokenizer's token ids and (neither
    # --train-iters nor --epochs given) one epoch's --train-iters filled in.
    config: TrainConfig
    arch: LlavaArch
    families: families.Families  # of `arch`, resolved once: the model and its tables come from them
    hf_config: dict  # the LLaVA config the model is built from (stored in every checkpoint)
    start: layout.Snapshot | None  # weights of a fresh run (--megatron-load-dir)
    resume: layout.Snapshot | None  # latest snapshot of --save-dir: continue that run
    tokenizer_dir: Path
    train_split: SplitCount  # --data-path's training samples and the datasets holding them
    world_size: int
    dtype: str
    execution: Execution  # attention backend, SP/CP, recompute, overlap, sequence alignment
    skip_ranges: tuple[tuple[int, int], ...]
    notes: tuple[str, ...] = ()  # the defaults filled in from the tokenizer and the dataset, explained

    @property
    def train_iters(self) -> int:
        """--train-iters, else the iterations of --epochs: exact without packing, the most there can
        be with it (a packed row holds one sample or more; the run ends at `epoch_samples`)."""
        cfg = self.config
        if cfg.train_iters is not None:
            return cfg.train_iters
        return _epoch_iters(cfg.epochs, self.train_split.samples, cfg.global_batch_size)

    @property
    def epoch_samples(self) -> int | None:
        """With packing and the length in epochs: the samples the run trains (the train split's,
        --epochs times). A packed global batch holds an unknown number of samples, so the run ends
        when these are trained and its LR schedule counts samples. None: the length is iterations."""
        cfg = self.config
        if cfg.train_iters is not None or cfg.packing_seq_length is None:
            return None
        return max(1, math.ceil(cfg.epochs * self.train_split.samples))

    @property
    def seq_length(self) -> int:
        """--seq-length (checked against the alignment), else min(2048, the model's maximum) rounded down to it."""
        return self.config.seq_length or default_seq_length(self.arch, self.execution.alignment.total)

    @property
    def num_microbatches(self) -> int:
        cfg = self.config
        return cfg.global_batch_size // (cfg.micro_batch_size * self.execution.data_parallel_size)

    def skipped(self, iteration: int) -> bool:
        return any(a <= iteration <= b for a, b in self.skip_ranges)

    def resolved_config(self) -> TrainConfig:
        """The options with what "auto" and the unset lengths resolved to (printed, stored in checkpoints)."""
        return dataclasses.replace(self.config, train_iters=self.train_iters, seq_length=self.seq_length,
                                   attention_backend=self.execution.model.attention_backend)

    def paths(self) -> list[Path]:
        """Files and directories the run reads or writes (bound into a container)."""
        cfg = self.config
        paths = [Path(p) for p in (cfg.tokenizer_load_dir, cfg.save_dir, cfg.eval_benchmark_include_path) if p]
        paths += [Path(cfg.data_path), *(Path(path) for path, _, _ in self.train_split.members)]
        snapshots = [snapshot for snapshot in (self.start, self.resume) if snapshot]
        paths += [snapshot.root for snapshot in snapshots]
        # An adapter checkpoint loads its base checkpoint too.
        return paths + [Path(snapshot.lora_base["path"]) for snapshot in snapshots if snapshot.lora_base]

    def summary(self) -> dict:
        return {
            "config": self.resolved_config().to_dict(),
            "world_size": self.world_size,
            "data_parallel_size": self.execution.data_parallel_size,
            "num_microbatches": self.num_microbatches,
            "train_iters": self.train_iters,
            "seq_length": self.seq_length,
            "dtype": self.dtype,
            "execution": self.execution.summary(),
            "start": str(self.start.path) if self.start else None,
            "resume": str(self.resume.path) if self.resume else None,
            "tokenizer_dir": str(self.tokenizer_dir),
            "model": self.arch.summary(),
        }


def parse_skip_ranges(values: list[str]) -> tuple[tuple[int, int], ...]:
    ranges = []
    for value in values:
        try:
            start, end = (int(x) for x in value.split("-", 1))
        except ValueError:
            raise UserError(f"--skip-train-iteration-range {value!r}: expected START-END, e.g. 100-110") from None
        if start > end or start < 1:
            raise UserError(f"--skip-train-iteration-range {value!r}: START must be >= 1 and <= END")
        ranges.append((start, end))
    return tuple(ranges)


def _snapshots(config: TrainConfig) -> tuple[layout.Snapshot | None, layout.Snapshot | None]:
    """(checkpoint to start from, latest snapshot of --save-dir to resume), both checked."""
    save_dir = Path(config.save_dir) if config.save_dir else None
    if save_dir is not None and save_dir.exists() and not save_dir.is_dir():
        raise UserError(f"--save-dir {save_dir} exists and is not a directory")
    resume = layout.latest_complete_snapshot(save_dir) if save_dir else None
    if config.init:
        if not config.tokenizer_load_dir:
            raise UserError("--init needs --tokenizer-load-dir: the HF LLaVA directory whose config.json defines the model")
        return None, resume
    if config.megatron_load_dir:
        return layout.find_snapshot(config.megatron_load_dir, "--megatron-load-dir"), resume
    if resume is None:
        raise UserError("--megatron-load-dir is required (a converted or trained checkpoint), "
                        "or --init with --tokenizer-load-dir")
    return None, resume


def _hf_config(config: TrainConfig, start: layout.Snapshot | None, resume: layout.Snapshot | None) -> dict:
    if resume is not None:
        return resume.hf_config
    if start is not None:
        return start.hf_config
    path = Path(config.tokenizer_load_dir) / "config.json"  # only --init gets here (_snapshots)
    if not path.is_file():
        raise UserError(f"--init: {path} not found; --init takes the architecture from --megatron-load-dir or "
                        "from the HF LLaVA directory given as --tokenizer-load-dir")
    return json.loads(path.read_text())


def _model(hf_config: dict, no_add_class_token: bool) -> tuple[dict, LlavaArch]:
    """(the config the model is built from, its arch: a LLaVA's or a vision-language family's).
    --no-add-class-token: a LLaVA's vision class token is not passed to the language model (a tower
    without one has none to drop)."""
    arch = families.read_model(hf_config)
    if not isinstance(arch, LlavaArch):
        return hf_config, arch
    if no_add_class_token and arch.vision.class_token and not arch.drop_class_token:
        hf_config = {**hf_config, "vision_feature_select_strategy": "default"}
        arch = families.read_llava(hf_config)
    return hf_config, arch


def _train_split(config: TrainConfig) -> SplitCount:
    if not config.data_path:
        raise UserError("--data-path is required: a prepared energon dataset directory or a metadataset YAML")
    try:
        counts = split_counts(config.data_path)
    except UncountedSamples:
        if config.train_iters is None:
            raise
        # The length is given, so nothing needs the count; the metadataset names its datasets itself.
        return SplitCount(0)
    if counts["train"].samples == 0:
        splits = ", ".join(f"{name} {count.samples}" for name, count in counts.items())
        raise UserError(f"--data-path {config.data_path} has no training samples (splits: {splits}); rebuild it with "
                        "`megatron-ext-data build` (every non-zero --split-ratio share gets samples) or point "
                        "--data-path at a dataset whose train split has samples")
    return counts["train"]


def _epoch_iters(epochs: float, train_samples: int, global_batch_size: int) -> int:
    return max(1, math.ceil(epochs * train_samples / global_batch_size))


def _train_length(config: TrainConfig, train_split: SplitCount) -> tuple[dict, list[str]]:
    """One epoch when neither --train-iters nor --epochs is given (in iterations; in samples with
    packing, whose global batches hold an unknown number of them), and the notes saying what the
    length is."""
    if config.train_iters is not None:
        return {}, []
    length, notes = _epoch_length(config, train_split.samples)
    if train_split.by_weight:
        notes.append(f"--data-path {config.data_path} blends by weight: an epoch there is {train_split.samples} samples "
                     "drawn at random by weight, not each sample once (blend_epochized with repetitions reads exact "
                     "passes)")
    return length, notes


def _epoch_length(config: TrainConfig, train_samples: int) -> tuple[dict, list[str]]:
    epochs = 1.0 if config.epochs is None else config.epochs
    change = "(change with -- --train-iters N or -- --epochs E)"
    if config.packing_seq_length is not None:
        most = _epoch_iters(epochs, train_samples, config.global_batch_size)
        return {"epochs": epochs}, [
            f"{epochs:g} epoch(s) = each of the {train_samples} training samples {epochs:g} time(s): with packing a "
            f"global batch of {config.global_batch_size} rows holds several samples, so the run ends when they are "
            f"trained (at most {most} iterations) and the LR schedule counts samples {change}"]
    if config.epochs is not None:
        return {}, []
    iters = _epoch_iters(1, train_samples, config.global_batch_size)
    return {"train_iters": iters}, [f"{iters} iterations = one epoch of {train_samples} training samples at global "
                                    f"batch {config.global_batch_size} {change}"]


def _tokenizer(config: TrainConfig, snapshot: layout.Snapshot | None) -> TokenizerFiles:
    """--tokenizer-load-dir, else the checkpoint's copy (without --init there is a checkpoint: _snapshots)."""
    if config.tokenizer_load_dir:
        return TokenizerFiles(config.tokenizer_load_dir)
    if not snapshot.tokenizer_dir.is_dir():
        raise UserError(f"--tokenizer-load-dir is required: checkpoint {snapshot.root} has no {layout.TOKENIZER_DIR}/ copy")
    return TokenizerFiles(snapshot.tokenizer_dir, f"--megatron-load-dir {snapshot.root}: tokenizer")


def _token_ids(config: TrainConfig, arch: LlavaArch, tokenizer: TokenizerFiles,
               snapshot: layout.Snapshot | None) -> tuple[dict, list[str]]:
    """The image and pad token ids not given, read from the tokenizer; given or read, they must be the model's."""
    built_by = f"checkpoint {snapshot.root}" if snapshot else f"{tokenizer.directory}/config.json"
    filled = {}
    for kind, built in (("image", arch.image_token_index), ("pad", arch.pad_token_id)):
        given = getattr(config, f"{kind}_token_id")
        if given is not None:
            if built is not None and given != built:  # a model built without a pad token takes the one given
                raise UserError(f"--{kind}-token-id {given} differs from the checkpoint's ({built}); "
                                f"the model was built with {built}")
            continue
        token_id = tokenizer.image_token_id(families.image_token(arch)) if kind == "image" else tokenizer.pad_token_id()
        if built is not None and token_id != built:
            raise UserError(f"{tokenizer.flag} {tokenizer.directory}: {kind} token id {token_id} differs from the "
                            f"{built} that {built_by} was built with; use the tokenizer it was converted from "
                            f"(or pass --{kind}-token-id)")
        filled[kind] = token_id
    if not filled:
        return {}, []
    found = ", ".join(f"{kind} {token_id}" for kind, token_id in filled.items())
    return {f"{kind}_token_id": token_id for kind, token_id in filled.items()}, [f"token ids from {tokenizer.directory}: {found}"]


def _check_same_lora(config: TrainConfig, resume: layout.Snapshot) -> None:
    """A run resumes with the LoRA settings it was saved with: its snapshots hold exactly those adapters."""
    saved = resume.trainer_options
    names = ("lora_rank", "lora_alpha", "lora_targets", "lora_train_projector")
    differ = [n for n in names if (saved.get(n, TrainConfig.__dataclass_fields__[n].default) != getattr(config, n))
              and (saved.get("lora_rank") or config.lora_rank)]
    if differ:
        raise UserError(f"--save-dir {config.save_dir} was saved with other LoRA settings ("
                        + ", ".join(f"--{n.replace('_', '-')} {saved.get(n)}" for n in differ)
                        + "); resume with those, or save to another --save-dir")


def _check_data_kind(config: TrainConfig, train: SplitCount) -> None:
    """Preference pairs train with --stage dpo and only with it: otherwise every sample would be skipped."""
    pairs = [member for member, _, _ in train.members if holds_pairs(member)]
    trains_on_pairs = objective_of(config).pairs
    if trains_on_pairs and len(pairs) < len(train.members):
        other = next(member for member, _, _ in train.members if member not in pairs)
        raise UserError(f"--stage dpo trains on preference pairs; --data-path {other} holds conversations: build "
                        "pairs with megatron-ext-data build --task preference")
    if not trains_on_pairs and pairs:
        raise UserError(f"--data-path {pairs[0]} holds preference pairs: train on them with --stage dpo")


def make_plan(config: TrainConfig, world_size: int, on_gpu: bool, te: bool | None = None) -> RunPlan:
    """`te`: Transformer Engine is usable here (default: imported to find out); `on_gpu`: the ranks use GPUs."""
    config = config.resolved()
    if config.save and not config.save_dir:
        raise UserError("--save needs --save-dir")
    train_split = _train_split(config)
    if te is None:
        from megatron_ext.model.backends import te_available

        te = te_available()
    for flag, value in (("--micro-batch-size", config.micro_batch_size), ("--global-batch-size", config.global_batch_size)):
        if value < 1:
            raise UserError(f"{flag} {value} must be >= 1")
    execution = resolve_execution(config, world_size, te, on_gpu)
    dp = execution.data_parallel_size
    per_step = config.micro_batch_size * dp
    if config.global_batch_size % per_step:
        raise UserError(f"--global-batch-size {config.global_batch_size} must be a multiple of --micro-batch-size "
                        f"{config.micro_batch_size} x data-parallel size {dp} = {per_step}")
    if config.fused_adam and config.optimizer != "adam":
        raise UserError(f"--fused-adam fuses AdamW's update; it does nothing for --optimizer {config.optimizer}: drop it")
    if config.eval_generate_samples and not config.eval_interval:
        raise UserError("--eval-generate-samples needs --eval-interval (evaluations are when answers are generated)")
    if config.eval_on_start and not config.eval_interval:
        raise UserError("--eval-on-start needs --eval-interval (the evaluation it runs first)")
    if config.eval_generate_samples < 0 or config.eval_max_new_tokens < 1:
        raise UserError("--eval-generate-samples must be >= 0 and --eval-max-new-tokens >= 1")
    if config.eval_benchmarks and not config.eval_interval:
        raise UserError("--eval-benchmarks needs --eval-interval (evaluations are when the benchmarks run)")
    if config.eval_benchmark_limit < 1:
        raise UserError(f"--eval-benchmark-limit must be >= 1, got {config.eval_benchmark_limit}")
    include = config.eval_benchmark_include_path
    if include and not Path(include).is_dir():
        raise UserError(f"--eval-benchmark-include-path {include} is not a directory of task YAMLs")
    skip_ranges = parse_skip_ranges(config.skip_train_iteration_range)
    lora = lora_settings(config)
    _check_data_kind(config, train_split)

    start, resume = _snapshots(config)
    if resume is not None and config.load_optim is not False and resume.meta.get("has_optimizer"):
        saved = resume.trainer_options.get("dist_optim")
        if saved is not None and saved != config.dist_optim:
            raise UserError(f"--save-dir {config.save_dir}: its optimizer state was saved "
                            f"{'with' if saved else 'without'} --dist-optim; resume with the same setting "
                            "or give --no-load-optim (Adam's moments then start afresh)")
    objective_of(config).check(config, start)
    if lora is not None and start is None and resume is None:
        raise UserError("--lora-rank needs --megatron-load-dir: the base checkpoint the adapters are trained on")
    if resume is not None:
        _check_same_lora(config, resume)
    hf_config, arch = _model(_hf_config(config, start, resume), config.no_add_class_token)
    family = families.of(arch)
    problems = arch.parallel_problems(config.tp, config.pp) + family.text.layout_problems(arch.text, config.cp)
    if problems:
        raise UserError("; ".join(problems))
    tokenizer = _tokenizer(config, resume or start)
    token_ids, token_notes = _token_ids(config, arch, tokenizer, resume or start)
    length, length_notes = _train_length(config, train_split)
    if config.train_iters is not None and config.train_iters < 1:
        raise UserError(f"--train-iters must be >= 1, got {config.train_iters}")

    plan = RunPlan(
        config=dataclasses.replace(config, **token_ids, **length),
        arch=arch,
        families=family,
        hf_config=hf_config,
        start=start,
        resume=resume,
        tokenizer_dir=tokenizer.directory.resolve(),
        train_split=train_split,
        world_size=world_size,
        dtype=compute_dtype(config.dtype, on_gpu),
        execution=execution,
        skip_ranges=skip_ranges,
        notes=(*token_notes, *length_notes),
    )
    if plan.seq_length <= arch.smallest_image_positions:
        raise UserError(f"--seq-length {plan.seq_length} leaves no room for text after "
                        f"{arch.smallest_image_positions} image embeddings")
    if config.vision_lr is not None and not config.unfreeze_vit:
        raise UserError("--vision-lr needs --unfreeze-vit (the vision tower is frozen otherwise)")
    _check_pixel_bounds(plan)
    if config.vision_attention != "sdpa" and isinstance(arch, LlavaArch):
        raise UserError(f"--vision-attention {config.vision_attention}: only native-resolution models (Qwen2.5-VL, "
                        "Qwen3-VL) choose their tower's attention; a LLaVA's tower attends as --attention-backend "
                        "says, drop the flag")
    if config.video_frames < 1:
        raise UserError(f"--video-frames must be >= 1, got {config.video_frames}")
    if config.max_tiles_per_sequence is not None and config.max_tiles_per_sequence < 1:
        raise UserError(f"--max-tiles-per-sequence must be >= 1, got {config.max_tiles_per_sequence}")
    if config.packing_seq_length and config.packing_seq_length > plan.seq_length:
        raise UserError(f"--packing-seq-length {config.packing_seq_length} exceeds --seq-length {plan.seq_length}")
    return plan


def _check_pixel_bounds(plan: RunPlan) -> None:
    """--min-pixels / --max-pixels: a native-resolution model's image bounds, refused for a LLaVA."""
    config, arch = plan.config, plan.arch
    given = [flag for flag, value in (("--min-pixels", config.min_pixels), ("--max-pixels", config.max_pixels))
             if value is not None]
    if not given:
        return
    if isinstance(arch, LlavaArch):
        raise UserError(f"{' and '.join(given)}: only native-resolution models (Qwen2.5-VL, Qwen3-VL) resize images "
                        f"within pixel bounds; a LLaVA's images take its vision tower's fixed size, drop the flag")
    native_vision(plan)  # its refusal as one line


def native_vision(plan: RunPlan):
    """A native-resolution model's input settings in this run: its checkpoint's processor's (else its
    family's), within --min-pixels / --max-pixels (what the task encoder resizes with and the memory
    plan counts)."""
    from megatron_ext.data.native_resolution_encoder import vision_of

    return vision_of(plan.arch, plan.tokenizer_dir, plan.config.min_pixels, plan.config.max_pixels)
