"""--dry-run stays light without its memory plan (--no-memory-check): it imports no torch, megatron,
transformers, energon or numpy."""

from __future__ import annotations

import json
import sys

import pytest

from tests.support.helpers import run
from tests.support.launcher import RUN_PY, Launcher, make_standins

HEAVY = {"torch", "megatron", "transformers", "numpy", "safetensors", "tokenizers", "webdataset"}

PROBE = f"""
import json, runpy, sys
sys.argv = ["run.py", *json.loads(sys.argv[1])]
try:
    runpy.run_path({str(RUN_PY)!r}, run_name="__main__")
except SystemExit as exc:
    status = exc.code
loaded = sorted({{name.split(".")[0] for name in sys.modules}} & set({sorted(HEAVY)!r}))
print(json.dumps({{"status": status, "heavy": loaded}}))
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_readme_stage2_example_dry_run_imports_nothing_heavy(launcher, inputs, tmp_path):
    sif = tmp_path / "demo.sif"
    sif.write_text("image")
    # The original README's stage-2 example, with the dataset it left implicit.
    args = ["-g", "8", "--tp", "4", "--pp", "1", "--node", "1", "--name", "llavajp13b-tp4-pp1-dp2-stage2",
            "--megatron-load-dir", str(inputs.checkpoint), "--save-dir", str(tmp_path / "save"),
            "--tokenizer-load-dir", str(inputs.tokenizer), "--sif-path", str(sif), "--stage", "2",
            "--save-interval", "2000", "--wandb", "--data-path", str(inputs.data), "--dry-run", "--no-memory-check"]
    proc = run([sys.executable, "-c", PROBE, json.dumps(args)], timeout=50, cwd=tmp_path, env=launcher.env(gpus=8))
    command, report = proc.stdout.strip().splitlines()
    assert json.loads(report) == {"status": 0, "heavy": []}, proc.stderr
    assert command.startswith("SINGULARITYENV_CUDA_DEVICE_MAX_CONNECTIONS=1 singularity exec --nv ") and " torchrun --nnodes 1 --nproc-per-node 8 " in command
    assert launcher.records() == []


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_dry_run_with_an_image_where_no_container_runtime_is_installed(inputs, tmp_path):
    bin_dir = make_standins(tmp_path / "bin", names=("torchrun", "nvidia-smi"))
    launcher = Launcher(bin_dir=bin_dir, record_file=tmp_path / "record.jsonl", cwd=tmp_path)
    sif = tmp_path / "demo.sif"
    sif.write_text("image")
    args = ["--megatron-load-dir", inputs.checkpoint, "--data-path", inputs.data, "--sif-path", sif]
    dry = launcher.run(*args, "--dry-run", gpus=2)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith("SINGULARITYENV_CUDA_DEVICE_MAX_CONNECTIONS=1 singularity exec --nv ")
    assert "neither singularity nor apptainer is installed here" in dry.stderr
    real = launcher.run(*args, gpus=2)
    assert real.returncode == 2 and real.stderr.strip() == \
        "error: --sif-path needs singularity or apptainer on PATH; neither was found"
    assert launcher.records() == []


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_dry_run_with_its_memory_plan_prints_only_its_own_lines(launcher, inputs):
    dry = launcher.run("--megatron-load-dir", inputs.checkpoint, "--data-path", inputs.data, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    lines = dry.stderr.strip().splitlines()
    # megatron-core's UserWarnings (no TE / Apex, deprecated defaults) and "LLaVA is work in progress" are not ours.
    assert any("memory plan per GPU" in line for line in lines)
    assert [line for line in lines if not line.startswith("run.py: ")] == []
