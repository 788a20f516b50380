"""build_energon_dataset --task preference: pairs from three record shapes, written once per pair in
the layout the DPO trainer reads, bad records skipped with one reason each."""

from __future__ import annotations

import json
import tarfile

import pytest
from PIL import Image

from megatron_ext.commands.data import group
from megatron_ext.data.build import build_energon_dataset
from megatron_ext.data.conversation import BadConversation
from megatron_ext.data.shard_format import PreferenceSample, decoded_preference_sample, preference_of
from megatron_ext.data.sources import preference_sample
from megatron_ext.demo.synthetic_data import SyntheticSpec, make_synthetic_dataset
from megatron_ext.errors import UserError, run_command
from tests.support.samples import jpeg

# Each shape's records, and per record (prompt messages as the trainer gets them, chosen, rejected, image files).
LLAVA = [
    ({"id": "povid", "image": "red.jpg",
      "conversations": [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A red square."}],
      "rejected_conversations": [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A blue circle."}]},
     [{"role": "user", "content": "<image>\nWhat is it?"}], "A red square.", "A blue circle.", ["red.jpg"]),
    ({"id": "two-images", "image": ["red.jpg", "green.png"],
      "conversations": [{"from": "system", "value": "Be brief."},
                        {"from": "human", "value": "<image> or <image>: which is red?"}],
      "chosen": "The first.", "rejected": "The second."},
     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image> or <image>: which is red?"}],
     "The first.", "The second.", ["red.jpg", "green.png"]),
    ({"id": "multi-turn",
      "conversations": [{"from": "human", "value": "Hi."}, {"from": "gpt", "value": "Hello."},
                        {"from": "human", "value": "2 + 2?"}, {"from": "gpt", "value": "4."}],
      "rejected": "5."},
     [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2 + 2?"}],
     "4.", "5.", []),
]
RLAIF_V = [
    ({"ds_name": "rlaif", "image": "red.jpg", "question": "What colour is it?", "chosen": "Red.", "rejected": "Blue."},
     [{"role": "user", "content": "<image>\nWhat colour is it?"}], "Red.", "Blue.", ["red.jpg"]),
    ({"image": "green.png", "question": "And this one?", "chosen": "Green.", "rejected": "Red."},
     [{"role": "user", "content": "<image>\nAnd this one?"}], "Green.", "Red.", ["green.png"]),
]
TRL = [
    ({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}],
      "chosen": [{"role": "assistant", "content": "Red."}],
      "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "Blue."}]}], "images": ["red.jpg"]},
     [{"role": "user", "content": "<image>\nWhat colour is it?"}], "Red.", "Blue.", ["red.jpg"]),
    ({"prompt": [{"role": "user", "content": "Name a colour."}], "chosen": "Green.", "rejected": "Loud."},
     [{"role": "user", "content": "Name a colour."}], "Green.", "Loud.", []),
]
SHAPES = {"llava.json": LLAVA, "rlaif-v.jsonl": RLAIF_V, "trl.jsonl": TRL}


def _write_images(root):
    (root / "red.jpg").write_bytes(jpeg((220, 30, 30)))
    Image.new("RGB", (20, 10), (30, 160, 60)).save(root / "green.png")


def _write_input(path, records) -> None:
    if path.suffix == ".jsonl":  # a string is a line as it is (not JSON)
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    else:
        path.write_text(json.dumps(records))


def _shard_members(out) -> dict[str, bytes]:
    members = {}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            members.update((m.name, tar.extractfile(m).read()) for m in tar.getmembers())
    return members


def _energon_pairs(out) -> dict[str, PreferenceSample]:
    """The train split's pairs by key, as energon loads them for the trainer."""
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset

    from megatron_ext.eval.samples import DecodedSamples

    whole = WorkerConfig(rank=0, world_size=1, num_workers=0)
    dataset = get_val_dataset(str(out), split_part="train", worker_config=whole, batch_size=1, task_encoder=DecodedSamples())
    return {batch[0].__key__: batch[0] for batch in get_loader(dataset)}


def _pixels(images) -> list[bytes]:
    return [image.convert("RGB").tobytes() for image in images]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", SHAPES)
def test_each_record_shape_builds_into_pairs_that_decode(tmp_path, name):
    _write_images(tmp_path)
    records = [record for record, *_ in SHAPES[name]]
    _write_input(tmp_path / name, records)
    report = build_energon_dataset(tmp_path / name, tmp_path / "out", split_ratio="1,0,0", num_workers=0, task="preference")
    assert (report.written, report.skipped, report.task) == (len(records), {}, "preference")
    assert f"wrote {len(records)} pairs in 1 shards" in report.summary() and "skipped 0 pairs" in report.summary()
    assert "PreferenceWebdataset" in (tmp_path / "out" / ".nv-meta" / "dataset.yaml").read_text()

    members = _shard_members(tmp_path / "out")
    loaded = _energon_pairs(tmp_path / "out")
    for index, (record, prompt, chosen, rejected, files) in enumerate(SHAPES[name]):
        key = f"{index:09d}"
        # The images once per pair, stored byte for byte under SFT's part names; json, no txt.
        names = sorted(n.split(".", 1)[1] for n in members if n.startswith(key + "."))
        image_parts = ["jpg" if files[0].endswith("jpg") else "png"] if len(files) == 1 else \
            [f"{i}.{f.rsplit('.', 1)[1]}" for i, f in enumerate(files)]
        assert names == sorted(image_parts + ["json"])
        for part, file in zip(image_parts, files):
            assert members[f"{key}.{part}"] == (tmp_path / file).read_bytes()
        meta = json.loads(members[f"{key}.json"])
        assert meta == {"id": record.get("id", str(index)),
                        "conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                           "value": m["content"]} for m in prompt],
                        "chosen": chosen, "rejected": rejected}

        expected_pixels = _pixels(Image.open(tmp_path / f) for f in files)
        made = preference_sample(None, tmp_path, (index, record))
        for sample in (decoded_preference_sample(made.parts), loaded[key]):
            images, messages, got_chosen, got_rejected = preference_of(sample)
            assert (messages, got_chosen, got_rejected) == (prompt, chosen, rejected)
            assert _pixels(images) == expected_pixels


def _bad_input(tmp_path):
    """A JSONL file: two good pairs and a bad record of every kind (reason -> count in BAD)."""
    _write_images(tmp_path)
    (tmp_path / "broken.jpg").write_bytes(jpeg()[:200])
    good = {"image": "red.jpg", "question": "What colour is it?", "chosen": "Red.", "rejected": "Blue."}
    records = [
        good,
        {"id": "no-rejected", "image": "red.jpg", "question": "Colour?", "chosen": "Red."},
        {"id": "empty-rejected", "prompt": "Colour?", "chosen": "Red.", "rejected": [], "images": ["red.jpg"]},
        {"id": "same", "image": "red.jpg", "question": "Colour?", "chosen": "Red.", "rejected": " Red."},
        {"id": "absent-image", "image": "nowhere.jpg", "question": "Colour?", "chosen": "Red.", "rejected": "Blue."},
        {"id": "broken-image", "image": "broken.jpg", "question": "Colour?", "chosen": "Red.", "rejected": "Blue."},
        "{not json",
        {"id": "unknown-shape", "text": "Colour?", "chosen": "Red.", "rejected": "Blue."},
        {"id": "answered-prompt", "conversations": [{"from": "human", "value": "Hi."}, {"from": "gpt", "value": "Hello."}],
         "chosen": "Hi!", "rejected": "Go away."},
        {"id": "long", "image": "red.jpg", "question": "Describe " + "every single pixel " * 40, "chosen": "No.",
         "rejected": "Yes."},
        {**good, "id": "last-good"},
    ]
    _write_input(tmp_path / "pairs.jsonl", records)
    return tmp_path / "pairs.jsonl"


BAD = {"missing rejected answer": 2, "chosen equals rejected": 1, "missing image file": 1, "corrupt image": 1,
       "malformed record": 3, "prompt over the length": 1}


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_bad_records_are_counted_per_reason(tmp_path, llava_clip):
    path = _bad_input(tmp_path)
    report = build_energon_dataset(path, tmp_path / "out", split_ratio="1,0,0", num_workers=2, task="preference",
                                   tokenizer_load_dir=llava_clip, seq_length=64)
    assert report.written == 2 and report.skipped == BAD
    lines = report.summary().splitlines()
    assert lines[0].startswith("wrote 2 pairs in 1 shards")
    counted = lines.index("skipped 9 pairs:") + 1
    assert lines[counted:counted + len(BAD)] == [f"  {n:6d}  {reason}" for reason, n in
                                                 sorted(BAD.items(), key=lambda kv: -kv[1])]
    # Then the first five by record, and where the rest are.
    named = lines[counted + len(BAD):]
    assert named[0] == "  pair 1 (id no-rejected): missing rejected answer"
    assert len(named) == 6 and named[-1] == "  and 4 more in build_report.json"
    saved = json.loads((tmp_path / "out" / "build_report.json").read_text())
    reasons = {s["id"]: s["reason"] for s in saved["skipped_samples"]}
    assert reasons["long"] == "prompt over the length" and reasons["answered-prompt"] == "malformed record"
    assert sorted(_energon_pairs(tmp_path / "out")) == ["000000000", "000000010"]

    # The prompt's text tokens plus one per image, without a chat template.
    from transformers import AutoTokenizer

    question = json.loads(path.read_text().splitlines()[9])["question"]
    tokens = len(AutoTokenizer.from_pretrained(llava_clip)("\n" + question, add_special_tokens=False)["input_ids"]) + 1
    long = next(s for s in saved["skipped_samples"] if s["id"] == "long")
    assert long["detail"] == f"{tokens} prompt tokens, --seq-length 64" and tokens >= 64


def test_strict_stops_at_the_first_bad_record_in_one_line(tmp_path, capsys):
    path = _bad_input(tmp_path)
    with pytest.raises(SystemExit) as exited:
        run_command(group, ["build", str(path), "--output-dir", str(tmp_path / "out"), "--task", "preference",
                            "--strict", "--num-workers", "0"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == \
        f"error: {path}: pair 1 (id no-rejected): missing rejected answer (--strict stops at the first bad pair)"
    assert not (tmp_path / "out").exists()


def test_prompt_length_flags_are_checked_in_one_line(tmp_path):
    path = _bad_input(tmp_path)
    for kwargs, message in (({"seq_length": 64}, "--tokenizer-load-dir and --seq-length go together"),
                            ({"task": "sft", "tokenizer_load_dir": tmp_path, "seq_length": 64},
                             "--tokenizer-load-dir and --seq-length apply to --task preference"),
                            ({"tokenizer_load_dir": tmp_path / "absent", "seq_length": 64}, "--tokenizer-load-dir")):
        with pytest.raises(UserError, match=message):
            build_energon_dataset(path, tmp_path / "out", num_workers=0, **{"task": "preference", **kwargs})
    assert not (tmp_path / "out").exists()


def test_a_pair_without_a_user_turn_is_refused():
    sample = PreferenceSample(__key__="k", __restore_key__=(), images=[], chosen="Yes.", rejected="No.",
                              prompt=[{"role": "system", "content": "Be brief."}])
    with pytest.raises(BadConversation, match="does not end with a user turn"):
        preference_of(sample)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_synthetic_pairs_differ_and_build_without_skips(tmp_path, capsys):
    def command(*args):
        with pytest.raises(SystemExit) as exited:
            run_command(group, [str(a) for a in args])
        assert exited.value.code == 0, capsys.readouterr().err

    command("synthetic", "--task", "preference", "--output-dir", tmp_path / "src", "--num-samples", 24,
            "--multi-turn-fraction", 0.5, "--seed", 4)
    records = json.loads((tmp_path / "src" / "preference.json").read_text())
    assert len(records) == 24 and all(r["chosen"] != r["rejected"] for r in records)
    # The SFT set of the same seed: the same pictures and questions, its last answer the chosen one.
    sft = json.loads(make_synthetic_dataset(tmp_path / "sft", SyntheticSpec(num_samples=24, multi_turn_fraction=0.5,
                                                                            seed=4)).read_text())
    assert [{**r, "conversations": r["conversations"][:-1]} for r in sft] == \
        [{k: v for k, v in r.items() if k not in ("chosen", "rejected")} for r in records]
    assert [r["conversations"][-1]["value"] for r in sft] == [r["chosen"] for r in records]
    assert (tmp_path / "src/images/000005.jpg").read_bytes() == (tmp_path / "sft/images/000005.jpg").read_bytes()
    again = make_synthetic_dataset(tmp_path / "again", SyntheticSpec(num_samples=24, multi_turn_fraction=0.5, seed=4,
                                                                     task="preference"))
    assert again.read_text() == (tmp_path / "src" / "preference.json").read_text()

    capsys.readouterr()
    command("build", tmp_path / "src" / "preference.json", "--output-dir", tmp_path / "out", "--task", "preference",
            "--split-ratio", "1,0,0", "--num-workers", 0, "--samples-per-shard", 12)
    out = capsys.readouterr().out
    assert f"wrote 24 pairs in 2 shards to {tmp_path / 'out'}" in out and "skipped 0 pairs" in out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_few_pairs_built_with_the_defaults_have_train_and_val_pairs(tmp_path, capsys):
    source = make_synthetic_dataset(tmp_path / "src", SyntheticSpec(num_samples=37, task="preference"))
    with pytest.raises(SystemExit) as exited:
        run_command(group, ["build", str(source), "--output-dir", str(tmp_path / "out"), "--task", "preference",
                            "--num-workers", "0"])
    assert exited.value.code == 0
    assert "splits: train 33, val 4, test 0" in capsys.readouterr().out
