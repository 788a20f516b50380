"""Every concrete command of ours in README.md and docs/*.md parses as written: its program exists,
its options exist and take the values shown, and run.py's trainer options stand after `--`.

The commands are parsed by their own click programs, not run: placeholders (`<save-dir>`) and Hub
names need no files, and nothing is trained. Synopses (`[--flag VALUE]`, `a|b`) are left out; a
command shortened with `...` (for the options shown before) may leave out required options, nothing else.
"""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import click
import pytest

from megatron_ext.errors import UserError
from tests.support.helpers import REPO_ROOT

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"```shell\n(.*?)```", re.S)
_IMPORT = re.compile(r"^from (megatron_ext\.[\w.]+) import (\w+)", re.M)
_CALL = re.compile(r"(?:run_command|invoke)\((\w+)")
_LAUNCHER = "scripts/train/run.py"
_PLACEHOLDER = re.compile(r"<[^<>\n]*>")


def _lines(text: str) -> list[str]:
    """The command lines of the shell blocks, continuations joined, prompts and `&&` chains split."""
    lines = []
    for block in _BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            # A trailing `&` runs the command in the background: the command is the same.
            line = line.strip().removeprefix("$ ").removesuffix("&").strip()
            lines += [part.strip() for part in line.split("&&") if part.strip()]
    return lines


def _script_command(script: Path) -> click.Command | None:
    """The click command a script under scripts/ runs (as its `run_command(...)` or `invoke(...)` names it)."""
    text = script.read_text()
    called = _CALL.search(text)
    imports = dict((name, module) for module, name in _IMPORT.findall(text))
    if called is None or called.group(1) not in imports:
        return None
    command = getattr(importlib.import_module(imports[called.group(1)]), called.group(1))
    return command if isinstance(command, click.Command) else None


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(where, script path, its arguments) of every concrete command running one of our scripts."""
    found = []
    for doc in DOCS:
        for line in _lines(doc.read_text()):
            if "[" in line or re.search(r"\S\|\S", line):
                continue  # a synopsis, not a command
            # A placeholder (`<save-dir>`, a quoted "...") stands for one value; "1" passes as a path, a
            # name and a number alike.
            words = shlex.split(_PLACEHOLDER.sub("1", line.replace('"..."', "1")), comments=True)
            scripts = [i for i, word in enumerate(words) if word.startswith("scripts/") and word.endswith(".py")]
            if scripts:
                at = scripts[0]
                found.append((f"{doc.name}: {line[:90]}", words[at], words[at + 1:]))
    return found


def _parse(script: str, args: list[str]) -> None:
    """Raises what the program would say of `args` before doing anything."""
    from megatron_ext.launch.flags import misplaced_trainer_option, passthrough_options, split_argv

    command = _script_command(REPO_ROOT / script)
    assert command is not None, f"{script} runs no click command this test knows"
    if script == _LAUNCHER:
        args, passthrough = split_argv(args)
        misplaced = misplaced_trainer_option(command, args)
        if misplaced:
            raise UserError(f"{misplaced} is the trainer's option: give it after --")
        passthrough_options(passthrough)
    command.make_context(Path(script).name, args)


COMMANDS = documented_commands()


def test_the_docs_hold_commands_of_every_kind():
    print(f"{len(COMMANDS)} documented commands parsed")
    assert len(COMMANDS) >= 30 and {script for _, script, _ in COMMANDS} >= {
        _LAUNCHER, "scripts/data/build_energon_dataset.py", "scripts/eval/generate.py"}


@pytest.mark.parametrize("where, script, args", COMMANDS, ids=[where for where, _, _ in COMMANDS])
def test_a_documented_command_parses_as_written(where, script, args):
    shortened = "..." in args  # `run.py ... --data-path blend.yaml`: options shown before are left out
    args = [arg for arg in args if arg != "..."]
    try:
        _parse(script, args)
    except click.MissingParameter:
        assert shortened, "a required option is missing"
    except (click.ClickException, UserError) as exc:
        message = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
        pytest.fail(f"{script}: {message}")
