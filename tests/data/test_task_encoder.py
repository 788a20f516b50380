"""The task encoder through energon's loaders: masks, pixels, truncation, packing, bad samples, resume."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
import torch
from megatron.energon import VQASample
from PIL import Image

from megatron_ext.data.build import run_energon_prepare
from megatron_ext.data.loader import restore_loader_state, save_loader_state, shutdown_workers, train_loader, val_loader
from megatron_ext.data.task_encoder import LlavaTaskEncoder
from megatron_ext.errors import UserError
from megatron_ext.families import read_llava
from tests.support.helpers import run
from tests.support.samples import jpeg, records_by_key

END = "<|end|>"


def _arch(hf_dir):
    return read_llava(json.loads((hf_dir / "config.json").read_text()))


def _encoder(hf_dir, **kwargs):
    kwargs.setdefault("seq_length", 256)
    return LlavaTaskEncoder.for_model(str(hf_dir), _arch(hf_dir), **kwargs)


def _segments(batch, row):
    """(key, token slice) of each packed sample in one batch row."""
    keys = batch.__key__[row].split(",")
    ids = batch.segment_ids[row]
    return [(key, ids == k + 1) for k, key in enumerate(keys)]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_energon_info_counts_the_built_samples(prepared):
    proc = run([sys.executable, "-m", "megatron.energon.cli.main", "info", str(prepared)], timeout=120)
    assert re.search(r"\(24 samples, .* in 6 shards\)", proc.stdout)
    assert re.search(r"`train`: 50%, 12 samples", proc.stdout) and re.search(r"`val`: 50%, 12 samples", proc.stdout)


@pytest.mark.multiprocess
@pytest.mark.parametrize("packing", [None, 200])
def test_loss_mask_selects_exactly_the_assistant_answers(prepared, synthetic_json, llava_clip, packing):
    """Round trip LLaVA JSON -> shards -> loader: per sample, the tokens the loss trains on decode to
    that sample's gpt turns, each with its end-of-turn token, and nothing else."""
    encoder = _encoder(llava_clip, packing_seq_length=packing)
    records = records_by_key(synthetic_json)
    tokenizer = encoder.chat.tokenizer
    arch = _arch(llava_clip)
    seen, multi_turn = set(), 0
    for batch in val_loader(prepared, encoder, micro_batch_size=2):
        images = 0
        for row in range(batch.input_ids.shape[0]):
            for key, where in _segments(batch, row):
                record = records[key]
                answers = [t["value"] for t in record["conversations"] if t["from"] == "gpt"]
                trained = batch.labels[row][where & (batch.loss_mask[row] > 0)]
                assert tokenizer.decode(trained) == "".join(a + END for a in answers)
                assert int((batch.input_ids[row][where] == arch.image_token_index).sum()) == 1
                # The last token of a sample never predicts the next sample's first token.
                assert batch.loss_mask[row][where][-1] == 0
                seen.add(key)
                multi_turn += len(answers) > 1
                images += 1
        assert batch.images.shape == (images, 3, 56, 56)
        assert batch.num_samples == images and batch.num_truncated == 0 and batch.num_skipped == 0
        assert ((batch.segment_ids == 0) == (batch.input_ids == tokenizer.pad_token_id)).all()
        assert (batch.loss_mask[batch.segment_ids == 0] == 0).all()
    assert len(seen) == 12 and multi_turn >= 3
    if packing:
        widths = torch.where(batch.input_ids == arch.image_token_index, arch.img_seq_len, 1)
        assert int((widths * (batch.segment_ids > 0)).sum(1).max()) <= packing


@pytest.mark.multiprocess
@pytest.mark.parametrize("fixture", ["llava_clip", "llava_qwen2_siglip"])
def test_images_equal_the_hf_processor_output(request, prepared, synthetic_json, fixture):
    """Pixels from the shards equal HF LLaVA's processor on the original image files."""
    from transformers import AutoProcessor

    hf_dir = request.getfixturevalue(fixture)
    processor = AutoProcessor.from_pretrained(hf_dir)
    records = records_by_key(synthetic_json)
    encoder = _encoder(hf_dir)
    assert encoder.images.steps is not None, "the direct path, not HF's call"
    checked = 0
    for batch in val_loader(prepared, encoder, micro_batch_size=3):
        for key, image in zip(batch.__key__, batch.images):
            original = Image.open(synthetic_json.parent / records[key]["image"])
            expected = processor.image_processor(images=original, return_tensors="pt")["pixel_values"][0]
            assert image.dtype == torch.float32 and image.shape == expected.shape
            assert torch.allclose(image, expected, atol=1e-5, rtol=0)
            checked += 1
    assert checked == 12


