"""Everything the trainer decides before it touches a GPU: defaults, derived sizes, and validation.

`make_plan` turns the command line into a `RunPlan` or raises one UserError naming the flag, so a
bad launch fails in a second instead of after model construction.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.checkpoint import layout
from megatron_ext.errors import UserError
from megatron_ext.lora.settings import lora_settings
from megatron_ext.model.arch import LlavaArch
from megatron_ext.model.backends import compute_dtype
from megatron_ext.train.execution import Execution, resolve_execution
from megatron_ext.train.options import TrainConfig

DEFAULT_MAX_SEQ_LENGTH = 2048


@dataclass(frozen=True)
class RunPlan:
    config: TrainConfig  # with stage defaults resolved
    arch: LlavaArch
    hf_config: dict  # the LLaVA config the model is built from (stored in every checkpoint)
    start: layout.Snapshot | None  # weights of a fresh run (--megatron-load-dir)
    resume: layout.Snapshot | None  # latest snapshot of --save-dir: continue that run
    tokenizer_dir: Path
    world_size: int
    data_parallel_size: int
    num_microbatches: int
    train_iters: int
    seq_length: int
    dtype: str
    execution: Execution  # attention backend, SP/CP, recompute, overlap, sequence alignment
    skip_ranges: tuple[tuple[int, int], ...]

    def skipped(self, iteration: int) -> bool:
        return any(a <= iteration <= b for a, b in self.skip_ranges)

    def summary(self) -> dict:
        return {
            "config": self.config.to_dict(),
            "world_size": self.world_size,
            "data_parallel_size": self.data_parallel_size,
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


def _hf_config(config: TrainConfig, start: layout.Snapshot | None, resume: layout.Snapshot | None) -> dict:
    if resume is not None:
        return resume.hf_config
    if start is not None:
        return start.hf_config
    if config.init and config.tokenizer_load_dir:
        path = Path(config.tokenizer_load_dir) / "config.json"
        if not path.is_file():
            raise UserError(f"--init: {path} not found; --init takes the architecture from --megatron-load-dir or "
                            "from the HF LLaVA directory given as --tokenizer-load-dir")
        return json.loads(path.read_text())
    raise UserError("--megatron-load-dir is required (or --init with --tokenizer-load-dir pointing at an HF LLaVA directory)")


def _apply_class_token_choice(hf_config: dict, no_add_class_token: bool) -> dict:
    """--no-add-class-token: the vision class token is not passed to the language model."""
    from megatron_ext.families import vision_family

    if not no_add_class_token or hf_config.get("vision_feature_select_strategy") == "default":
        return hf_config
    if not vision_family(hf_config["vision_config"].get("model_type")).class_token:
        return hf_config  # a tower without a class token has none to drop
    return {**hf_config, "vision_feature_select_strategy": "default"}


def _train_iters(config: TrainConfig, samples_per_step: int) -> int:
    if config.train_iters is not None:
        if config.train_iters < 1:
            raise UserError(f"--train-iters must be >= 1, got {config.train_iters}")
        return config.train_iters
    if config.epochs is None:
        raise UserError("give the training length: --train-iters N or --epochs E")
    from megatron_ext.data.prepared import require_split

    train_samples = require_split(config.data_path, "train")
    return max(1, math.ceil(config.epochs * train_samples / samples_per_step))


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


def make_plan(config: TrainConfig, world_size: int, on_gpu: bool, te: bool | None = None) -> RunPlan:
    """`te`: Transformer Engine is usable here (default: imported to find out)."""
    config = config.resolved()
    if config.save and not config.save_dir:
        raise UserError("--save needs --save-dir")
    if config.data_path is None:
        raise UserError("--data-path is required (a prepared energon dataset or a metadataset YAML)")
    if not Path(config.data_path).exists():
        raise UserError(f"--data-path {config.data_path} does not exist")
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
    if config.eval_generate_samples and not config.eval_interval:
        raise UserError("--eval-generate-samples needs --eval-interval (evaluations are when answers are generated)")
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

    resume = layout.latest_complete_snapshot(Path(config.save_dir)) if config.save_dir else None
    if resume is not None and config.load_optim is not False and resume.meta.get("has_optimizer"):
        saved = resume.trainer_options.get("dist_optim")
        if saved is not None and saved != config.dist_optim:
            raise UserError(f"--save-dir {config.save_dir}: its optimizer state was saved "
                            f"{'with' if saved else 'without'} --dist-optim; resume with the same setting "
                            "or give --no-load-optim (Adam's moments then start afresh)")
    start = None
    if config.megatron_load_dir and not config.init:
        start = layout.find_snapshot(config.megatron_load_dir, "--megatron-load-dir")
    if lora is not None and start is None and resume is None:
        raise UserError("--lora-rank needs --megatron-load-dir: the base checkpoint the adapters are trained on")
    if resume is not None:
        _check_same_lora(config, resume)
    hf_config = _apply_class_token_choice(_hf_config(config, start, resume), config.no_add_class_token)
    arch = LlavaArch.from_hf_config(hf_config)
    arch.check_parallel(config.tp, config.pp)
    if config.cp > 1 and arch.text.layer_ropes:
        raise UserError(f"--cp {config.cp}: {arch.text.model_type} layers compute their own RoPE, which is not split "
                        "over context-parallel ranks; use --cp 1")
    for flag, given, expected in (("--image-token-id", config.image_token_id, arch.image_token_index),
                                  ("--pad-token-id", config.pad_token_id, arch.pad_token_id)):
        if given is not None and given != expected:
            raise UserError(f"{flag} {given} differs from the checkpoint's ({expected}); the model was built with {expected}")

    tokenizer_dir = Path(config.tokenizer_load_dir) if config.tokenizer_load_dir else None
    if tokenizer_dir is None:
        source = resume or start
        tokenizer_dir = source.tokenizer_dir if source else None
    if tokenizer_dir is None or not tokenizer_dir.is_dir():
        raise UserError(f"--tokenizer-load-dir {tokenizer_dir}: no tokenizer directory found; pass the HF LLaVA directory")

    # An explicit --seq-length was checked against the alignment; the default is rounded down to it.
    default_length = min(DEFAULT_MAX_SEQ_LENGTH, arch.text.max_position_embeddings)
    seq_length = config.seq_length or default_length - default_length % execution.alignment.total
    if seq_length <= arch.img_seq_len:
        raise UserError(f"--seq-length {seq_length} leaves no room for text after {arch.img_seq_len} image embeddings")
    if config.packing_seq_length and config.packing_seq_length > seq_length:
        raise UserError(f"--packing-seq-length {config.packing_seq_length} exceeds --seq-length {seq_length}")

    dtype = compute_dtype(config.dtype, on_gpu)
    config = dataclasses.replace(config, seq_length=seq_length, attention_backend=execution.model.attention_backend)
    return RunPlan(
        config=config,
        arch=arch,
        hf_config=hf_config,
        start=start,
        resume=resume,
        tokenizer_dir=tokenizer_dir.resolve(),
        world_size=world_size,
        data_parallel_size=dp,
        num_microbatches=config.global_batch_size // per_step,
        train_iters=_train_iters(config, config.global_batch_size),
        seq_length=seq_length,
        dtype=dtype,
        execution=execution,
        skip_ranges=skip_ranges,
    )
