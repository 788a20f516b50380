"""LLaVA-NeXT and LLaVA-OneVision through generate.py, chat.py and benchmark.py: the Megatron
checkpoint (converted at TP2, run at TP2 or PP2) answers greedily with transformers' own tokens on
any-resolution images (one, two of one tile each, none) and, for OneVision, a video; the HF
checkpoint runs in its own class; lmms-eval gives the same answers through both sides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ext.convert.compare import synthetic_image
from megatron_ext.eval.prompts import load_image, user_turn
from tests.support.helpers import child_env, run_ranks, run_script
from tests.support.lmms_tasks import write_tasks

MAX_NEW_TOKENS = 10
FRAMES = 4
PROMPT = "What is in this picture?"
TWO_IMAGES = "Compare <image> with <image>."


@pytest.fixture(scope="module")
def media(tmp_path_factory, video_file) -> dict[str, Path]:
    """A wide and a tall image (grids of different shapes) and an 8-frame lossless video."""
    folder = tmp_path_factory.mktemp("tiled_media")
    paths = {"wide": folder / "wide.png", "tall": folder / "tall.png", "video": video_file}
    synthetic_image(0, (83, 50)).save(paths["wide"])
    synthetic_image(1, (50, 117)).save(paths["tall"])
    return paths


@pytest.fixture(scope="module")
def hf_dirs(llava_next_clip, onevision_small_features) -> dict[str, Path]:
    """The tiny LLaVA-NeXT, and the tiny OneVision whose answers depend on its media."""
    return {"next": llava_next_clip, "onevision": onevision_small_features}


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory) -> dict[str, Path]:
    """Both converted to Megatron at TP2."""
    from megatron_ext.convert.to_megatron import convert

    out = tmp_path_factory.mktemp("tiled_megatron")
    return {name: convert(hf_dir, out / name, tp=2, pp=1) for name, hf_dir in hf_dirs.items()}


@pytest.fixture(scope="module")
def references(hf_dirs):
    from tests.support.hf_generate import HFReference

    return {name: HFReference(hf_dir) for name, hf_dir in hf_dirs.items()}


def _requests(name: str, media: dict[str, Path], folder: Path) -> tuple[Path, list[dict]]:
    """The JSONL requests (an anyres image, two images, text; OneVision: a video, and a video with an image)."""
    lines = [{"image": str(media["wide"]), "prompt": PROMPT},
             {"image": [str(media["tall"]), str(media["wide"])], "prompt": TWO_IMAGES},
             {"prompt": "Hello, who are you?"}]
    if name == "onevision":
        lines += [{"video": str(media["video"]), "prompt": "What happens in this video?"},
                  {"video": str(media["video"]), "image": str(media["tall"]), "prompt": PROMPT}]
    path = folder / f"requests-{name}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path, lines


def _expected(reference, lines: list[dict]) -> list[list[int]]:
    from megatron_ext.eval.videos import load_video

    expected = []
    for line in lines:
        files = line.get("image", [])
        images = [load_image(f) for f in ([files] if isinstance(files, str) else files)]
        videos = [load_video(line["video"], FRAMES)] if "video" in line else []
        turn = user_turn(line["prompt"], len(images), len(videos))
        expected.append(reference.greedy([turn], images, MAX_NEW_TOKENS, videos))
    return expected


def _answers(path: Path) -> list[list[int]]:
    return [json.loads(line)["token_ids"] for line in path.read_text().splitlines()]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,layout", [("next", "--tp"), ("onevision", "--pp")])
def test_megatron_greedy_tokens_equal_transformers_generate(name, layout, converted, references, media, tmp_path):
    requests, lines = _requests(name, media, tmp_path)
    answers = tmp_path / "answers.jsonl"
    run_ranks(2, "scripts/eval/generate.py", "--megatron-dir", converted[name], layout, 2, "--input-jsonl", requests,
                 "--output-jsonl", answers, "--max-new-tokens", MAX_NEW_TOKENS, "--video-frames", FRAMES, timeout=300)
    expected = _expected(references[name], lines)
    assert _answers(answers) == expected
    # Every request answered differently: the answers depend on what the media are.
    assert len({tuple(tokens) for tokens in expected}) == len(expected)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_hf_checkpoint_generates_in_its_own_class(hf_dirs, references, media, tmp_path):
    requests, lines = _requests("onevision", media, tmp_path)
    answers = tmp_path / "answers.jsonl"
    run_script("eval/generate.py", "--hf-dir", hf_dirs["onevision"], "--input-jsonl", requests, "--output-jsonl",
               answers, "--max-new-tokens", MAX_NEW_TOKENS, "--video-frames", FRAMES, timeout=200)
    expected = _expected(references["onevision"], lines)
    assert _answers(answers) == expected
    # One prompt about a video (--video), streamed.
    streamed = run_script("eval/generate.py", "--hf-dir", hf_dirs["onevision"], "--video", media["video"], "--prompt",
                          lines[3]["prompt"], "--max-new-tokens", MAX_NEW_TOKENS, "--video-frames", FRAMES, timeout=200)
    assert streamed.stdout.strip() == references["onevision"].text(expected[3])


VQA_SUFFIX = "\nAnswer the question using a single word or phrase."
STOP = "ASSISTANT:"  # the local tasks' stop string


def _lmms_answers(out: Path, task: str) -> dict[int, str]:
    (path,) = out.rglob(f"*_samples_{task}.jsonl")
    return {r["doc_id"]: r["filtered_resps"] for r in map(json.loads, path.read_text().splitlines())}


def _decoded(reference, tokens: list[int]) -> str:
    """Decoded as lmms-eval's llava_hf decodes, cut at the task's stop string."""
    return reference.tokenizer.decode(tokens, skip_special_tokens=True).split(STOP)[0]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_lmms_eval_answers_the_same_through_hf_and_megatron(hf_dirs, converted, references, media, tmp_path):
    """LLaVA-NeXT images through lmms-eval's llava_hf and through megatron_llava (the TP2 checkpoint
    in one process; megatron_llava at TP2: test_benchmark); OneVision videos through megatron_llava
    (llava_hf cannot load OneVision's processor without torchvision)."""
    question = "What is shown?"
    docs = {"tiny_vqa": [{"question_id": i, "image_path": str(media[key]), "question": question, "answers": ["a"] * 10}
                         for i, key in enumerate(["wide", "tall"])],
            "tiny_video": [{"question_id": 0, "video_path": str(media["video"]), "question": question,
                            "answers": ["a"] * 10}]}
    tasks = write_tasks(tmp_path / "tasks", docs, MAX_NEW_TOKENS)
    env = child_env(HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "datasets"))

    hf_out, megatron_out, video_out = tmp_path / "hf", tmp_path / "megatron", tmp_path / "video"
    common = ["--include-path", tasks, "--tasks"]
    run_script("eval/benchmark.py", "--hf-dir", hf_dirs["next"], *common, "tiny_vqa", "--output-dir", hf_out, env=env,
               timeout=240)
    run_script("eval/benchmark.py", "--megatron-dir", converted["next"], *common, "tiny_vqa", "--output-dir",
               megatron_out, env=env, timeout=240)
    run_script("eval/benchmark.py", "--megatron-dir", converted["onevision"], *common, "tiny_video", "--video-frames",
               FRAMES, "--output-dir", video_out, env=env, timeout=240)

    images = [load_image(media[key]).convert("RGB") for key in ("wide", "tall")]
    expected = {i: _decoded(references["next"], references["next"].greedy(
        [{"role": "user", "content": f"<image>\n{question}{VQA_SUFFIX}"}], [image], MAX_NEW_TOKENS))
        for i, image in enumerate(images)}
    assert _lmms_answers(hf_out, "tiny_vqa") == _lmms_answers(megatron_out, "tiny_vqa") == expected
    assert expected[0] != expected[1]

    from megatron_ext.eval.videos import load_video

    onevision = references["onevision"]
    video_answer = _decoded(onevision, onevision.greedy([{"role": "user", "content": f"<video>\n{question}{VQA_SUFFIX}"}],
                                                        [], MAX_NEW_TOKENS, [load_video(media["video"], FRAMES)]))
    assert video_answer.strip() and _lmms_answers(video_out, "tiny_video") == {0: video_answer}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_chat_about_an_anyres_image(converted, references, media):
    """Two turns about an image cut into tiles, from the TP2 checkpoint run in one process."""
    import pexpect

    from tests.support.chat_terminal import Terminal, same_text

    reference = references["next"]
    term = Terminal("--megatron-dir", converted["next"], "--image", media["wide"], "--max-new-tokens", MAX_NEW_TOKENS)
    try:
        image = [load_image(media["wide"])]
        first = [{"role": "user", "content": f"<image>\n{PROMPT}"}]
        expected_first = reference.text(reference.greedy(first, image, MAX_NEW_TOKENS))
        assert expected_first and same_text(term.answer(PROMPT), expected_first)
        # The second turn sees the first question and answer (the image only in the first turn).
        second = first + [{"role": "assistant", "content": expected_first}, {"role": "user", "content": "And then?"}]
        expected_second = reference.text(reference.greedy(second, image, MAX_NEW_TOKENS))
        assert expected_second and same_text(term.answer("And then?"), expected_second)
        term.child.sendline("/exit")
        # Ended by itself before the close below, which on a loaded machine could give up killing it.
        term.child.expect_exact(pexpect.EOF)
    finally:
        term.child.close(force=True)
    assert term.child.exitstatus == 0


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_evaluate_scores_the_answers_of_a_tiled_checkpoint(converted, references, train_data, tmp_path):
    """evaluate.py on the TP2 LLaVA-NeXT checkpoint in one process: transformers' answers to the
    split's samples, and the loss of the split's answers through the trainer's task encoder."""
    import math

    from megatron_ext.eval.samples import read_samples

    out = tmp_path / "eval"
    run_script("eval/evaluate.py", "--megatron-dir", converted["next"], "--data-path", train_data, "--output-dir", out,
               "--fast-n", 3, "--max-new-tokens", MAX_NEW_TOKENS, timeout=240)
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    reference = references["next"]
    expected = [reference.text(reference.greedy(s.messages, s.images, MAX_NEW_TOKENS))
                for s in read_samples(train_data, "val", limit=3)]
    assert [r["prediction"] for r in records] == expected
    metrics = json.loads((out / "metrics.json").read_text())
    assert math.isfinite(metrics["loss"]) and metrics["loss_tokens"] > 0
