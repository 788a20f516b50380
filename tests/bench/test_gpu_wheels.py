"""bench/gpu_wheels.py: which distributions a GPU node lacking a package index gets as wheels (the
closure is read from this environment's installed metadata; nothing is downloaded here)."""

from __future__ import annotations

import importlib.util
import sys

from click.testing import CliRunner

from tests.support.helpers import REPO_ROOT


def _module():
    spec = importlib.util.spec_from_file_location("gpu_wheels", REPO_ROOT / "bench" / "gpu_wheels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_megatron_ext_needs_megatron_core_and_energon_but_not_what_only_the_skipped_ones_need():
    wheels = _module()
    everything, needed = wheels.required("megatron-ext", set()), wheels.required("megatron-ext", set(wheels.SKIPPED))
    assert {"megatron-core", "megatron-energon", "transformers", "av", "webdataset"} <= needed.keys()
    assert not set(wheels.SKIPPED) & needed.keys() and set(wheels.SKIPPED) <= everything.keys()
    # s3fs's own needs leave with it; what the rest needs too stays.
    assert "s3fs" in everything and "aiobotocore" in everything and "aiobotocore" not in needed
    assert needed["megatron-core"] == everything["megatron-core"]


def test_a_pin_names_a_package_megatron_ext_needs(tmp_path):
    (tmp_path / "present.txt").write_text("torch, numpy.")
    result = CliRunner().invoke(_module().main, ["--present", str(tmp_path / "present.txt"), "--dest",
                                                 str(tmp_path / "whl"), "--pin", "megatronn-core==0.16.1"])
    assert result.exit_code == 2 and "'megatronn-core==0.16.1': give NAME==VERSION" in result.output
    assert not (tmp_path / "whl").exists()
