"""bench/gpu_wheels.py: which distributions a GPU node lacking a package index gets as wheels (the
closure is read from this environment's installed metadata; nothing is downloaded here)."""

from __future__ import annotations

from click.testing import CliRunner

from bench import gpu_wheels


def test_megatron_ext_needs_megatron_core_and_energon_but_not_what_only_the_skipped_ones_need():
    skipped = set(gpu_wheels.SKIPPED)
    everything, needed = gpu_wheels.required("megatron-ext", set()), gpu_wheels.required("megatron-ext", skipped)
    assert {"megatron-core", "megatron-energon", "transformers", "av", "webdataset"} <= needed.keys()
    assert not skipped & needed.keys() and skipped <= everything.keys()
    # s3fs's own needs leave with it; what the rest needs too stays.
    assert "s3fs" in everything and "aiobotocore" in everything and "aiobotocore" not in needed
    assert needed["megatron-core"] == everything["megatron-core"]


def test_an_extras_needs_come_along_only_when_asked_for():
    plain = gpu_wheels.required("megatron-ext", set())
    with_dev = gpu_wheels.required("megatron-ext", set(), ("dev",))
    assert {"pytest", "pexpect", "ptyprocess", "trl"} <= with_dev.keys()  # pexpect's own need comes too
    assert not {"pytest", "pexpect", "ptyprocess", "trl"} & plain.keys()
    assert plain.keys() < with_dev.keys()


def test_a_pin_names_a_package_megatron_ext_needs(tmp_path):
    (tmp_path / "present.txt").write_text("torch, numpy.")
    result = CliRunner().invoke(gpu_wheels.main, ["--present", str(tmp_path / "present.txt"), "--dest",
                                                 str(tmp_path / "whl"), "--pin", "megatronn-core==0.16.1"])
    assert result.exit_code == 2 and "'megatronn-core==0.16.1': give NAME==VERSION" in result.output
    assert not (tmp_path / "whl").exists()
