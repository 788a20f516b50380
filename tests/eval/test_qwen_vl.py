"""The eval commands on Qwen2.5-VL and Qwen3-VL. scripts/eval/generate.py: the greedy tokens of a
converted Megatron checkpoint at TP1, TP2 and PP2 (KV-cached), and of the HF checkpoint, equal transformers' `generate`
on the HF checkpoint, for prompts about images of odd sizes (37x91, 1000x17), two images, no image and
a video. The prompts are encoded once, by the trainer's task encoder; transformers computes
its own mRoPE positions from them, prompt and generated tokens alike. compare_hf_megatron.py: the
two checkpoints' logits on such a prompt. benchmark.py: lmms-eval's answers and scores, HF and TP2."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.helpers import run_ranks, run_script

FAMILIES = {"qwen2_5_vl": "tests.support.qwen2_5_vl", "qwen3_vl": "tests.support.qwen3_vl"}
MAX_NEW_TOKENS = 8
VIDEO_FRAMES = 4
# Relative to the JSONL file's folder. A Qwen3-VL video is written as its timed frame pairs, each a run of its own.
REQUESTS = [{"image": "wide.png", "prompt": "Describe this image."},
            {"id": "two", "image": ["tall.png", "wide.png"], "prompt": "Is <image> taller than <image>?"},
            {"prompt": "Hello, who are you?"},
            {"id": "video", "video": "clip.mkv", "prompt": "What happens in the video?"}]


@dataclass(frozen=True)
class Tiny:
    hf_dir: Path
    megatron_dir: Path  # converted at TP2
    requests: Path  # JSONL
    expected: list[list[int]]  # transformers' greedy tokens per request
    texts: list[str]


def _media(folder: Path, video_file: Path) -> None:
    import shutil

    from PIL import Image

    from tests.support.qwen_vl import noise

    Image.fromarray(noise(37, 91, 1)).save(folder / "wide.png")
    Image.fromarray(noise(1000, 17, 2)).save(folder / "tall.png")
    shutil.copy(video_file, folder / "clip.mkv")


def _expected(reference, folder: Path, requests: list[dict]) -> list[list[int]]:
    from megatron_ext.eval.prompts import load_image, user_turn

    answers = []
    for request in requests:
        files = request.get("image", [])
        images = [load_image(folder / f) for f in ([files] if isinstance(files, str) else files)]
        videos = [reference.encoder.load_video(folder / request["video"], VIDEO_FRAMES)] if "video" in request else []
        answers.append(reference.greedy([user_turn(request["prompt"], len(images), len(videos))], images,
                                        MAX_NEW_TOKENS, videos))
    return answers


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory, video_file) -> Tiny:
    """The family's tiny model (HF, and converted at TP2), the requests and transformers' answers."""
    from megatron_ext.convert.to_megatron import convert
    from tests.support.hf_generate import HFReference

    out = tmp_path_factory.mktemp(request.param)
    hf_dir = importlib.import_module(FAMILIES[request.param]).write_tiny_model(out / "hf")
    megatron_dir = convert(hf_dir, out / "megatron", tp=2, pp=1)
    _media(out, video_file)
    path = out / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    reference = HFReference(hf_dir)
    expected = _expected(reference, out, REQUESTS)
    return Tiny(hf_dir, megatron_dir, path, expected, [reference.text(ids) for ids in expected])


def _generate(tiny: Tiny, checkpoint: list, out: Path, tp: int = 1, pp: int = 1) -> list[dict]:
    args = [*checkpoint, "--input-jsonl", tiny.requests, "--output-jsonl", out, "--max-new-tokens", MAX_NEW_TOKENS,
            "--video-frames", VIDEO_FRAMES]
    if tp * pp > 1:
        run_ranks(tp * pp, "scripts/eval/generate.py", *args, "--tp", tp, "--pp", pp, timeout=400)
    else:
        run_script("eval/generate.py", *args, timeout=400)
    return [json.loads(line) for line in out.read_text().splitlines()]


def _check(results: list[dict], tiny: Tiny) -> None:
    assert [r["token_ids"] for r in results] == tiny.expected
    assert [r["answer"] for r in results] == tiny.texts
    # Every prompt gets an answer of its own (the media reach the model), each compared at every position.
    assert len({tuple(ids) for ids in tiny.expected}) == len(tiny.expected)
    assert all(len(ids) == MAX_NEW_TOKENS for ids in tiny.expected)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_megatron_greedy_tokens_equal_transformers_generate(tiny, tp, pp, tmp_path):
    """Through megatron-core's KV cache: one prefill, then one pass per new token, across pipeline stages too."""
    _check(_generate(tiny, ["--megatron-dir", tiny.megatron_dir], tmp_path / "answers.jsonl", tp, pp), tiny)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_hf_checkpoint_greedy_tokens_equal_transformers_generate(tiny, tmp_path):
    _check(_generate(tiny, ["--hf-dir", tiny.hf_dir], tmp_path / "answers.jsonl"), tiny)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_compare_finds_the_converted_logits_equal_to_transformers_within_1e_4(tiny):
    folder = tiny.requests.parent
    proc = run_script("convert/compare_hf_megatron.py", "--hf-dir", tiny.hf_dir, "--megatron-dir", tiny.megatron_dir,
                      "--image", folder / "tall.png", "--image", folder / "wide.png", "--prompt", "Which is taller?",
                      "--max-diff", "1e-4", timeout=400)
    import re

    assert float(re.search(r"max \|dlogit\|: +(\S+)", proc.stdout).group(1)) <= 1e-4
    # Every position compared, the two images' tokens among them.
    positions = int(re.search(r"argmax agrees at all (\d+) positions: yes", proc.stdout).group(1))
    assert positions > 60


