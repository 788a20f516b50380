"""run.py's memory plan: printed by a dry run, a launch over --gpu-memory refused before anything starts.

The launcher's click commands run in this process (run.py is `invoke(launch, argv)`, as `main` here),
with the stand-ins' PATH and 8 GPUs as their environment (the stand-in nvidia-smi is the one process
started): each case costs its memory plans, not a Python start and megatron-core's import.
"""

from __future__ import annotations

import sys
from unittest import mock

import pytest


def megatron_ext_train(launcher, monkeypatch, *argv: str, gpus: int = 8) -> int:
    """The exit status of `megatron-ext-train ARGV` (run.py's command, or `plan`) in this process."""
    from megatron_ext.commands.train import main

    monkeypatch.chdir(launcher.cwd)
    monkeypatch.setattr(sys, "argv", ["megatron-ext-train", *argv])
    launcher.record_file.unlink(missing_ok=True)
    with mock.patch.dict("os.environ", launcher.env(gpus=gpus), clear=True), pytest.raises(SystemExit) as exited:
        main()
    return exited.value.code


@pytest.mark.multiprocess
def test_dry_run_prints_the_plan_and_a_launch_over_budget_is_one_line(launcher, inputs, monkeypatch, capsys):
    args = ["-g", "8", "--tp", "4", "--megatron-load-dir", str(inputs.checkpoint), "--data-path", str(inputs.data),
            "--stage", "2"]
    assert megatron_ext_train(launcher, monkeypatch, *args, "--dry-run") == 0
    dry = capsys.readouterr().err
    plan = [line for line in dry.splitlines() if "memory plan per GPU" in line or "stage 1/1" in line]
    assert plan[0].startswith("run.py: memory plan per GPU: tp 4 x pp 1 x dp 2, bfloat16"), dry
    assert "stage 1/1, tp ranks 0-3: parameters" in plan[1]
    assert megatron_ext_train(launcher, monkeypatch, *args, "--gpu-memory", "0.001") == 2
    assert launcher.records() == []
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.startswith("error: memory plan: stage 1/1, tp ranks 0-3 needs ") and "largest part: " in line


@pytest.mark.multiprocess
def test_plan_command_prints_layouts_side_by_side(launcher, inputs, monkeypatch, capsys):
    status = megatron_ext_train(launcher, monkeypatch, "plan", "--layouts", "4x2,8x1,2x4", "-g", "8",
                                "--megatron-load-dir", str(inputs.checkpoint), "--data-path", str(inputs.data),
                                "--stage", "2")
    out = capsys.readouterr().out
    assert status == 0, out
    rows = {line[:22].strip(): [cell.strip() for cell in line[22:].split("  ") if cell.strip()]
            for line in out.splitlines()}
    assert rows["layout (tp x pp x dp)"] == ["4 x 2 x 1", "8 x 1 x 1", "2 x 4 x 1"], out
    assert rows["largest rank"][1] == "stage 1/1, tp 0-7" and rows["fits"] == ["yes", "yes", "yes"]
    # Each layout splits the weights differently: three different largest ranks.
    assert len(set(rows["parameters"])) == 3 and all(cell.endswith("MiB") for cell in rows["parameters"])
