"""An installed copy (pip install ., not editable, as the Singularity recipe installs it) works
without the checkout: its chat templates are package data, the trainer starts as a module, and the
console scripts run from any directory."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from tests.support.helpers import REPO_ROOT, child_env, run


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_an_installed_copy_runs_without_the_checkout(tmp_path):
    source, site, elsewhere = tmp_path / "src", tmp_path / "site", tmp_path / "elsewhere"
    # A copy of what the recipe copies, so the build leaves nothing in the checkout.
    shutil.copytree(REPO_ROOT / "megatron_ext", source / "megatron_ext", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", site,
         source], timeout=240)
    elsewhere.mkdir()
    env = child_env(PYTHONPATH=str(site))
    probe = ("import json, megatron_ext; from megatron_ext.container import checkout_root; "
             "from megatron_ext.data.chat_template import template_names; "
             "print(json.dumps([megatron_ext.__file__, str(checkout_root()), template_names()]))")
    where, checkout, templates = json.loads(run([sys.executable, "-c", probe], cwd=elsewhere, env=env,
                                                timeout=60).stdout)
    assert where.startswith(str(site)) and checkout == "None"
    # Package data: every bundled chat template is installed.
    assert templates == sorted(p.stem for p in (REPO_ROOT / "megatron_ext/data/chat_templates").glob("*.jinja"))
    assert {"chatml", "gemma", "llama-3", "llava-v1", "llm-jp", "plain"} <= set(templates)
    trainer = run([sys.executable, "-m", "megatron_ext.train.pretrain_llava", "--help"], cwd=elsewhere, env=env,
                  timeout=120)
    assert "--megatron-load-dir" in trainer.stdout and "--image-aspect" in trainer.stdout
    # The console scripts pip wrote: a dataset made and built from a directory outside the checkout.
    for name in ("train", "convert", "data", "generate", "chat", "evaluate", "demo", "parity"):
        assert (site / "bin" / f"megatron-ext-{name}").is_file(), name
    data = site / "bin" / "megatron-ext-data"
    run([sys.executable, data, "synthetic", "--output-dir", "src", "--num-samples", "8"], cwd=elsewhere, env=env,
        timeout=120)
    built = run([sys.executable, data, "build", "src/llava.json", "--output-dir", "energon", "--split-ratio", "1,1,0",
                 "--samples-per-shard", "4", "--num-workers", "0"], cwd=elsewhere, env=env, timeout=180)
    assert "wrote 8 samples in 2 shards" in built.stdout
    assert "Usage: megatron-ext-train" in run([sys.executable, site / "bin" / "megatron-ext-train", "--help"],
                                              cwd=elsewhere, env=env, timeout=120).stdout
    assert "Usage: megatron-ext-parity" in run([sys.executable, site / "bin" / "megatron-ext-parity", "--help"],
                                               cwd=elsewhere, env=env, timeout=120).stdout
