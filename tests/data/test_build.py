"""build_energon_dataset: shards in the README layout, prepared for energon, bad samples reported."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
import torch
import yaml
from PIL import Image

from megatron_ext.data import build
from megatron_ext.data.build import build_energon_dataset
from megatron_ext.data.splits import split_sizes
from megatron_ext.errors import UserError
from tests.data.mix665k import BAD, GOOD, write_mix665k
from tests.support.helpers import run_script
from tests.support.samples import jpeg


@pytest.fixture
def messy_input(tmp_path):
    """A mix665k-shaped input (tests/data/mix665k.py): good records of every kind and bad ones."""
    return write_mix665k(tmp_path)


def _shard_members(out):
    members = {}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                members[m.name] = tar.extractfile(m).read()
    return members


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_every_good_record_of_a_mix665k_shaped_input_is_kept(messy_input, tmp_path, llava_clip):
    out = tmp_path / "out"
    report = build_energon_dataset(messy_input, out, split_ratio="1,0,0", samples_per_shard=4, num_workers=2)
    assert report.written == len(GOOD) and report.shards == 4
    assert report.splits == {"train": len(GOOD), "val": 0, "test": 0}
    assert (report.text_only, report.multi_image, report.max_images) == (2, 2, 3)
    assert report.skipped == BAD
    saved = json.loads((out / "build_report.json").read_text())
    assert {s["id"]: s["reason"] for s in saved["skipped_samples"]}["corrupt"] == "corrupt image"
    assert f"skipped {sum(BAD.values())} samples" in report.summary()
    assert "2 text-only (14.3%), 2 with several images (14.3%, up to 3 in one sample)" in report.summary()

    records = {r["id"]: r for r in json.loads(messy_input.read_text()) if isinstance(r, dict)}
    members = _shard_members(out)
    by_id = {json.loads(data)["id"]: name.split(".")[0] for name, data in members.items() if name.endswith(".json")}
    assert sorted(by_id) == sorted(GOOD)
    images = tmp_path
    # JPEGs and PNGs are stored byte for byte; a GIF becomes a PNG; text-only samples have no image.
    assert members[f"{by_id['coco-before']}.jpg"] == (images / records["coco-before"]["image"]).read_bytes()
    assert members[f"{by_id['vg-cmyk']}.jpg"] == (images / records["vg-cmyk"]["image"]).read_bytes()
    assert members[f"{by_id['ocr-png']}.png"] == (images / records["ocr-png"]["image"]).read_bytes()
    assert members[f"{by_id['gif']}.png"][:8] == b"\x89PNG\r\n\x1a\n"
    assert not [n for n in members if n.startswith(by_id["sharegpt-1"]) and n.endswith(("jpg", "png"))]
    assert [n.split(".", 1)[1] for n in sorted(members) if n.startswith(by_id["interleave-3"])] == \
        ["0.jpg", "1.png", "2.jpg", "json", "txt"]
    assert json.loads(members[f"{by_id['coco-before']}.json"]) == \
        {"question": "<image>\nWhat is in the picture?", "id": "coco-before"}
    assert members[f"{by_id['ocr-png']}.txt"] == b"Nobody."
    assert len(json.loads(members[f"{by_id['multi-turn']}.json"])["conversations"]) == 6

    # Every kept record reaches the task encoder with its images, in order, and its answers.
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset

    from megatron_ext.data.task_encoder import LlavaTaskEncoder
    from megatron_ext.families import read_llava

    arch = read_llava(json.loads((llava_clip / "config.json").read_text()))
    encoder = LlavaTaskEncoder.for_model(str(llava_clip), arch, seq_length=256)
    dataset = get_val_dataset(str(out), split_part="train", worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                              batch_size=4, task_encoder=encoder)
    ids = {key: record_id for record_id, key in by_id.items()}
    seen, pixels = {}, {}
    for batch in get_loader(dataset):
        assert batch.num_skipped == 0
        counts = (batch.input_ids == arch.image_token_index).sum(1).tolist()
        assert batch.images.shape[0] == sum(counts)
        for row, key in enumerate(batch.__key__):
            seen[ids[key]] = counts[row]
            pixels[ids[key]] = batch.images[sum(counts[:row]):sum(counts[:row + 1])]
    assert seen == GOOD

    # The PNG's pixels reach the model as the original file gives them; a JPEG copy would not.
    png = Image.open(images / records["ocr-png"]["image"])
    assert torch.equal(pixels["ocr-png"][0], encoder.images([png])[0])
    as_jpeg = io.BytesIO()
    png.convert("RGB").save(as_jpeg, "JPEG", quality=95)
    assert not torch.equal(pixels["ocr-png"][0], encoder.images([Image.open(as_jpeg)])[0])


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_strict_stops_at_the_first_bad_sample_and_writes_nothing(messy_input, tmp_path):
    out = tmp_path / "strict"
    proc = run_script("data/build_energon_dataset.py", messy_input, "--output-dir", out, "--strict", "--num-workers", "0",
                      check=False, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {messy_input}: sample 14 (id missing): missing image file "
        f"({messy_input.parent / 'coco/train2017/nowhere.jpg'}) (--strict stops at the first bad sample)"
    )
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".strict")]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_json_that_is_not_a_list_is_one_clear_error(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"id": "1", "image": "a.jpg", "conversations": []}))
    proc = run_script("data/build_energon_dataset.py", path, "--output-dir", tmp_path / "out", check=False, timeout=120,
                      fresh=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: INPUT {path} holds a JSON dict, not a list of LLaVA samples " \
                                  '([{"id", "image", "conversations": [...]}, ...])'
    assert not (tmp_path / "out").exists()


def test_failed_prepare_leaves_no_dataset(messy_input, tmp_path, monkeypatch):
    def broken_prepare(path, shards, num_workers, dataset_yaml):
        assert list(path.glob("*.tar"))
        raise UserError("energon prepare failed on the new shards: boom")

    monkeypatch.setattr(build, "run_energon_prepare", broken_prepare)
    with pytest.raises(UserError, match="boom"):
        build_energon_dataset(messy_input, tmp_path / "out", split_ratio="1,0,0", num_workers=0)
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.multiprocess  # energon's indexing forks its workers
@pytest.mark.timeout(120)
def test_shards_energon_cannot_index_are_refused_in_one_line_naming_energons_reason(tmp_path):
    tarfile.open(tmp_path / "000000.tar", "w").close()  # a shard without a sample
    with pytest.raises(UserError) as refused:
        build.run_energon_prepare(tmp_path, {"train": [0]}, num_workers=1)
    assert str(refused.value) == "energon prepare failed on the new shards: AssertionError: Shard 000000.tar has no samples."


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


@pytest.mark.parametrize("records, ratio, sizes", [
    (37, "9,1,0", {"train": 33, "val": 4, "test": 0}),
    (2, "9,1,0", {"train": 1, "val": 1, "test": 0}),
    (3, "98,1,1", {"train": 1, "val": 1, "test": 1}),
    (1000, "8,1,1", {"train": 800, "val": 100, "test": 100}),
])
def test_every_non_zero_share_gets_records(records, ratio, sizes):
    assert split_sizes(records, ratio) == sizes


def test_too_few_records_for_the_ratio_are_refused_in_one_line():
    with pytest.raises(UserError) as refused:
        split_sizes(2, "1,1,1")
    assert str(refused.value) == ("--split-ratio 1,1,1 needs at least 3 records (one per non-zero share), INPUT has 2: "
                                  "give more records or --split-ratio 1,0,0")


def _shard_keys(out, shards) -> list[str]:
    return sorted(name.split(".")[0] for name in _shard_members_of(out, shards) if name.endswith(".json"))


def _shard_members_of(out, shards) -> list[str]:
    names = []
    for shard in shards:
        with tarfile.open(out / shard) as tar:
            names += tar.getnames()
    return names


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_small_input_built_with_the_defaults_has_train_and_val_samples(tmp_path):
    from megatron_ext.demo.synthetic_data import SyntheticSpec, make_synthetic_dataset

    source = make_synthetic_dataset(tmp_path / "src", SyntheticSpec(num_samples=37))
    out = tmp_path / "out"
    report = build_energon_dataset(source, out, num_workers=0)
    assert report.splits == {"train": 33, "val": 4, "test": 0} and report.shards == 2
    # By record, in input order: the last four records are val, in a shard of their own.
    parts = yaml.safe_load((out / ".nv-meta" / "split.yaml").read_text())["split_parts"]
    assert parts == {"train": ["000000.tar"], "val": ["000001.tar"], "test": []}
    assert _shard_keys(out, ["000001.tar"]) == [f"{i:09d}" for i in range(33, 37)]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_split_whose_records_were_all_skipped_is_refused_and_nothing_is_written(tmp_path):
    from megatron_ext.demo.synthetic_data import SyntheticSpec, make_synthetic_dataset

    source = make_synthetic_dataset(tmp_path / "src", SyntheticSpec(num_samples=10))
    records = json.loads(source.read_text())
    records[9]["image"] = "images/nowhere.jpg"
    source.write_text(json.dumps(records))
    with pytest.raises(UserError) as refused:
        build_energon_dataset(source, tmp_path / "out", num_workers=0)
    assert str(refused.value) == ("--split-ratio 9,1,0: every record of the val split (records 9-9 of INPUT) was "
                                  "skipped; fix them (--strict names the first) or change --split-ratio")
    assert not (tmp_path / "out").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_summary_names_the_first_skipped_records_by_id_and_points_to_the_report_for_the_rest(messy_input, tmp_path):
    (messy_input.parent / "coco/train2017/noise.jpg").write_bytes(b"not a picture at all")
    records = json.loads(messy_input.read_text())
    records.insert(0, {"id": "noise", "image": "coco/train2017/noise.jpg",
                       "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "Red."}]})
    messy_input.write_text(json.dumps(records))
    report = build_energon_dataset(messy_input, tmp_path / "out", split_ratio="1,0,0", num_workers=0)
    lines = report.summary().splitlines()
    named = lines[lines.index("  sample 0 (id noise): corrupt image "
                              f"({messy_input.parent / 'coco/train2017/noise.jpg'}: not an image format PIL can read)"):]
    assert len(named) == 6 and all(line.startswith("  sample ") for line in named[:5])
    assert named[5] == f"  and {sum(BAD.values()) + 1 - 5} more in build_report.json"
    assert "BytesIO" not in (tmp_path / "out" / "build_report.json").read_text()
