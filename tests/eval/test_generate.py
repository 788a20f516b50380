"""scripts/eval/generate.py: Megatron greedy generation equals transformers' `generate` (prompts
with no image, one, and two), at TP1, TP2 and PP2 (KV-cached, resharded at load); HF streaming; one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ext.data.conversation import IMAGE_MARKER
from tests.support.helpers import run_ranks, run_script

MAX_NEW_TOKENS = 12
PROMPTS = ["Describe this image.", "What color is the shape in the picture?"]


TWO_IMAGES = f"Is {IMAGE_MARKER} brighter than {IMAGE_MARKER}?"


def _requests(tmp_path: Path, images: list[Path]) -> Path:
    """Two requests with an image (given relative to the JSONL file), one without, one with two."""
    lines = [{"image": str(images[0]), "prompt": PROMPTS[0]},
             {"id": "second", "image": images[1].name, "prompt": PROMPTS[1]},
             {"prompt": "Hello, who are you?"},
             {"id": "two", "image": [images[1].name, str(images[0])], "prompt": TWO_IMAGES}]
    path = images[1].parent / f"requests-{tmp_path.name}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _expected(hf_reference, images: list[Path]) -> list[list[int]]:
    from megatron_ext.eval.prompts import load_image

    turns = [(f"{IMAGE_MARKER}\n{PROMPTS[0]}", [load_image(images[0])]),
             (f"{IMAGE_MARKER}\n{PROMPTS[1]}", [load_image(images[1])]),
             ("Hello, who are you?", []),
             (TWO_IMAGES, [load_image(images[1]), load_image(images[0])])]
    return [hf_reference.greedy([{"role": "user", "content": text}], imgs, MAX_NEW_TOKENS) for text, imgs in turns]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["tp2", "pp2"])  # TP1: test_a_bf16_hub_style_checkpoint_generates_on_cpu
def test_megatron_greedy_tokens_equal_transformers_generate(layout, megatron_clip, images, hf_reference, tmp_path):
    requests, answers = _requests(tmp_path, images), tmp_path / "answers.jsonl"
    run_ranks(2, "scripts/eval/generate.py", "--megatron-dir", megatron_clip, "--input-jsonl", requests,
                 "--output-jsonl", answers, "--max-new-tokens", MAX_NEW_TOKENS, "--tp" if layout == "tp2" else "--pp", 2,
                 timeout=180)
    _check_answers(answers, hf_reference, images)


def _check_answers(answers: Path, reference, images: list[Path]) -> None:
    """The answers are transformers' greedy tokens and text for `_requests`, in order, cut at the length."""
    results = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [r["id"] for r in results] == [1, "second", 3, "two"]
    expected = _expected(reference, images)
    assert [r["token_ids"] for r in results] == expected
    assert all(len(ids) == MAX_NEW_TOKENS for ids in expected)  # no early stop: every position is compared
    assert [r["answer"] for r in results] == [reference.text(ids) for ids in expected]
    assert {r["finish_reason"] for r in results} == {"length"}


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_bf16_hub_style_checkpoint_generates_on_cpu(llava_clip, images, tmp_path):
    """As the Hub ships LLaVA: bf16, sharded safetensors with an index. Converted to Megatron, it
    generates on CPU in fp32 (the default there), the tokens transformers gives on the HF checkpoint.
    This is also the TP1 cell of the greedy-tokens test, and the run without a terminal shows no progress."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from megatron_ext.convert.to_megatron import convert
    from tests.support.hf_generate import HFReference

    hub = tmp_path / "hub"
    LlavaForConditionalGeneration.from_pretrained(llava_clip, dtype=torch.bfloat16).save_pretrained(
        hub, max_shard_size="300KB")
    AutoProcessor.from_pretrained(llava_clip).save_pretrained(hub)
    assert (hub / "model.safetensors.index.json").is_file() and len(list(hub.glob("*.safetensors"))) > 1
    megatron = convert(hub, tmp_path / "megatron", tp=1, pp=1)
    requests, answers = _requests(tmp_path, images), tmp_path / "answers.jsonl"
    proc = run_script("eval/generate.py", "--megatron-dir", megatron, "--input-jsonl", requests, "--output-jsonl",
                      answers, "--max-new-tokens", MAX_NEW_TOKENS, timeout=120)
    _check_answers(answers, HFReference(hub), images)
    assert "answering" not in proc.stderr  # not a terminal: no progress bar


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_hf_single_prompt_streams_the_answer_to_the_terminal(llava_clip, images, hf_reference):
    from megatron_ext.eval.prompts import load_image

    proc = run_script("eval/generate.py", "--hf-dir", llava_clip, "--image", images[0], "--prompt", PROMPTS[0],
                      "--max-new-tokens", MAX_NEW_TOKENS, timeout=120)
    expected = hf_reference.greedy([{"role": "user", "content": f"{IMAGE_MARKER}\n{PROMPTS[0]}"}],
                                   [load_image(images[0])], MAX_NEW_TOKENS)
    assert proc.stdout.strip() == hf_reference.text(expected)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_bad_input_gives_one_clear_line(llava_clip, megatron_clip, images, tmp_path):
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("this is text, not a PNG")
    long_prompt = "red green blue " * 400
    cases = {
        "unreadable image": (["--megatron-dir", megatron_clip, "--image", not_an_image, "--prompt", "hi"],
                             f"error: --image {not_an_image} cannot be opened as an image"),
        "prompt too long": (["--megatron-dir", megatron_clip, "--image", images[0], "--prompt", long_prompt],
                            "error: the prompt is"),
        "HF dir as --megatron-dir": (["--megatron-dir", llava_clip, "--prompt", "hi"],
                                     f"error: --megatron-dir {llava_clip} is a Hugging Face checkpoint"),
        "Megatron dir as --hf-dir": (["--hf-dir", megatron_clip, "--prompt", "hi"],
                                     f"error: --hf-dir {megatron_clip} is a Megatron checkpoint"),
    }
    for name, (args, start) in cases.items():
        proc = run_script("eval/generate.py", *args, check=False, timeout=60, fresh=True)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), (name, proc.stderr)


def _on_a_terminal(*args) -> str:
    import sys

    import pexpect

    from tests.support.helpers import REPO_ROOT, child_env

    child = pexpect.spawn(sys.executable, [str(REPO_ROOT / "scripts/eval/generate.py"), *map(str, args)],
                          env=child_env(), encoding="utf-8", timeout=120)
    try:
        child.expect(pexpect.EOF)
        return child.before
    finally:
        child.close(force=True)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_progress_is_shown_on_a_terminal_unless_quiet(llava_clip, images, tmp_path):
    args = ["--hf-dir", llava_clip, "--input-jsonl", _requests(tmp_path, images), "--output-jsonl",
            tmp_path / "answers.jsonl", "--max-new-tokens", 2]
    shown = _on_a_terminal(*args)
    assert "answering: 100%" in shown and "4/4" in shown and "request/s" in shown, shown
    assert "answering" not in _on_a_terminal(*args, "--quiet")
    # Not a terminal, no progress: test_a_bf16_hub_style_checkpoint_generates_on_cpu (the same progress bar).