def _sample(question, answer, size=(60, 40)):
    return VQASample(__key__="k", __restore_key__=(), image=Image.new("RGB", size, (10, 200, 30)),
                     context=question, answers=answer)


def test_truncation_never_cuts_an_image(llava_clip):
    arch = _arch(llava_clip)
    encoder = _encoder(llava_clip, seq_length=48)
    long_answer = " ".join(["The quick brown fox jumps over the lazy dog."] * 6)
    sample = encoder.preencode_sample(_sample("<image>\nDescribe the picture in detail.", long_answer))
    widths = torch.where(sample.input_ids == arch.image_token_index, arch.img_seq_len, 1)
    assert sample.num_truncated == 1 and int(widths.sum()) == 48
    assert int((sample.input_ids == arch.image_token_index).sum()) == 1 and sample.loss_mask.sum() > 0
    assert sample.loss_mask[-1] == 0
    # An image that would end past the sequence length makes the sample unusable, not half an image.
    question = "Describe the picture in detail. " * 6 + "<image>"
    with pytest.raises(ValueError, match="image does not fit"):
        encoder.preencode_sample(_sample(question, "A dog."))
    with pytest.raises(UserError, match="exceeds --seq-length"):
        _encoder(llava_clip, seq_length=64, packing_seq_length=128)


def _write_prepared(path, samples):
    import webdataset as wds

    path.mkdir()
    with wds.TarWriter(str(path / "000000.tar")) as writer:
        for sample in samples:
            writer.write(sample)
    run_energon_prepare(path, {"val": [0]}, 1)


@pytest.mark.multiprocess
def test_bad_samples_in_shards_are_skipped_and_counted(tmp_path, llava_clip):
    good = {"jpg": jpeg(), "txt": "Red.", "json": json.dumps({"question": "<image>\nColor?"})}
    samples = [dict(good, __key__=f"{i:03d}") for i in range(6)]
    samples[1]["jpg"] = jpeg()[:150]
    samples[4]["json"] = json.dumps({"question": "<image>\nColor?", "conversations": [{"from": "human", "value": "<image> hi"}]})
    _write_prepared(tmp_path / "ds", samples)
    batches = list(val_loader(tmp_path / "ds", _encoder(llava_clip), micro_batch_size=2))
    assert sum(b.num_samples for b in batches) == 4
    assert sum(b.num_skipped for b in batches) == 2
    assert sorted(k for b in batches for k in b.__key__) == ["000", "002", "003", "005"]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_train_loader_with_workers_packs_and_resumes(tmp_path, prepared, llava_clip):
    arch = _arch(llava_clip)

    def loader(workers):
        return train_loader(prepared, _encoder(llava_clip, packing_seq_length=200), micro_batch_size=2,
                            num_workers=workers, seed=3, packing_buffer_size=8)

    first, resumed = loader(2), loader(2)
    try:
        it = iter(first)
        packed_rows = 0
        for _ in range(2):
            batch = next(it)
            assert batch.input_ids.dtype == torch.long and batch.loss_mask.dtype == torch.float32
            assert batch.images.shape[0] == int((batch.input_ids == arch.image_token_index).sum()) == batch.num_samples
            packed_rows += int((batch.segment_ids.max(1).values >= 2).sum())
        assert packed_rows > 0
        save_loader_state(first, tmp_path / "state.pt")
        expected = [next(it).input_ids for _ in range(3)]

        restore_loader_state(resumed, tmp_path / "state.pt")
        got = [b.input_ids for b, _ in zip(resumed, range(3))]
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
    finally:
        # As the trainer does: left to the garbage collector, their workers held up a later test ~40 s.
        for made in (first, resumed):
            shutdown_workers(made)
    with pytest.raises(UserError, match="saved with 2 data workers; resume with --num-workers 2"):
        restore_loader_state(loader(0), tmp_path / "state.pt")


def test_named_template_and_language(llava_clip):
    encoder = _encoder(llava_clip, chat_template="llama-3")
    sample = encoder.preencode_sample(_sample("What color?", "Green."))
    tokenizer = encoder.chat.tokenizer
    assert tokenizer.decode(sample.labels[sample.loss_mask > 0]) == "Green.<|eot_id|>"
    assert tokenizer.decode(sample.input_ids).startswith("<s><|start_header_id|>user<|end_header_id|>\n\n<image>\nWhat color?")
    assert np.isin(sample.input_ids.numpy(), [_arch(llava_clip).image_token_index]).sum() == 1
