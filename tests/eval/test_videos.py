"""Videos in prompts: markers placed like images', lmms-eval's video parts, and one-line refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_ext.convert.compare import synthetic_image
from megatron_ext.errors import UserError
from megatron_ext.eval.prompts import PromptEncoder, user_turn


def test_videos_go_before_the_text_unless_the_prompt_places_them():
    assert user_turn("What happens?", 1, 1)["content"] == "<image>\n<video>\nWhat happens?"
    assert user_turn("Is <video> like <image>?", 1, 1)["content"] == "Is <video> like <image>?"
    with pytest.raises(UserError, match="^the prompt has 2 <video> markers for 1 videos"):
        user_turn("<video> or <video>?", 0, 1)


def test_lmms_eval_video_parts_become_video_markers_and_frames():
    from megatron_ext.eval.lmms_model import as_training_messages
    from megatron_ext.eval.videos import load_video

    frames = [synthetic_image(i, (32, 24)) for i in range(6)]
    messages, images, videos = as_training_messages(
        [{"role": "user", "content": [{"type": "video", "url": frames}, {"type": "text", "text": "Why?"}]}],
        lambda url: load_video(url, 3, "video"))
    assert messages == [{"role": "user", "content": "<video>\nWhy?"}] and images == []
    assert [v.shape for v in videos] == [(3, 24, 32, 3)]
    assert np.array_equal(videos[0][2], np.asarray(frames[5]))


def test_a_model_without_videos_refuses_one(llava_clip):
    from megatron_ext.hf.processors import load_processor

    processor = load_processor(llava_clip, "--hf-dir")
    encoder = PromptEncoder(processor, processor.tokenizer.chat_template)
    with pytest.raises(UserError, match="^this model takes no videos"):
        encoder.encode([user_turn("Why?", 0, 1)], [], [np.zeros((2, 8, 8, 3), np.uint8)])


def test_a_bad_video_field_is_one_line(tmp_path):
    from megatron_ext.eval.request_file import read_requests

    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"video": 3, "prompt": "hi"}) + "\n")
    with pytest.raises(UserError, match=f"^--input-jsonl {requests} line 1: 'video' must be a file name"):
        read_requests(requests, source=None, options=None, video_frames=2)
