"""build_energon_dataset: shards in the README layout, prepared for energon, bad samples reported."""

from __future__ import annotations

import json
import tarfile

import pytest
from PIL import Image

from megatron_ext.data import build
from megatron_ext.data.build import build_energon_dataset
from megatron_ext.errors import UserError
from tests.data.conftest import jpeg
from tests.helpers import run_script


def _turns(question, *answers):
    turns = [{"from": "human", "value": question}]
    for i, answer in enumerate(answers):
        if i:
            turns.append({"from": "human", "value": f"And {i}?"})
        turns.append({"from": "gpt", "value": answer})
    return turns


@pytest.fixture
def messy_input(tmp_path):
    """Ten records: three usable (a JPEG, a PNG, a multi-turn one) and one of every kind of bad one."""
    images = tmp_path / "images"
    images.mkdir()
    (images / "good.jpg").write_bytes(jpeg())
    Image.new("RGBA", (33, 20), (0, 90, 200, 255)).save(images / "good.png")
    (images / "corrupt.jpg").write_bytes(jpeg()[:200])
    records = [
        {"id": "jpg", "image": "good.jpg", "conversations": _turns("<image>\nWhat color?", "Red.")},
        {"id": "png", "image": "good.png", "conversations": _turns("What color?\n<image>", "Blue.")},
        {"id": "missing", "image": "nowhere.jpg", "conversations": _turns("<image>\nWhat?", "Red.")},
        {"id": "corrupt", "image": "corrupt.jpg", "conversations": _turns("<image>\nWhat?", "Red.")},
        {"id": "no-gpt", "image": "good.jpg", "conversations": _turns("<image>\nWhat?")},
        {"id": "no-marker", "image": "good.jpg", "conversations": _turns("What?", "Red.")},
        {"id": "empty", "image": "good.jpg", "conversations": _turns("<image>\nWhat?", " ")},
        {"id": "text-only", "conversations": _turns("<image>\nWhat?", "Red.")},
        {"id": "multi", "image": "good.jpg", "conversations": _turns("<image>\nWhat color?", "Red.", "Round.", "Small.")},
        "not a record",
    ]
    path = tmp_path / "llava.json"
    path.write_text(json.dumps(records))
    return path


def _shard_members(out):
    members = {}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                members[m.name] = tar.extractfile(m).read()
    return members


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_bad_samples_are_counted_and_reported(messy_input, tmp_path):
    out = tmp_path / "out"
    report = build_energon_dataset(messy_input, out, messy_input.parent / "images", split_ratio="1,0,0",
                                   samples_per_shard=2, num_workers=2)
    assert report.written == 3 and report.shards == 2
    assert report.splits == {"train": 3, "val": 0, "test": 0}
    assert report.skipped == {
        "missing image file": 1, "corrupt image": 1, "no gpt turn": 1, "no <image> in a human turn": 1,
        "empty answer": 1, "no image given": 1, "malformed record": 1,
    }
    saved = json.loads((out / "build_report.json").read_text())
    assert {s["id"]: s["reason"] for s in saved["skipped_samples"]}["corrupt"] == "corrupt image"
    assert sorted(p.name for p in out.glob("*.tar")) == ["000000.tar", "000001.tar"]

    members = _shard_members(out)
    assert sorted(members) == sorted(f"{i:09d}.{ext}" for i in (0, 1, 8) for ext in ("jpg", "txt", "json"))
    # A JPEG is stored as is; anything else is re-encoded to JPEG.
    assert members["000000000.jpg"] == (messy_input.parent / "images" / "good.jpg").read_bytes()
    assert members["000000001.jpg"][:2] == b"\xff\xd8"
    assert json.loads(members["000000000.json"]) == {"question": "<image>\nWhat color?", "id": "jpg"}
    assert members["000000000.txt"] == b"Red."
    multi = json.loads(members["000000008.json"])
    assert multi["question"] == "<image>\nWhat color?" and len(multi["conversations"]) == 6
    assert members["000000008.txt"] == b"Red."
    assert "skipped 7 samples" in report.summary()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_strict_stops_at_the_first_bad_sample_and_writes_nothing(messy_input, tmp_path):
    out = tmp_path / "strict"
    proc = run_script("data/build_energon_dataset.py", messy_input, "--output-dir", out, "--strict", "--num-workers", "0",
                      "--image-root", messy_input.parent / "images",
                      check=False, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {messy_input}: sample 2 (id missing): missing image file "
        f"({messy_input.parent / 'images' / 'nowhere.jpg'}) (--strict stops at the first bad sample)"
    )
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".strict")]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_json_that_is_not_a_list_is_one_clear_error(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"id": "1", "image": "a.jpg", "conversations": []}))
    proc = run_script("data/build_energon_dataset.py", path, "--output-dir", tmp_path / "out", check=False, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: INPUT {path} holds a JSON dict, not a list of LLaVA samples " \
                                  '([{"id", "image", "conversations": [...]}, ...])'
    assert not (tmp_path / "out").exists()


def test_failed_prepare_leaves_no_dataset(messy_input, tmp_path, monkeypatch):
    def broken_prepare(path, split_ratio, num_workers):
        assert list(path.glob("*.tar"))
        raise UserError("energon prepare failed on the new shards: boom")

    monkeypatch.setattr(build, "run_energon_prepare", broken_prepare)
    with pytest.raises(UserError, match="boom"):
        build_energon_dataset(messy_input, tmp_path / "out", messy_input.parent / "images", num_workers=0)
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_jsonl_question_answer_input(tmp_path):
    (tmp_path / "a.jpg").write_bytes(jpeg())
    lines = [json.dumps({"image": "a.jpg", "question": "What color is it?", "answer": "Red."}),
             "{broken",
             json.dumps({"image": "a.jpg", "question": "Size?"}),
             json.dumps({"image": "a.jpg", "question": "Shape?", "answer": "A square."})]
    (tmp_path / "qa.jsonl").write_text("\n".join(lines) + "\n")
    report = build_energon_dataset(tmp_path / "qa.jsonl", tmp_path / "out", split_ratio="1,0,0", num_workers=0)
    assert report.written == 2 and report.skipped == {"malformed record": 2}
    members = _shard_members(tmp_path / "out")
    assert json.loads(members["000000003.json"]) == {"question": "Shape?", "id": "3"}


def test_refuses_non_empty_output_and_bad_split(messy_input, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(UserError, match="is not empty"):
        build_energon_dataset(messy_input, tmp_path / "full")
    with pytest.raises(UserError, match="--split-ratio"):
        build_energon_dataset(messy_input, tmp_path / "new", split_ratio="9,1")
