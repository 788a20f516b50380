"""The README's first-screen commands are the ones CI and newcomers run."""

from __future__ import annotations

import re

from tests.support.helpers import REPO_ROOT


def _first_screen_commands() -> list[str]:
    readme = (REPO_ROOT / "README.md").read_text()
    blocks = re.findall(r"```shell\n(.*?)```", readme, re.S)
    return [block.strip() for block in blocks[:2]]


def test_ci_runs_exactly_the_readme_test_command():
    demo, tests = _first_screen_commands()
    assert "run_demo.py" in demo and "pytest" in tests
    ci_lines = [line.strip() for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()]
    assert tests in ci_lines


def test_first_screen_commands_name_existing_files():
    for command in _first_screen_commands():
        for path in re.findall(r"(scripts/[\w/]+\.(?:py|sh))", command):
            assert (REPO_ROOT / path).is_file(), path


def test_setup_and_the_first_screen_say_how_to_run_commands_in_the_venv():
    script = (REPO_ROOT / "scripts" / "setup_env.sh").read_text()
    default_venv = re.search(r"^venv=(\S+)$", script, re.M).group(1)
    last_line = script.strip().splitlines()[-1].replace("$venv", default_venv)
    assert ".venv/bin/python" in last_line and "source .venv/bin/activate" in last_line
    first_screen = (REPO_ROOT / "README.md").read_text().split("## Contents")[0]
    assert ".venv/bin/python scripts/" in first_screen and "source .venv/bin/activate" in first_screen
