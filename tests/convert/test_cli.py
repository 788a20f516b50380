"""The three conversion scripts end to end, as a user runs them."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch

from tests.support.helpers import child_env, hf_tensors, run_script


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_scripts_convert_both_ways_and_compare_logits(llava_qwen2_siglip, tmp_path):
    from transformers import LlavaForConditionalGeneration

    megatron = tmp_path / "megatron"
    megatron.mkdir()
    (megatron / "stale.txt").write_text("from an earlier run")
    proc = run_script("convert/convert_hf_to_megatron.py", "--tp", 2, "--pp", 1, "--hf-dir", llava_qwen2_siglip,
                      "--megatron-dir", megatron, "--force", timeout=180)
    assert "TP2 x PP1" in proc.stdout
    assert sorted(p.name for p in megatron.iterdir()) == ["hf_extra.safetensors", "latest_checkpointed_iteration.txt",
                                                         "release", "tokenizer"]

    back = tmp_path / "hf"
    proc = run_script("convert/convert_megatron_to_hf.py", "--tp", 1, "--megatron-dir", megatron, "--hf-dir", back,
                      check=False, timeout=120)
    assert proc.returncode == 2 and not back.exists()
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --tp 1 does not match")

    run_script("convert/convert_megatron_to_hf.py", "--tp", 2, "--pp", 1, "--megatron-dir", megatron, "--hf-dir", back,
               "--max-shard-size", "200KB", timeout=120)
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (back / "model.safetensors").exists()
    original = hf_tensors(llava_qwen2_siglip)
    exported = hf_tensors(back)
    assert sorted(exported) == sorted(original) == sorted(index["weight_map"])
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    _, info = LlavaForConditionalGeneration.from_pretrained(back, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]

    image = tmp_path / "image.png"
    from megatron_ext.convert.compare import synthetic_image

    synthetic_image(seed=3, size=(90, 50)).save(image)
    proc = run_script("convert/compare_hf_megatron.py", "--hf-dir", llava_qwen2_siglip, "--megatron-dir", megatron,
                      "--tp", 1, "--pp", 2, "--image", image, "--prompt", "How many dogs are there?",
                      "--max-diff", "1e-4", timeout=180)
    max_diff = float(re.search(r"max \|dlogit\|:\s+(\S+)", proc.stdout).group(1))
    assert 0 <= max_diff <= 1e-4
    assert re.search(r"argmax agrees at all \d+ positions: yes", proc.stdout)


def _broken_copy(src: Path, dst: Path, change) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _break(tensors):
    """A tensor missing, a stray one and one of the wrong shape: one conversion finds all three."""
    del tensors["language_model.model.layers.1.mlp.up_proj.weight"]
    tensors["stray.weight"] = torch.zeros(2)
    name = "language_model.model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].t().contiguous()


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_problems_found_by_the_workers_name_the_tensors_and_leave_no_output(llava_clip, tmp_path):
    hf_dir = _broken_copy(llava_clip, tmp_path / "hf", _break)
    out = tmp_path / "parent" / "megatron"
    proc = run_script("convert/convert_hf_to_megatron.py", "--hf-dir", hf_dir, "--megatron-dir", out,
                      check=False, timeout=150)
    assert proc.returncode == 2
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: --hf-dir {hf_dir} does not match the model its config.json describes: ")
    for part in ("checkpoint lacks (1): language_model.model.layers.1.mlp.up_proj.weight",
                 "no Megatron tensor uses (1): stray.weight",
                 "do not fit the model (1): language_model.model.layers.0.mlp.down_proj.weight (gives [128, 64]"):
        assert part in error, error
    assert not out.exists() and not list(out.parent.iterdir())  # no temporary directory left either


@pytest.mark.multiprocess
@pytest.mark.parametrize("runtime", ["singularity", "apptainer"])
def test_sif_path_reruns_the_conversion_inside_the_container(llava_clip, tmp_path, runtime):
    """A fake runtime on PATH records how it was called; nothing is converted outside it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / runtime
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path / "argv.txt"}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    sif = tmp_path / "image.sif"
    sif.write_text("")
    out = tmp_path / "megatron"
    env = child_env(PATH=f"{bin_dir}:{os.environ['PATH']}")
    run_script("convert/convert_hf_to_megatron.py", "--tp", 2, "--hf-dir", llava_clip, "--megatron-dir", out,
               "--sif-path", sif, env=env, timeout=60)
    argv = (tmp_path / "argv.txt").read_text().splitlines()
    assert argv[:2] == ["exec", "--nv"]
    assert f"{llava_clip}:{llava_clip}" in argv and f"{tmp_path}:{tmp_path}" in argv
    inner = argv[argv.index(str(sif.resolve())) + 1:]
    assert inner[0] == "python" and inner[1].endswith("scripts/convert/convert_hf_to_megatron.py")
    assert inner[2:] == ["--tp", "2", "--hf-dir", str(llava_clip), "--megatron-dir", str(out)]
    assert not out.exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_the_command_module_imports_no_torch():
    """hf-to-megatron starts the workers' fork server (torch and megatron-core, seconds of imports)
    first thing; a torch import before it would delay every conversion by that long."""
    import subprocess
    import sys

    code = "import sys, megatron_ext.commands.convert; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60, env=child_env()).returncode == 0
