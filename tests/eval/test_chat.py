"""scripts/eval/chat.py driven in a pseudo-terminal: two turns about an image, and about a video
(OneVision), from a Megatron checkpoint, each answer equal to transformers' greedy answer to the
same conversation; /image, /video, /reset and /exit; one-line refusals that leave the session going."""

from __future__ import annotations

from pathlib import Path

import pexpect
import pytest

from megatron_ext.data.conversation import IMAGE_MARKER
from megatron_ext.families.llava import VIDEO_TOKEN
from tests.support.chat_terminal import Terminal, same_text
from tests.support.helpers import run_script

MAX_NEW_TOKENS = 8
FRAMES = 4
NO_VIDEOS = "error: this model takes no videos (LLaVA-OneVision does)"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_turns_about_an_image_then_reset_image_and_exit(megatron_clip, images, video_file, hf_reference):
    term = Terminal("--megatron-dir", megatron_clip, "--image", images[0], "--max-new-tokens", MAX_NEW_TOKENS)
    try:
        _converse(term, images, video_file, hf_reference)
    finally:
        term.child.close(force=True)  # the chat (a session leader in its pty) does not outlive the test
    assert term.child.exitstatus == 0


def _converse(term, images, video_file, hf_reference):
    from megatron_ext.eval.prompts import load_image

    assert f"about {images[0]}" in term.banner and "/image PATH" in term.banner

    first_q, second_q = "Describe this image.", "What else do you see?"
    image0 = [load_image(images[0])]
    conversation = [{"role": "user", "content": f"{IMAGE_MARKER}\n{first_q}"}]
    first = term.answer(first_q)
    expected_first = hf_reference.text(hf_reference.greedy(conversation, image0, MAX_NEW_TOKENS))
    assert expected_first and same_text(first, expected_first), (first, expected_first)

    # The second turn sees the first question and answer (the image only in the first user turn).
    conversation += [{"role": "assistant", "content": expected_first}, {"role": "user", "content": second_q}]
    second = term.answer(second_q)
    expected_second = hf_reference.text(hf_reference.greedy(conversation, image0, MAX_NEW_TOKENS))
    assert expected_second and same_text(second, expected_second), (second, expected_second)

    # /reset forgets the conversation: the same first question gets the first answer again.
    assert term.ask("/reset") == "(conversation reset)"
    assert same_text(term.answer(first_q), expected_first)

    assert term.ask(f"/image {images[1]}") == f"(new conversation about {images[1]})"
    # LLaVA-1.5 refuses a video in one line and the conversation goes on: the next answer is about images[1].
    assert term.ask(f"/video {video_file}") == NO_VIDEOS
    expected_other = hf_reference.text(hf_reference.greedy(
        [{"role": "user", "content": f"{IMAGE_MARKER}\n{first_q}"}], [load_image(images[1])], MAX_NEW_TOKENS))
    assert same_text(term.answer(first_q), expected_other)

    assert term.ask("/image /no/such.png").startswith("error: /image /no/such.png does not exist")
    assert term.ask("/help").startswith("unknown command /help")

    term.child.sendline("/exit")
    term.child.expect_exact(pexpect.EOF)


@pytest.fixture(scope="module")
def megatron_onevision_small(tmp_path_factory, onevision_small_features) -> Path:
    """The OneVision whose answers depend on its media, converted to Megatron (TP1 x PP1)."""
    from megatron_ext.convert.to_megatron import convert

    return convert(onevision_small_features, tmp_path_factory.mktemp("megatron_onevision_small") / "ckpt", tp=1, pp=1)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_conversations_about_a_video_and_an_image(megatron_onevision_small, onevision_small_features, video_file, images,
                                                  tmp_path):
    from megatron_ext.eval.prompts import load_image
    from megatron_ext.eval.videos import load_video
    from tests.support.hf_generate import HFReference

    reference = HFReference(onevision_small_features)
    video = [load_video(video_file, FRAMES)]
    question, follow_up = "What is in this picture?", "And then?"  # the tiny model's answers differ by media
    first = [{"role": "user", "content": f"{VIDEO_TOKEN}\n{question}"}]
    expected_first = reference.text(reference.greedy(first, [], MAX_NEW_TOKENS, video))
    # The second turn sees the first question and answer (the video only in the first user turn).
    second = first + [{"role": "assistant", "content": expected_first}, {"role": "user", "content": follow_up}]
    expected_second = reference.text(reference.greedy(second, [], MAX_NEW_TOKENS, video))
    expected_image = reference.text(reference.greedy(
        [{"role": "user", "content": f"{IMAGE_MARKER}\n{question}"}], [load_image(images[1])], MAX_NEW_TOKENS))
    assert expected_first and expected_second and expected_image and expected_image != expected_first

    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"not a video")
    term = Terminal("--megatron-dir", megatron_onevision_small, "--video", video_file, "--video-frames", FRAMES,
                    "--max-new-tokens", MAX_NEW_TOKENS)
    try:
        assert f"about {video_file}" in term.banner and "/video PATH" in term.banner
        assert same_text(term.answer(question), expected_first)
        assert same_text(term.answer(follow_up), expected_second)

        # /image drops the video: the conversation is about the image alone.
        assert term.ask(f"/image {images[1]}") == f"(new conversation about {images[1]})"
        assert same_text(term.answer(question), expected_image)

        # A bad path or an undecodable file is one line, and the image conversation stays.
        missing = term.ask("/video /no/such.mkv")
        assert missing.startswith("error: /video /no/such.mkv") and "\n" not in missing, missing
        undecodable = term.ask(f"/video {garbage}")
        assert undecodable.startswith(f"error: /video {garbage}: cannot decode") and "\n" not in undecodable
        assert term.ask("/video") == "error: /video needs a path: /video PATH"

        # /video starts a new conversation about the video alone: the first answer again.
        assert term.ask(f"/video {video_file}") == f"(new conversation about {video_file})"
        assert same_text(term.answer(question), expected_first)

        term.child.sendline("/exit")
        term.child.expect_exact(pexpect.EOF)
    finally:
        term.child.close(force=True)
    assert term.child.exitstatus == 0


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_image_and_video_together_are_refused_in_one_line(megatron_clip, images, video_file):
    proc = run_script("eval/chat.py", "--megatron-dir", megatron_clip, "--image", images[0], "--video", video_file,
                      check=False, timeout=100, fresh=True)
    assert proc.returncode == 2
    assert proc.stderr == "error: give --image or --video, not both: a conversation is about one image or one video\n"
