"""The pair encoder (megatron_ext/data/pairs.py): a preference pair is one sample of two packed
sequences, its image processed once, only the final answers trained, never truncated."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from megatron_ext.data.pairs import PairTaskEncoder
from megatron_ext.data.shard_format import PreferenceSample
from megatron_ext.families import read_llava


def _encoder(llava_clip, seq_length=512):
    arch = read_llava(json.loads((llava_clip / "config.json").read_text()))
    return PairTaskEncoder.for_model(str(llava_clip), arch, seq_length=seq_length), arch


def _pair(chosen="It is red.", rejected="It is a large blue circle."):
    prompt = [{"role": "user", "content": "<image>\nWhat colour is it?"}, {"role": "assistant", "content": "Which one?"},
              {"role": "user", "content": "The square."}]
    return PreferenceSample(__key__="k", __restore_key__=(), images=[Image.new("RGB", (40, 30), (200, 30, 30))],
                            prompt=prompt, chosen=chosen, rejected=rejected)


def test_a_pair_is_two_sequences_sharing_one_image_with_only_the_final_answers_trained(llava_clip):
    encoder, arch = _encoder(llava_clip)
    batch = encoder.batch([encoder.postencode_sample(encoder.preencode_sample(_pair()))]).as_dict()
    assert batch["segment_ids"].max() == 2 and batch["num_samples"] == 1
    # The image is processed once and used by both sequences' image tokens.
    assert batch["images"].shape[0] == 1 and batch["image_index"].tolist() == [0, 0]
    assert int((batch["input_ids"] == arch.image_token_index).sum()) == 2
    tokenizer = encoder.chat.tokenizer
    for segment, answer in ((1, "It is red."), (2, "It is a large blue circle.")):
        trained = batch["labels"][0][(batch["segment_ids"][0] == segment) & (batch["loss_mask"][0] > 0)]
        # The answer with its end of turn; the prompt's earlier assistant turn ("Which one?") is context.
        text = tokenizer.decode(trained, skip_special_tokens=True).strip()
        assert text == answer and "Which one?" not in tokenizer.decode(trained)


def test_a_pair_that_does_not_fit_is_refused_whole(llava_clip):
    encoder, arch = _encoder(llava_clip, seq_length=arch_positions(llava_clip) + 24)
    with pytest.raises(ValueError, match="the pair .* does not fit in the sequence length"):
        encoder.preencode_sample(_pair(rejected="no " * 30))


def arch_positions(llava_clip) -> int:
    return read_llava(json.loads((llava_clip / "config.json").read_text())).img_seq_len * 2


def test_same_answers_in_both_sequences_give_the_same_trained_tokens(llava_clip):
    encoder, _ = _encoder(llava_clip)
    sample = encoder.postencode_sample(encoder.preencode_sample(_pair(rejected="It is red.")))
    mask, segments = sample.loss_mask, torch.repeat_interleave(torch.tensor([1, 0, 2, 0]),
                                                               torch.tensor([sample.lengths[0], sample.pads[0],
                                                                             sample.lengths[1], sample.pads[1]]))
    assert mask[segments == 1].sum() == mask[segments == 2].sum() > 0
