"""The trainer's command line, generated from `TrainConfig` (one option per field)."""

from __future__ import annotations

import typing

import click

from megatron_ext.config.options import TrainConfig, fields, is_switch, option_name


def click_kwargs(field, hint) -> dict:
    kwargs = {"help": field.metadata["help"], "show_default": True}
    # `int | None` -> int; `list[str]` stays list[str].
    base = next(a for a in typing.get_args(hint) if a is not type(None)) if type(None) in typing.get_args(hint) else hint
    choices = field.metadata.get("choices")
    if base is bool:
        return {**kwargs, "is_flag": True, "default": field.default}
    if typing.get_origin(base) is list:
        return {**kwargs, "multiple": True, "type": str, "default": ()}
    if choices and base is int:
        return {**kwargs, "type": click.IntRange(min(choices), max(choices)), "default": field.default}
    if choices:
        return {**kwargs, "type": click.Choice(choices), "default": None if field.default is None else str(field.default)}
    return {**kwargs, "type": base, "default": field.default}


def option_decls(field) -> list[str]:
    """`--name` (and `--no-name` for a switch), then the parameter name."""
    flag = option_name(field.name)
    return [f"{flag}/--no-{flag[2:]}" if is_switch(field) else flag, field.name]


def trainer_options(func):
    """Decorate a click command with every TrainConfig option; it receives `config=TrainConfig(...)`."""
    hints = typing.get_type_hints(TrainConfig)

    def wrapper(**values):
        values = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
        return func(config=TrainConfig(**values))

    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    for f in reversed(fields()):
        wrapper = click.option(*option_decls(f), **click_kwargs(f, hints[f.name]))(wrapper)
    return wrapper
