"""run.py's memory plan: printed by a dry run, a launch over --gpu-memory refused before anything starts."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import REPO_ROOT, run


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_dry_run_prints_the_plan_and_a_launch_over_budget_is_one_line(launcher, inputs):
    args = ["-g", "8", "--tp", "4", "--megatron-load-dir", inputs.checkpoint, "--data-path", inputs.data, "--stage", "2"]
    dry = launcher.run(*args, "--dry-run", gpus=8, timeout=100)
    assert dry.returncode == 0, dry.stderr
    plan = [line for line in dry.stderr.splitlines() if "memory plan per GPU" in line or "stage 1/1" in line]
    assert plan[0].startswith("run.py: memory plan per GPU: tp 4 x pp 1 x dp 2, bfloat16"), dry.stderr
    assert "stage 1/1, tp ranks 0-3: parameters" in plan[1]
    refused = launcher.run(*args, "--gpu-memory", "0.001", gpus=8, timeout=100)
    assert refused.returncode == 2 and launcher.records() == []
    (line,) = refused.stderr.strip().splitlines()[-1:]
    assert line.startswith("error: memory plan: stage 1/1, tp ranks 0-3 needs ") and "largest part: " in line


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_plan_command_prints_layouts_side_by_side(launcher, inputs):
    proc = run([sys.executable, "-c", "from megatron_ext.commands.train import main; main()", "plan", "--layouts",
                "4x2,8x1,2x4", "-g", "8", "--megatron-load-dir", str(inputs.checkpoint), "--data-path", str(inputs.data),
                "--stage", "2"], timeout=100, cwd=REPO_ROOT, env=launcher.env(gpus=8))
    rows = {line[:22].strip(): [cell.strip() for cell in line[22:].split("  ") if cell.strip()]
            for line in proc.stdout.splitlines()}
    assert rows["layout (tp x pp x dp)"] == ["4 x 2 x 1", "8 x 1 x 1", "2 x 4 x 1"], proc.stdout
    assert rows["largest rank"][1] == "stage 1/1, tp 0-7" and rows["fits"] == ["yes", "yes", "yes"]
    # Each layout splits the weights differently: three different largest ranks.
    assert len(set(rows["parameters"])) == 3 and all(cell.endswith("MiB") for cell in rows["parameters"])
