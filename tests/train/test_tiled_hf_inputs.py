"""Our tiled micro batches (LLaVA-NeXT, OneVision: anyres images, videos) as transformers' inputs:
`hf_loop.hf_samples` gives each sample what HF's own processor gives for its conversation, so the HF
model's logits are the same; `trl_dpo` runs TRL's DPO loss on a OneVision pair batch of an anyres
image pair and a video pair."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

from megatron_ext.convert.compare import synthetic_image
from megatron_ext.data.anyres import FeatureLayout
from megatron_ext.data.chat_template import needs_special_tokens
from megatron_ext.data.shard_format import ConversationSample
from megatron_ext.data.task_encoder import LlavaTaskEncoder
from megatron_ext.families import llava_kind, read_llava
from megatron_ext.hf.processors import load_processor
from megatron_ext.verify.hf_loop import hf_samples
from tests.reference import hf_processors
from tests.reference.trl_dpo import per_pair_logps, trl_batch, trl_dpo_metrics

FRAMES = 4
QUESTION = {"image": "<image>\nWhat is it?", "two_images": "<image>\n<image>\nWhat differs?",
            "video": "<video>\nWhat happens?"}


class Tiled:
    """One tiled HF checkpoint: its model, our task encoder for it, its processor and feature layout."""

    def __init__(self, hf_dir):
        import transformers

        config = json.loads((hf_dir / "config.json").read_text())
        model_class = getattr(transformers, llava_kind(config).model_class)
        self.model = model_class.from_pretrained(hf_dir, dtype=torch.float32).eval()
        self.arch = arch = read_llava(config)
        self.hf_dir = hf_dir
        self.encoder = LlavaTaskEncoder.for_model(str(hf_dir), arch, seq_length=2048, video_frames=FRAMES)
        processor = load_processor(hf_dir, "--hf-dir")
        # The video processor as transformers builds it, its torchvision steps replaced (tests/data).
        self.processor = hf_processors.with_video(processor, hf_dir) if arch.tiling.video_token_index else processor
        self.space = {"image_token_index": arch.image_token_index, "img_seq_len": arch.img_seq_len,
                      "tiled": FeatureLayout.of(processor)}

    def encode(self, messages: list[dict], media: dict):
        sample = ConversationSample(__key__="k", __restore_key__=(), messages=messages, **media)
        return self.encoder.postencode_sample(self.encoder.preencode_sample(sample))

    def hf_inputs(self, messages: list[dict], media: dict) -> dict:
        """HF's processor on the conversation as our chat template renders it."""
        text, _ = self.encoder.chat.render(messages)
        tokenizer = self.encoder.chat.tokenizer
        media = {"images": [media["images"]]} if media["images"] else {"videos": [np.stack(v) for v in media["videos"]]}
        return dict(self.processor(text=text, return_tensors="pt", add_special_tokens=needs_special_tokens(tokenizer, text),
                                   **media))


@pytest.fixture(scope="module")
def onevision(llava_onevision_siglip):
    return Tiled(llava_onevision_siglip)


@pytest.fixture(scope="module")
def next_model(llava_next_clip):
    return Tiled(llava_next_clip)


def media_of(kind: str) -> dict:
    """A wide anyres image, a wide and a tall one, or a 4-frame video (a list of frames)."""
    if kind == "video":
        return {"images": [], "videos": [[np.asarray(synthetic_image(10 + i, (60, 60))) for i in range(FRAMES)]]}
    images = [synthetic_image(0, (83, 50)), synthetic_image(1, (50, 117))]
    return {"images": images[:2 if kind == "two_images" else 1], "videos": []}