def _transformers_loss(tiny: Tiny, data_path: Path, samples: int) -> tuple[float, int]:
    """transformers' token-weighted loss over the split's first `samples` samples, as the trainer's task
    encoder encodes them (the positions left to transformers)."""
    import torch
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset

    from megatron_ext import families
    from megatron_ext.checkpoint.layout import find_snapshot
    from megatron_ext.data.native_resolution import token_types
    from megatron_ext.data.native_resolution_encoder import NativeResolutionTaskEncoder

    arch = find_snapshot(tiny.megatron_dir).arch
    encoder = NativeResolutionTaskEncoder.for_model(str(tiny.hf_dir), arch, seq_length=arch.text.max_position_embeddings,
                                                    pad_token_id=arch.pad_token_id)
    dataset = get_val_dataset(str(data_path), split_part="val", worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                              batch_size=1, limit=samples, task_encoder=encoder)
    model = families.load_model(tiny.hf_dir, "--hf-dir", dtype=torch.float32).eval()
    total, tokens = 0.0, 0
    for batch in get_loader(dataset):
        media = {name: getattr(batch, name) for name in ("pixel_values", "image_grid_thw") if len(batch.image_grid_thw)}
        types = torch.from_numpy(token_types(batch.input_ids, arch.image_token_id, arch.video_token_id))
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, mm_token_type_ids=types, **media).logits.float()
        losses = torch.nn.functional.cross_entropy(logits[0], batch.labels[0], reduction="none")
        total += float((losses * batch.loss_mask[0]).sum())
        tokens += int(batch.loss_mask.sum())
    return total / tokens, tokens


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_evaluate_gives_transformers_loss_and_greedy_answers(tiny, train_data, tmp_path):
    from megatron_ext.eval.samples import read_samples
    from tests.support.hf_generate import HFReference

    out = tmp_path / "eval"
    run_script("eval/evaluate.py", "--megatron-dir", tiny.megatron_dir, "--data-path", train_data, "--output-dir", out,
               "--fast-n", 3, "--max-new-tokens", MAX_NEW_TOKENS, timeout=400)
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    result = json.loads((out / "metrics.json").read_text())
    loss, tokens = _transformers_loss(tiny, train_data, 3)
    assert result["loss_tokens"] == tokens > 0
    assert result["loss"] == pytest.approx(loss, rel=1e-5)
    reference = HFReference(tiny.hf_dir)
    expected = [reference.text(reference.greedy(s.messages, s.images, MAX_NEW_TOKENS))
                for s in read_samples(train_data, "val", limit=3)]
    assert [r["prediction"] for r in records] == expected


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_chat_answers_two_turns_about_an_image_as_transformers(tiny):
    import pexpect

    from megatron_ext.eval.prompts import load_image
    from tests.support.chat_terminal import Terminal, same_text
    from tests.support.hf_generate import HFReference

    image = tiny.requests.parent / "wide.png"
    reference = HFReference(tiny.hf_dir)
    conversation = [{"role": "user", "content": "<image>\nDescribe this image."}]
    first = reference.text(reference.greedy(conversation, [load_image(image)], MAX_NEW_TOKENS))
    # The second turn sees the first question and answer (the image only in the first user turn).
    conversation += [{"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
    second = reference.text(reference.greedy(conversation, [load_image(image)], MAX_NEW_TOKENS))
    term = Terminal("--megatron-dir", tiny.megatron_dir, "--image", image, "--max-new-tokens", MAX_NEW_TOKENS)
    try:
        assert same_text(term.answer("Describe this image."), first)
        assert same_text(term.answer("And then?"), second)
        term.child.sendline("/exit")
        term.child.expect_exact(pexpect.EOF)
    finally:
        term.child.close(force=True)


def _lmms_answers(out: Path) -> dict[int, str]:
    (path,) = out.rglob("*_samples_tiny_vqa.jsonl")
    return {r["doc_id"]: r["filtered_resps"] for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_lmms_eval_scores_hf_megatron_tp2_and_the_trainer_with_transformers_answers(tiny, train_data, tmp_path):
    """benchmark.py on a local VQA task about an image, a second image and a video: the HF checkpoint
    and the Megatron one at TP2 answer each document as transformers' `generate` does on the prompt
    lmms-eval builds (the visual, then the question), and lmms-eval scores them the same; so does the
    trainer's --eval-benchmarks, and its --eval-generate-samples answers are transformers'."""
    from megatron_ext.eval.prompts import load_image
    from megatron_ext.eval.samples import read_samples
    from tests.support.helpers import child_env
    from tests.support.hf_generate import HFReference
    from tests.support.lmms_tasks import write_tasks
    from tests.support.training import metrics, train, trainer_args

    folder, question = tiny.requests.parent, "What is shown?"
    reference = HFReference(tiny.hf_dir)
    images = [[load_image(folder / name).convert("RGB")] for name in ("wide.png", "tall.png")]
    video = reference.encoder.load_video(folder / "clip.mkv", VIDEO_FRAMES)
    turns = [f"<image>\n{question}"] * 2 + [f"<video>\n{question}"]
    expected = [reference.tokenizer.decode(reference.greedy(
        [{"role": "user", "content": turn + "\nAnswer the question using a single word or phrase."}], pictures,
        MAX_NEW_TOKENS, videos), skip_special_tokens=True)
        for turn, pictures, videos in zip(turns, [*images, []], [[], [], [video]])]
    # References made from the expected answers, so the scores are not 0: all 10, 2 of 10, none.
    references = [[expected[0]] * 10, [expected[1]] * 2 + ["zebra"] * 8, ["zebra"] * 10]
    visuals = [{"image_path": str(folder / "wide.png")}, {"image_path": str(folder / "tall.png")},
               {"video_path": str(folder / "clip.mkv")}]
    tasks = write_tasks(tmp_path / "tasks", {"tiny_vqa": [{"question_id": i, **visual, "question": question,
                                                           "answers": refs}
                                                          for i, (visual, refs) in enumerate(zip(visuals, references))]},
                        MAX_NEW_TOKENS)
    env = child_env(HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "datasets"))
    common = ["--include-path", tasks, "--tasks", "tiny_vqa", "--video-frames", VIDEO_FRAMES]
    hf_out, megatron_out = tmp_path / "hf", tmp_path / "megatron"
    run_script("eval/benchmark.py", "--hf-dir", tiny.hf_dir, *common, "--output-dir", hf_out, env=env, timeout=300)
    run_ranks(2, "scripts/eval/benchmark.py", "--megatron-dir", tiny.megatron_dir, "--tp", 2, *common, "--output-dir",
              megatron_out, env=env, timeout=400)

    assert _lmms_answers(hf_out) == _lmms_answers(megatron_out) == dict(enumerate(expected))
    assert len(set(expected)) == 3  # each visual reaches the model
    summary = json.loads((hf_out / "summary.json").read_text())
    assert summary == json.loads((megatron_out / "summary.json").read_text())
    assert summary == [{"task": "tiny_vqa", "metric": "exact_match", "score": pytest.approx(1.6 / 3), "n": 3}]

    # The trainer at DP2, evaluating after an iteration that changed no weight (skipped); its context fits
    # the video's 32 frames (the trainer's lmms-eval model reads videos at the default frame count).
    save = tmp_path / "run"
    train(2, *trainer_args(tiny.megatron_dir, train_data, save, seq_length=1024, train_iters=1, skip_train_iteration_range="1-1",
                           eval_interval=1, eval_iters=1, eval_benchmarks="tiny_vqa", eval_benchmark_include_path=tasks,
                           eval_benchmark_limit=3, eval_generate_samples=3, eval_max_new_tokens=MAX_NEW_TOKENS),
          env=env, timeout=400)
    assert metrics(save, split="val")[1]["benchmark/tiny_vqa/exact_match"] == summary[0]["score"]
    predictions = [json.loads(line)["prediction"] for line in (save / "predictions" / "iter_0000001.jsonl").read_text().splitlines()]
    assert predictions == [reference.text(reference.greedy(s.messages, s.images, MAX_NEW_TOKENS))
                           for s in read_samples(train_data, "val", limit=3)]
