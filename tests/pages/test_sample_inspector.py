"""`megatron-ext-data inspect`: the page of what the model sees, checked in a real browser against
the trainer's task encoder and transformers' processor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from megatron.energon import WorkerConfig, get_loader, get_val_dataset
from PIL import Image

from megatron_ext.checkpoint import layout
from megatron_ext.commands.data import inspect
from megatron_ext.config.options import TrainConfig
from megatron_ext.errors import run_command
from megatron_ext.eval.samples import DecodedSamples
from megatron_ext.families import read_llava
from megatron_ext.model.sequence_alignment import SequenceAlignment
from megatron_ext.pages.inspector_page import write_inspection
from megatron_ext.pages.sample_encoding import EncoderSetup, build_encoder, run_inspection
from megatron_ext.pages.sample_sources import Selection, open_source
from megatron_ext.train.batches import task_encoder
from tests.support.tiled_data import SEQ

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]  # the prepared mix runs `energon prepare`; a browser

# tests/support/tiled_data.py's mix: an image (cut into a grid), two images, a video, text only, one too long.
ONE_IMAGE, TWO_IMAGES, VIDEO, TEXT, TOO_LONG = "000000000", "000000001", "000000002", "000000003", "000000015"
# A chat template whose generation prompt lacks the assistant's header: the header is rendered with
# the reply, so the task encoder finds it inside the reply and trains it.
HEADER_TRAINED = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
                  "{% endfor %}")


def _decoded(data) -> dict:
    """The split's samples by key, as energon decodes them for the trainer."""
    whole = WorkerConfig(rank=0, world_size=1, num_workers=0)
    dataset = get_val_dataset(str(data), split_part="train", worker_config=whole, batch_size=1, task_encoder=DecodedSamples())
    return {batch[0].__key__: batch[0] for batch in get_loader(dataset)}


def _table(locator) -> dict[str, str]:
    return dict(zip(locator.locator("td:nth-child(1)").all_inner_texts(), locator.locator("td:nth-child(2)").all_inner_texts()))


def _hf_image_positions(hf_dir, image) -> int:
    from megatron_ext.hf.processors import load_processor

    processor = load_processor(hf_dir, "--hf-dir")
    ids = processor(images=[[image]], text=["<image>"], return_tensors="pt")["input_ids"]
    return int((ids == processor.tokenizer.convert_tokens_to_ids("<image>")).sum())


