"""An installed copy (pip install ., not editable, as the Singularity recipe installs it) works
without the checkout: its chat templates are package data, and the trainer starts as a module."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from tests.helpers import REPO_ROOT, child_env, run


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
    assert templates == ["llama-3", "llava-v1", "llm-jp", "plain"]
    trainer = run([sys.executable, "-m", "megatron_ext.train.pretrain_llava", "--help"], cwd=elsewhere, env=env,
                  timeout=120)
    assert "--megatron-load-dir" in trainer.stdout and "--image-aspect" in trainer.stdout
