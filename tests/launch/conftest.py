"""Fixtures of the launcher's tests: run.py with stand-ins for torchrun, singularity and nvidia-smi, and
inputs it plans (tests/support/launcher.py builds both)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ext.checkpoint import layout
from tests.support.launcher import HF_CONFIG, Inputs, Launcher, make_standins, write_prepared_dataset, write_tokenizer


@pytest.fixture
def launcher(tmp_path, launch_bin) -> Launcher:
    return Launcher(bin_dir=launch_bin, record_file=tmp_path / "record.jsonl", cwd=tmp_path)


@pytest.fixture(scope="session")
def launch_bin(tmp_path_factory) -> Path:
    return make_standins(tmp_path_factory.mktemp("standins"))


@pytest.fixture(scope="session")
def inputs(tmp_path_factory) -> Inputs:
    root = tmp_path_factory.mktemp("launch_inputs")
    tokenizer = write_tokenizer(root / "hf", {"<image>": 32000, "<pad>": 32001})
    checkpoint = root / "ckpt"
    (checkpoint / layout.RELEASE).mkdir(parents=True)
    layout.write_metadata(checkpoint / layout.RELEASE, kind="converted", iteration=0, hf_config=HF_CONFIG, tp=1, pp=1,
                          dtype="bfloat16")
    layout.mark_latest(checkpoint, layout.RELEASE)
    write_tokenizer(checkpoint / layout.TOKENIZER_DIR, {"<image>": 32000, "<pad>": 32001})
    data = write_prepared_dataset(root / "data", {"part_0.tar": 600, "part_1.tar": 400, "part_2.tar": 50},
                                  {"train": ["part_0.tar", "part_1.tar"], "val": ["part_2.tar"], "test": []})
    data2 = write_prepared_dataset(root / "elsewhere" / "data2", {"a.tar": 300}, {"train": ["a.tar"], "val": [], "test": []})
    blend = root / "blends" / "mix.yaml"
    blend.parent.mkdir()
    blend.write_text(f"__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
                     f"      - weight: 3\n        path: {data}\n      - weight: 1\n        path: {data2}\n")
    return Inputs(checkpoint=checkpoint, tokenizer=tokenizer, data=data, blend=blend, data2=data2, root=root)