def conversation(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def check_equals_processor(tiled: Tiled, kinds: list[str]):
    """The samples packed in one row of one micro batch; each one's inputs and logits are HF's."""
    messages = [conversation(QUESTION[kind], f"Answer {i}.") for i, kind in enumerate(kinds)]
    encoded = [tiled.encode(m, media_of(kind)) for m, kind in zip(messages, kinds)]
    batch = tiled.encoder.batch([tiled.encoder.layout.pack(encoded)]).as_dict()
    samples = hf_samples(batch, **tiled.space)
    assert len(samples) == len(kinds)
    for sample, m, kind in zip(samples, messages, kinds):
        expected = tiled.hf_inputs(m, media_of(kind))
        ours = sample.inputs("cpu")
        assert set(ours) == set(expected) - {"attention_mask"} | {"labels"}, kind
        for key in set(expected) - {"attention_mask"}:
            assert torch.equal(ours[key], expected[key]), (kind, key)
        assert sample.trained_tokens > 0
        with torch.no_grad():
            want = tiled.model(**expected).logits
            got = tiled.model(**ours).logits
        assert want.std() > 0.1  # logits that differ visibly, so the comparison can fail
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_onevision_samples_are_what_its_processor_gives(onevision):
    """An anyres image (downsampled grid), two images of one tile each (batch_num_images) and a
    video, packed in one row."""
    check_equals_processor(onevision, ["image", "two_images", "video"])


def test_next_samples_are_what_its_processor_gives(next_model):
    """Two images of 3 and 4 tiles: the first padded with a zero tile, as HF's processor pads."""
    check_equals_processor(next_model, ["two_images", "image"])


def pair_batch(tiled: Tiled, pairs: list[tuple[str, str, str]]) -> dict:
    """A pair micro batch of the trainer's pair encoder, one row per pair (question kind, chosen, rejected)."""
    from megatron_ext.data.pairs import PairTaskEncoder
    from megatron_ext.data.shard_format import PreferenceSample

    encoder = PairTaskEncoder.for_model(str(tiled.hf_dir), tiled.arch, seq_length=2048, video_frames=FRAMES)
    rows = [encoder.postencode_sample(encoder.preencode_sample(PreferenceSample(
        __key__=f"p{i}", __restore_key__=(), prompt=[{"role": "user", "content": QUESTION[kind]}], chosen=chosen,
        rejected=rejected, **media_of(kind)))) for i, (kind, chosen, rejected) in enumerate(pairs)]
    return encoder.batch(rows).as_dict()


PAIRS = [("image", "A red square.", "A blue circle, large."), ("video", "It brightens.", "Nothing.")]


def test_trl_batch_repeats_each_pairs_media_per_row(onevision):
    batch = trl_batch([pair_batch(onevision, PAIRS)], **onevision.space)
    image = onevision.hf_inputs(conversation(QUESTION["image"], "-"), media_of("image"))
    video = onevision.hf_inputs(conversation(QUESTION["video"], "-"), media_of("video"))
    # Rows: chosen image, chosen video, rejected image, rejected video.
    assert torch.equal(batch["pixel_values"], image["pixel_values"].repeat(2, 1, 1, 1, 1))
    assert torch.equal(batch["image_sizes"], image["image_sizes"].repeat(2, 1))
    assert batch["batch_num_images"].tolist() == [1, 1]
    assert torch.equal(batch["pixel_values_videos"], video["pixel_values_videos"].repeat(2, 1, 1, 1, 1))


def test_dpo_on_an_image_pair_and_a_video_pair(onevision):
    """TRL's batched forward gives each sequence's log-probs run alone; reference == policy: log 2."""
    batches = [pair_batch(onevision, PAIRS)]
    model = onevision.model
    logps = per_pair_logps(model, batches, **onevision.space)
    metrics = trl_dpo_metrics(model, copy.deepcopy(model), batches, **onevision.space, beta=0.1)
    assert metrics["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["rewards/margins"] == pytest.approx(0, abs=1e-6)
    assert metrics["logps/chosen"] == pytest.approx(logps[:, 0].mean().item(), abs=1e-5)
    assert metrics["logps/rejected"] == pytest.approx(logps[:, 1].mean().item(), abs=1e-5)
    assert (logps[:, 0] != logps[:, 1]).all()


def test_hf_loop_trains_onevision_on_its_processors_inputs(llava_onevision_siglip, onevision):
    """The parity check's HF loop loads OneVision's own class and takes its media from `hf_samples`:
    its loss is transformers' on the processor's inputs, over the micro batch's trained tokens."""
    from megatron_ext.verify.hf_loop import HfLoop, TrainingSettings

    kinds = ["image", "video"]
    messages = [conversation(QUESTION[kind], f"Answer {i}.") for i, kind in enumerate(kinds)]
    encoded = [onevision.encode(m, media_of(kind)) for m, kind in zip(messages, kinds)]
    batch = onevision.encoder.batch([onevision.encoder.layout.pack(encoded)]).as_dict()
    samples = hf_samples(batch, **onevision.space)
    total = torch.tensor(sum(s.trained_tokens for s in samples))
    with torch.no_grad():
        expected = sum(onevision.model(**onevision.hf_inputs(m, media_of(kind)), labels=s.labels,
                                       num_items_in_batch=total).loss.item()
                       for s, m, kind in zip(samples, messages, kinds))
    hyper = TrainingSettings(stage=1, unfreeze_vit=False, lr=1e-3, min_lr=0.0, warmup=0, steps=1, style="constant",
                  weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, clip_grad=1.0)
    loop = HfLoop(str(llava_onevision_siglip), hyper, img_seq_len=1)
    assert type(loop.model) is type(onevision.model)
    loss, norm = loop.step([batch])
    assert loss == pytest.approx(expected, abs=1e-5)
    assert norm > 0  # stage 1 trains the projector and newline only: the media reached them