def test_a_onevision_page_shows_the_encoders_tokens_and_the_models_positions(tmp_path, tiled_mix, llava_onevision_siglip):
    from transformers.image_processing_utils import select_best_resolution

    from tests.pages.browser import opened

    data, _ = tiled_mix
    keys = (ONE_IMAGE, TWO_IMAGES, VIDEO, TEXT, TOO_LONG)
    page = write_inspection(data, tmp_path / "page.html", EncoderSetup(tokenizer_load_dir=str(llava_onevision_siglip),
                                                                        options={"seq_length": SEQ}),
                            Selection(samples=len(keys), keys=keys, everything=True))
    arch = read_llava(json.loads((llava_onevision_siglip / "config.json").read_text()))
    encoder = task_encoder(llava_onevision_siglip, arch, TrainConfig(), SEQ, SequenceAlignment())
    samples = _decoded(data)
    with opened(page) as shown:
        assert shown.console_errors == [] and shown.requests == []
        assert shown.page.locator("section.sample").count() == len(keys)
        for key in (ONE_IMAGE, TWO_IMAGES, VIDEO, TEXT):
            section = shown.page.locator(f'section[data-key="{key}"]')
            trained = int(encoder.preencode_sample(samples[key]).loss_mask.sum())
            assert int(_table(section.locator(".stats"))["trained tokens"]) == trained > 0
            assert section.locator(".tok.trained").count() == trained

        image = samples[ONE_IMAGE].images[0]
        one = shown.page.locator(f'section[data-key="{ONE_IMAGE}"]')
        assert one.locator(".block").inner_text() == f"image 1: {_hf_image_positions(llava_onevision_siglip, image):,} positions"
        height, width = select_best_resolution((image.height, image.width), arch.tiling.grid_pinpoints)
        grid = one.locator("svg.grid")
        tile = arch.vision.image_size
        assert (grid.get_attribute("data-rows"), grid.get_attribute("data-cols")) == (str(height // tile), str(width // tile))
        assert grid.locator("circle.newline").count() == int(grid.get_attribute("data-newlines")) > 0
        assert grid.locator("rect.unpadded").count() == 1 and grid.bounding_box()["width"] > 100

        two = shown.page.locator(f'section[data-key="{TWO_IMAGES}"]')
        assert two.locator("svg.grid").count() == 0  # OneVision: one tile per image of a multi-image sample
        assert two.locator(".block").all_inner_texts() == [f"image {i}: {arch.vision.num_patches + 1} positions" for i in (1, 2)]
        frames = shown.page.locator(f'section[data-key="{VIDEO}"] .strip figcaption').all_inner_texts()
        assert len(frames) == 6 and frames[:2] == ["0.00 s", "0.20 s"]  # the mix's video: 6 frames at 5 per second
        assert f"an image does not fit in the sequence length {SEQ}" in \
            shown.page.locator(f'section[data-key="{TOO_LONG}"] .skipped').inner_text()

        summary = _table(shown.page.locator("#summary"))
        assert summary["samples counted"].startswith("15 ")
        assert summary[f"skipped: an image does not fit in the sequence length {SEQ}"] == "3"
        assert shown.page.locator(".chart svg").count() == 3


def _trained_text(page, key: str) -> str:
    return "".join(page.locator(f'section[data-key="{key}"] .tok.trained').all_inner_texts())


def test_a_template_that_trains_the_assistant_header_shows_it_trained(tmp_path, tiled_mix, llava_clip):
    """LLaVA JSON before it is prepared, through a LLaVA-1.5 model: the planted template's page marks
    the header trained, the tokenizer's own does not."""
    from tests.pages.browser import opened

    mix = Path(tiled_mix[1].input)
    template = tmp_path / "header_trained.jinja"
    template.write_text(HEADER_TRAINED)
    trained = {}
    image = Image.open(mix.parent / "0.png")  # the one image of sample ONE_IMAGE
    for name, chat_template in (("right", None), ("planted", str(template))):
        setup = EncoderSetup(tokenizer_load_dir=str(llava_clip), options={"seq_length": SEQ, "chat_template": chat_template})
        page = write_inspection(mix, tmp_path / f"{name}.html", setup, Selection(samples=2, keys=(TEXT, ONE_IMAGE)))
        with opened(page) as shown:
            assert shown.console_errors == [] and shown.requests == []
            trained[name] = [_trained_text(shown.page, key) for key in (TEXT, ONE_IMAGE)]
            text = shown.page.locator(f'section[data-key="{TEXT}"]')
            assert text.locator(".tok.trained:not(.role-assistant)").count() == 0
            assert "".join(text.locator(".role-user").all_inner_texts()) == "<|user|>\nSay hi.<|end|>\n"
            assert text.locator(".role-added").all_inner_texts() == ["<s>"]  # the tokenizer's BOS
            block = shown.page.locator(f'section[data-key="{ONE_IMAGE}"] .block').inner_text()
            assert block == f"image 1: {_hf_image_positions(llava_clip, image)} positions"
    assert trained["right"] == ["Hi.<|end|>", "Noise.<|end|>"]
    # Without {% generation %} markers a reply's completion runs to the end of its turn: the "\n" too.
    assert trained["planted"] == ["<|assistant|>\nHi.<|end|>\n", "<|assistant|>\nNoise.<|end|>\n"]


def test_packed_rows_truncation_and_skips_of_the_whole_file(tiled_mix, llava_clip):
    mix = tiled_mix[1].input
    seq = 48  # two images (16 positions each) leave room for only part of the answer
    encoder = build_encoder(EncoderSetup(tokenizer_load_dir=str(llava_clip), options={"seq_length": seq, "packing_seq_length": seq}))
    found = run_inspection(open_source(mix, "train", None, Selection(samples=1, keys=(TWO_IMAGES,), everything=True)),
                           encoder, everything=True, keys=(TWO_IMAGES,))
    (two,) = found.shown
    assert two.truncated and two.positions == seq
    (conversation,) = two.sequences
    kept = "".join(p.text for p in conversation.pieces if p.trained)
    assert (kept + "".join(p.text for p in conversation.cut)).startswith("No, different noise.<|end|>") and kept
    assert found.skipped == {"the sample has a video, which this model does not take": 3, "missing video file": 1,
                             "video cannot be decoded": 1, f"an image does not fit in the sequence length {seq}": 3,
                             "number of <image> markers differs from the number of images": 1}
    used = {s.key: s.positions for s in found.trained}
    assert sorted(k for row in found.rows for k in row.keys) == sorted(used)
    assert all(row.lengths == [used[k] for k in row.keys] and row.length <= seq for row in found.rows)
    assert any(len(row.keys) > 1 for row in found.rows)  # text-only samples share rows


def _trained_checkpoint(root, hf_dir, options: dict):
    """A checkpoint directory as the trainer saves one, less the weights the page does not read."""
    snapshot = root / layout.snapshot_name(1)
    snapshot.mkdir(parents=True)
    layout.write_metadata(snapshot, kind="trained", iteration=1, hf_config=json.loads((hf_dir / "config.json").read_text()),
                          tp=1, pp=1, dtype="float32", run_config={"config": options})
    shutil.copytree(hf_dir, root / layout.TOKENIZER_DIR)
    layout.mark_latest(root, 1)
    return root


def test_the_command_takes_a_trained_checkpoints_options_and_refuses_bad_input_in_one_line(tmp_path, capsys, tiled_mix,
                                                                                           llava_clip):
    data, _ = tiled_mix
    # A preference-tuned checkpoint: conversations still go through the conversation encoder.
    checkpoint = _trained_checkpoint(tmp_path / "ckpt", llava_clip, {"seq_length": 64, "stage": "dpo"})

    def command(*args) -> int:
        with pytest.raises(SystemExit) as exited:
            run_command(inspect, [str(a) for a in args])
        return exited.value.code

    assert command(data, "--megatron-load-dir", checkpoint, "--keys", TEXT, "--output", tmp_path / "page.html") == 0
    text = (tmp_path / "page.html").read_text()
    assert "<td>sequence length</td><td>64</td>" in text and text.count('class="sample"') == 1
    assert "<td>samples</td><td>conversations</td>" in text and "skipped by the trainer" not in text
    capsys.readouterr()
    for args, message in (
            ([tmp_path / "absent"], f"DATA {tmp_path / 'absent'} does not exist"),
            ([data, "--split", "dev"], f"--split dev: {data} has no such split (it has train, val, test)"),
            ([data, "--keys", "nope"], f"--keys nope: not in {data} (split train, 15 samples)")):
        assert command(*args, "--megatron-load-dir", checkpoint, "--output", tmp_path / "bad.html") != 0
        assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]
    assert not (tmp_path / "bad.html").exists()


def test_a_llava_next_image_has_the_processors_positions_and_its_grid(tiled_mix, llava_next_clip):
    from transformers.image_processing_utils import select_best_resolution

    from megatron_ext.pages.media_views import model_html

    mix = Path(tiled_mix[1].input)
    encoder = build_encoder(EncoderSetup(tokenizer_load_dir=str(llava_next_clip), options={"seq_length": SEQ}))
    found = run_inspection(open_source(mix, "train", None, Selection(samples=1, keys=(ONE_IMAGE,))), encoder,
                           everything=False, keys=(ONE_IMAGE,))
    (sample,) = found.shown
    image = Image.open(mix.parent / "0.png")
    assert sample.image_positions == _hf_image_positions(llava_next_clip, image)
    arch = read_llava(json.loads((llava_next_clip / "config.json").read_text()))
    height, width = select_best_resolution((image.height, image.width), arch.tiling.grid_pinpoints)
    rows, cols = height // arch.vision.image_size, width // arch.vision.image_size
    (media,) = sample.media
    assert len(media.tiles) == rows * cols + 1
    assert f'data-rows="{rows}" data-cols="{cols}"' in model_html(media, found.tiled)


def _trained_per_sequence(encoded) -> list[int]:
    """The loss mask's sum over each packed sequence of an encoded sample (alignment padding holds none)."""
    return [int(part.sum()) for part in encoded.loss_mask.split([n + pad for n, pad in zip(encoded.lengths, encoded.pads)])]


def test_a_preference_dataset_shows_each_pair_once_with_its_chosen_and_rejected_answers(tmp_path, preference_data,
                                                                                       llava_clip):
    from tests.pages.browser import opened

    seq = 128  # the fixture's pairs take 78 to over 200 positions: some do not fit
    # A stage-2 checkpoint: the pairs still go through the DPO trainer's pair encoder.
    checkpoint = _trained_checkpoint(tmp_path / "ckpt", llava_clip, {"seq_length": seq, "stage": 2})
    arch = read_llava(json.loads((llava_clip / "config.json").read_text()))
    encoder = task_encoder(llava_clip, arch, TrainConfig(stage="dpo"), seq, SequenceAlignment())
    samples = _decoded(preference_data)
    trained, too_long = {}, set()
    for key, sample in samples.items():
        try:
            trained[key] = _trained_per_sequence(encoder.preencode_sample(sample))
        except ValueError:
            too_long.add(key)
    fitting, skipped = sorted(trained)[:3], min(too_long)
    page = write_inspection(preference_data, tmp_path / "pairs.html", EncoderSetup(megatron_load_dir=str(checkpoint)),
                            Selection(samples=4, keys=(*fitting, skipped), everything=True))
    with opened(page) as shown:
        assert shown.console_errors == [] and shown.requests == []
        summary = _table(shown.page.locator("#summary"))
        assert summary["pairs counted"].startswith(f"{len(samples)} ") and summary["pairs shown"] == "4"
        reason = f"the pair (the prompt with each answer) does not fit in the sequence length {seq}"
        assert summary[f"skipped: {reason}"] == str(len(too_long)) and summary["pairs the trainer uses"] == str(len(trained))
        assert reason in shown.page.locator(f'section[data-key="{skipped}"] .skipped').inner_text()
        for key in fitting:
            pair = shown.page.locator(f'section[data-key="{key}"]')
            answers = [pair.locator(f'.sequence[data-answer="{name}"]') for name in ("chosen", "rejected")]
            assert [int(_table(a.locator(".stats"))["trained tokens"]) for a in answers] == trained[key]
            assert [a.locator(".tok.trained").count() for a in answers] == trained[key]
            images = len(samples[key].images)
            assert pair.locator(".medium").count() == images > 0  # once for the pair
            assert [a.locator(".block").count() for a in answers] == [images, images]  # used by both sequences


def test_japanese_and_emoji_split_over_byte_level_tokens_render_as_characters_with_their_record_id(tmp_path, llava_clip):
    """The tiny models' byte-level BPE tokenizer has no merges for these characters: each is several
    byte tokens, which the page joins into one box per character instead of U+FFFD per token."""
    from tests.pages.browser import opened
    from tests.support.samples import jpeg

    question, answer = "この画像の動物は何ですか？", "猫です🐱。"
    (tmp_path / "cat.jpg").write_bytes(jpeg())
    record = {"id": "ja-cat-7", "image": "cat.jpg",
              "conversations": [{"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": answer}]}
    (tmp_path / "ja.json").write_text(json.dumps([record], ensure_ascii=False))
    setup = EncoderSetup(tokenizer_load_dir=str(llava_clip), options={"seq_length": SEQ})
    page = write_inspection(tmp_path / "ja.json", tmp_path / "ja.html", setup, Selection(samples=1))
    with opened(page) as shown:
        assert shown.console_errors == [] and shown.requests == []
        section = shown.page.locator('section[data-key="000000000"]')
        assert section.locator("h3").inner_text() == "Sample 000000000 (index 0, record id ja-cat-7)"
        text = "".join(section.locator(".tok").all_inner_texts())
        assert question in text and answer in text and "\ufffd" not in text
        joined = section.locator(".tok.joined")
        # 動, 物, 何, 猫 and 🐱 have no token of their own (この画像 has one).
        assert set("動物何猫🐱") <= set("".join(joined.all_inner_texts())) and "画" not in "".join(joined.all_inner_texts())
        # Every token is still on the page: single ones and the joined boxes' counts add up to the stats.
        counts = [int(n) for n in joined.evaluate_all("els => els.map(e => e.dataset.tokens)")]
        single = section.locator(".tok:not(.joined)").count()
        assert single + sum(counts) == int(_table(section.locator(".stats"))["tokens"].replace(",", ""))
