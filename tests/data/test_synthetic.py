"""The synthetic dataset: reproducible, answers that match the pictures, and the two CLIs end to end."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from megatron_ext.demo.synthetic_data import COLORS, SyntheticSpec, make_synthetic_dataset
from tests.support.helpers import run_script


def test_same_seed_same_dataset_and_answers_match_pictures(tmp_path):
    spec = SyntheticSpec(num_samples=12, image_format="png", seed=5)
    a = make_synthetic_dataset(tmp_path / "a", spec)
    b = make_synthetic_dataset(tmp_path / "b", spec)
    c = make_synthetic_dataset(tmp_path / "c", SyntheticSpec(num_samples=12, image_format="png", seed=6))
    assert a.read_text() == b.read_text() != c.read_text()
    assert (a.parent / "images/000003.png").read_bytes() == (b.parent / "images/000003.png").read_bytes()
    for record in json.loads(a.read_text()):
        replies = [t["value"] for t in record["conversations"] if t["from"] == "gpt"]
        named = [color for color in COLORS if any(color in r for r in replies)]
        image = Image.open(a.parent / record["image"]).convert("RGB")
        if named:
            assert COLORS[named[0]] in {rgb for _, rgb in image.getcolors(maxcolors=1 << 16)}
        human = [t["value"] for t in record["conversations"] if t["from"] == "human"]
        assert sum(h.count("<image>") for h in human) == 1


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_cli_synthetic_japanese_to_prepared_dataset(tmp_path):
    run_script("data/make_synthetic_dataset.py", "--output-dir", tmp_path / "src", "--num-samples", 10,
               "--lang", "ja", timeout=120)
    records = json.loads((tmp_path / "src" / "llava.json").read_text())
    assert records[0]["conversations"][1]["value"].endswith("。")
    proc = run_script("data/build_energon_dataset.py", tmp_path / "src" / "llava.json", "--output-dir", tmp_path / "energon",
                      "--samples-per-shard", 5, "--num-workers", 1, "--split-ratio", "1,0,0", timeout=120)
    assert f"wrote 10 samples in 2 shards to {tmp_path / 'energon'}" in proc.stdout
    assert "skipped 0 samples" in proc.stdout
    assert (tmp_path / "energon" / ".nv-meta" / "dataset.yaml").is_file()
