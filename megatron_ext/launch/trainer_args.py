"""The trainer's command line, rendered from the plan the trainer itself would make.

`config.run_plan.make_plan` completes the options (stage defaults, token ids from the tokenizer, one
epoch of iterations) and checks them; here they are only made absolute and written out, so that
what the launcher refuses and what the trainer refuses are one thing, and a bad path or an
impossible batch layout is one line before launch, not a traceback from every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.config.options import TrainConfig, fields, to_argv
from megatron_ext.config.run_plan import RunPlan, make_plan

PATH_FIELDS = ("megatron_load_dir", "tokenizer_load_dir", "save_dir", "data_path", "eval_benchmark_include_path")


@dataclass(frozen=True)
class TrainerSetup:
    plan: RunPlan  # as the trainer will make it (where Transformer Engine is assumed, it checks again)
    argv: list[str]  # its command line: every option of the plan that differs from the trainer's default


def _default(field: dataclasses.Field):
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def _absolute(config: TrainConfig) -> TrainConfig:
    """Paths made absolute, so the command means the same in any working directory or container."""
    return dataclasses.replace(config, **{name: str(Path(getattr(config, name)).expanduser().resolve())
                                          for name in PATH_FIELDS if getattr(config, name)})


def trainer_setup(flag_values: dict, passthrough: dict, world_size: int, te: bool, on_gpu: bool) -> TrainerSetup:
    """`flag_values`: run.py's trainer flags by field name; `passthrough`: fields given after `--`;
    `te`: Transformer Engine is usable where the trainer will run; `on_gpu`: its ranks use GPUs."""
    plan = make_plan(_absolute(TrainConfig(**{**flag_values, **passthrough})), world_size, on_gpu, te)
    config = plan.config
    argv = to_argv({f.name: getattr(config, f.name) for f in fields() if getattr(config, f.name) != _default(f)})
    return TrainerSetup(plan=plan, argv=argv)
