"""The trainer's options: run.py's flags and the pass-through options, completed and checked.

Completed with what the user should not have to type: the stage's defaults (global batch size,
learning rate, frozen LM), the image and pad token ids (from the tokenizer), and the number of
iterations (one epoch of the prepared dataset's train split). Then checked by the trainer's own
plan (`train.plan.make_plan`), so that a bad path or an impossible batch layout is one line before
launch, not a traceback from every rank.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.checkpoint import layout
from megatron_ext.data.prepared import split_counts
from megatron_ext.errors import UserError
from megatron_ext.launch.tokens import TokenizerFiles
from megatron_ext.train.options import TrainConfig, fields, to_argv
from megatron_ext.train.plan import make_plan

PATH_FIELDS = ("megatron_load_dir", "tokenizer_load_dir", "save_dir", "data_path", "eval_benchmark_include_path")


@dataclass(frozen=True)
class TrainerSetup:
    config: TrainConfig  # resolved; what the trainer will run with
    argv: list[str]  # its command line: every option that differs from the trainer's default
    paths: list[Path]  # files and directories it reads or writes (bound into the container)
    notes: list[str]


def _default(field: dataclasses.Field):
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def _absolute(config: TrainConfig) -> TrainConfig:
    """Paths made absolute, so the command means the same in any working directory or container."""
    return dataclasses.replace(config, **{name: str(Path(getattr(config, name)).expanduser().resolve())
                                          for name in PATH_FIELDS if getattr(config, name)})


def _snapshots(config: TrainConfig) -> tuple[layout.Snapshot | None, layout.Snapshot | None]:
    """(checkpoint to start from, latest snapshot of --save-dir to resume), both checked."""
    save_dir = Path(config.save_dir) if config.save_dir else None
    if save_dir is not None and save_dir.exists() and not save_dir.is_dir():
        raise UserError(f"--save-dir {save_dir} exists and is not a directory")
    resume = layout.latest_complete_snapshot(save_dir) if save_dir else None
    start = None
    if config.init:
        if not config.tokenizer_load_dir:
            raise UserError("--init needs --tokenizer-load-dir: the HF LLaVA directory whose config.json defines the model")
    elif config.megatron_load_dir:
        start = layout.find_snapshot(config.megatron_load_dir, "--megatron-load-dir")
    elif resume is None:
        raise UserError("--megatron-load-dir is required (a converted or trained checkpoint), "
                        "or --init with --tokenizer-load-dir")
    return start, resume


def _tokenizer(config: TrainConfig, snapshot: layout.Snapshot | None) -> TokenizerFiles:
    if config.tokenizer_load_dir:
        return TokenizerFiles(config.tokenizer_load_dir)
    if not snapshot.tokenizer_dir.is_dir():
        raise UserError(f"--tokenizer-load-dir is required: checkpoint {snapshot.root} has no {layout.TOKENIZER_DIR}/ copy")
    return TokenizerFiles(snapshot.tokenizer_dir, f"--megatron-load-dir {snapshot.root}: tokenizer")


def _data(config: TrainConfig) -> tuple[int, list[Path]]:
    """(training samples, paths to bind) of --data-path."""
    if not config.data_path:
        raise UserError("--data-path is required: a prepared energon dataset directory or a metadataset YAML")
    train = split_counts(config.data_path)["train"]
    members = [Path(path) for path, _, _ in train.members]
    return train.samples, [Path(config.data_path), *members]


def _token_ids(config: TrainConfig, snapshot: layout.Snapshot | None) -> tuple[dict, list[str]]:
    """The image and pad token ids not given, read from the tokenizer and checked against the checkpoint's model."""
    missing = [kind for kind in ("image", "pad") if getattr(config, f"{kind}_token_id") is None]
    if not missing:
        if config.tokenizer_load_dir:
            TokenizerFiles(config.tokenizer_load_dir)
        return {}, []
    tokenizer = _tokenizer(config, snapshot)
    hf = snapshot.hf_config if snapshot else {}
    built = {"image": hf.get("image_token_index"),
             "pad": hf.get("pad_token_id", hf.get("text_config", {}).get("pad_token_id"))}
    changes = {}
    for kind in missing:
        token_id = tokenizer.image_token_id() if kind == "image" else tokenizer.pad_token_id()
        if built[kind] is not None and token_id != built[kind]:
            raise UserError(f"{tokenizer.flag} {tokenizer.directory}: {kind} token id {token_id} differs from the "
                            f"{built[kind]} that checkpoint {snapshot.root} was built with; use the tokenizer it was "
                            f"converted from (or pass --{kind}-token-id)")
        changes[f"{kind}_token_id"] = token_id
    found = ", ".join(f"{kind} {changes[f'{kind}_token_id']}" for kind in missing)
    return changes, [f"token ids from {tokenizer.directory}: {found}"]


def trainer_setup(flag_values: dict, passthrough: dict, world_size: int, te: bool, on_gpu: bool) -> TrainerSetup:
    """`flag_values`: run.py's trainer flags by field name; `passthrough`: fields given after `--`;
    `te`: Transformer Engine is usable where the trainer will run; `on_gpu`: its ranks use GPUs."""
    config = _absolute(TrainConfig(**{**flag_values, **passthrough}).resolved())
    start, resume = _snapshots(config)
    train_samples, data_paths = _data(config)
    changes, notes = _token_ids(config, resume or start)
    if config.train_iters is None and config.epochs is None:
        if train_samples == 0:
            raise UserError(f"--data-path {config.data_path} has no training samples")
        changes["train_iters"] = math.ceil(train_samples / config.global_batch_size)
        notes.append(f"{changes['train_iters']} iterations = one epoch of {train_samples} training samples at global "
                     f"batch {config.global_batch_size} (change with -- --train-iters N or -- --epochs E)")
    config = dataclasses.replace(config, **changes)
    make_plan(config, world_size, on_gpu, te)

    argv = to_argv({f.name: getattr(config, f.name) for f in fields() if getattr(config, f.name) != _default(f)})
    paths = [Path(p) for p in (config.tokenizer_load_dir, config.save_dir, config.eval_benchmark_include_path) if p]
    paths += data_paths
    paths += [snapshot.root for snapshot in (start, resume) if snapshot]
    # An adapter checkpoint loads its base checkpoint too.
    paths += [Path(snapshot.lora_base["path"]) for snapshot in (start, resume) if snapshot and snapshot.lora_base]
    return TrainerSetup(config=config, argv=argv, paths=paths, notes=notes)
