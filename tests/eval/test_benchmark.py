"""scripts/eval/benchmark.py: lmms-eval scores an HF checkpoint (through lmms-eval's llava_hf model)
and the same weights as a Megatron checkpoint at TP2 (through our model class) with the same answers
and the same scores, on local VQA, multiple-choice and captioning tasks; the scores are lmms-eval's
and equal the ones recomputed here from the answers; the trainer's --eval-benchmarks logs them too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ext.convert.compare import synthetic_image
from tests.support.helpers import REPO_ROOT, child_env, run_ranks, run_script
from tests.support.lmms_tasks import write_tasks
from tests.support.training import metrics, train, trainer_args

MAX_NEW_TOKENS = 6
TASKS = "tiny_vqa,tiny_mc,tiny_caption"
OTHER = "zebra"


def _vqa_accuracy(prediction: str, references: list[str]) -> float:
    """VQA accuracy (Antol et al.): each of the 10 leave-one-out subsets of the references scores
    min(1, matches / 3); answers normalized as the EvalAI VQA evaluation normalizes them."""
    from lmms_eval.tasks._task_utils.vqa_eval_metric import EvalAIAnswerProcessor

    normalize = EvalAIAnswerProcessor()
    answer, refs = normalize(prediction), [normalize(r) for r in references]
    return sum(min(1.0, sum(r == answer for r in refs[:i] + refs[i + 1:]) / 3) for i in range(len(refs))) / len(refs)


def _choice_correct(prediction: str, target: str) -> float:
    """ScienceQA's rule in LLaVA's evaluation: the letter alone, or "X. ..." starting with it."""
    prediction = prediction.strip()
    if prediction.lower() == target.lower():
        return 1.0
    return float(len(prediction) >= 2 and prediction[0].isupper() and prediction[1] == "." and prediction[0] == target)


def _expected_answer(reference, image, question: str) -> str:
    """transformers' greedy answer to the prompt lmms-eval builds (image, then the text), decoded as
    lmms-eval's llava_hf decodes it and cut at the task's stop string."""
    tokens = reference.greedy([{"role": "user", "content": f"<image>\n{question}"}], [image], MAX_NEW_TOKENS)
    return reference.tokenizer.decode(tokens, skip_special_tokens=True).split("ASSISTANT:")[0]


def _answers(out: Path) -> dict[str, dict[int, str]]:
    answers = {}
    for task in TASKS.split(","):
        (path,) = out.rglob(f"*_samples_{task}.jsonl")
        answers[task] = {r["doc_id"]: r["filtered_resps"] for r in map(json.loads, path.read_text().splitlines())}
    return answers


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_hf_and_megatron_tp2_give_the_same_answers_and_lmms_eval_scores(llava_clip, megatron_clip, hf_reference,
                                                                        train_data, tmp_path):
    (tmp_path / "images").mkdir()
    images = [synthetic_image(10 + i, size) for i, size in enumerate([(64, 48), (50, 80), (40, 40)])]
    paths = [tmp_path / "images" / f"image{i}.png" for i in range(len(images))]
    for image, path in zip(images, paths):
        image.save(path)
    vqa_question = "What is written on the sign?"
    expected = [_expected_answer(hf_reference, image, f"{vqa_question}\nAnswer the question using a single word or phrase.")
                for image in images]
    # References made from the expected answers, so the score is not 0: all 10, 2 of 10, none.
    references = [[expected[0]] * 10, [expected[1]] * 2 + [OTHER] * 8, [OTHER] * 10]
    docs = {
        "tiny_vqa": [{"question_id": i, "image_path": str(p), "question": vqa_question, "answers": refs}
                     for i, (p, refs) in enumerate(zip(paths, references))],
        "tiny_mc": [{"image_path": str(p), "question": "Which shape is shown?", "hint": "A drawing." if i else "",
                     "choices": ["square", "circle", "triangle"], "answer": i} for i, p in enumerate(paths)],
        "tiny_caption": [{"question_id": f"COCO_val2014_{i + 1:012d}.jpg", "id": i + 1, "image_path": str(p),
                          "answer": ["a small picture of noise", "random colored pixels"]} for i, p in enumerate(paths)],
    }
    tasks = write_tasks(tmp_path / "tasks", docs, MAX_NEW_TOKENS)
    env = child_env(HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "datasets"))
    common = ["--include-path", tasks, "--tasks", TASKS]

    hf_out, megatron_out = tmp_path / "hf", tmp_path / "megatron"
    shown = run_script("eval/benchmark.py", "--hf-dir", llava_clip, *common, "--output-dir", hf_out, env=env,
                       timeout=240).stdout
    run_ranks(2, "scripts/eval/benchmark.py", "--megatron-dir", megatron_clip, "--tp", 2, *common, "--output-dir",
                 megatron_out, env=env, timeout=300)

    hf_answers, megatron_answers = _answers(hf_out), _answers(megatron_out)
    assert hf_answers == megatron_answers
    assert [hf_answers["tiny_vqa"][i] for i in range(3)] == expected
    hf_summary = json.loads((hf_out / "summary.json").read_text())
    assert hf_summary == json.loads((megatron_out / "summary.json").read_text())
    scores = {(row["task"], row["metric"]): row for row in hf_summary}
    assert set(scores) == {("tiny_vqa", "exact_match"), ("tiny_mc", "exact_match"), ("tiny_caption", "coco_CIDEr")}
    assert all(row["n"] == 3 for row in hf_summary)

    vqa = [_vqa_accuracy(hf_answers["tiny_vqa"][i], references[i]) for i in range(3)]
    assert vqa == pytest.approx([1.0, 0.6, 0.0])
    assert scores["tiny_vqa", "exact_match"]["score"] == pytest.approx(sum(vqa) / 3)
    mc = [_choice_correct(hf_answers["tiny_mc"][i], "ABC"[i]) for i in range(3)]
    assert scores["tiny_mc", "exact_match"]["score"] == pytest.approx(sum(mc) / 3)
    assert scores["tiny_caption", "coco_CIDEr"]["score"] >= 0.0
    assert "tiny_vqa" in shown and f"lmms-eval results and samples written to {hf_out}" in shown
    # What COCO's scorer writes for the evaluation server stays with the results.
    for out in (hf_out, megatron_out):
        assert json.loads((out / "submissions" / "coco_captions_val2014_alg_results.json").read_text())

    # The trainer at DP2, evaluating after an iteration that changed no weight (skipped), logs the same.
    save = tmp_path / "run"
    train(2, *trainer_args(megatron_clip, train_data, save, train_iters=1, skip_train_iteration_range="1-1",
                           eval_interval=1, eval_iters=1, eval_benchmarks=TASKS, eval_benchmark_include_path=tasks,
                           eval_benchmark_limit=3), env=env, timeout=300)
    logged = metrics(save, split="val")[1]
    for (task, metric), row in scores.items():
        assert logged[f"benchmark/{task}/{metric}"] == row["score"], (task, metric)
    assert not (REPO_ROOT / "submissions").exists()  # the working directory of every run above


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_bad_input_is_one_line(llava_clip, tmp_path):
    tasks = write_tasks(tmp_path / "tasks", {"tiny_vqa": []}, MAX_NEW_TOKENS)
    cases = {
        "unknown task": (["--tasks", "no_such_task", "--include-path", tasks], "error: --tasks: unknown lmms-eval task"),
        "missing include path": (["--tasks", "tiny_vqa", "--include-path", tmp_path / "nowhere"],
                                 "error: --include-path"),
        "bad limit": (["--tasks", "tiny_vqa", "--include-path", tasks, "--limit", 0], "error: --limit must be at least 1"),
    }
    for name, (args, start) in cases.items():
        out = tmp_path / name.replace(" ", "_")
        proc = run_script("eval/benchmark.py", "--hf-dir", llava_clip, *args, "--output-dir", out, check=False,
                          timeout=90, fresh=True)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), (name, proc.stderr)
        assert not out.exists()


def test_lmms_eval_finds_megatron_llava_through_the_entry_point():
    from lmms_eval.models.registry_v2 import ModelRegistryV2

    from megatron_ext.eval.lmms_model import MODEL_ID, MegatronLlava

    registry = ModelRegistryV2()
    registry.load_entrypoint_manifests()
    assert registry.get_model_class(MODEL_ID) is MegatronLlava


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("source", ["hf", "megatron", "megatron-tp2"])
def test_a_task_whose_data_is_not_cached_offline_is_one_line_naming_it_and_what_to_do(request, source, tmp_path):
    checkpoint = {"hf": ["--hf-dir", request.getfixturevalue("llava_clip")]}.get(source) or \
        ["--megatron-dir", request.getfixturevalue("megatron_clip"), *(["--tp", 2] if source == "megatron-tp2" else [])]
    tasks = write_tasks(tmp_path / "tasks", {"tiny_vqa": []}, MAX_NEW_TOKENS)
    # tiny_vqa with its data on the Hub instead of in a local file, as lmms-eval's own tasks have it.
    spec = (tasks / "tiny_vqa.yaml").read_text().replace("task: tiny_vqa", "task: hub_vqa")
    spec = spec.replace("dataset_path: json", "dataset_path: lmms-lab/no-such-cached-set")
    (tasks / "hub_vqa.yaml").write_text(spec)
    env = child_env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    proc = run_script("eval/benchmark.py", *checkpoint, "--tasks", "hub_vqa", "--include-path", tasks,
                      "--output-dir", tmp_path / "out", env=env, check=False, timeout=150, fresh=True)
    # No traceback (at TP2, which benchmark.py starts on two ranks itself, not torchrun's ChildFailedError either),
    # and no lmms-eval warning of a circular import of our model's module (Megatron path).
    assert "Traceback" not in proc.stderr and "circular" not in proc.stderr, proc.stderr
    line = ("error: --tasks hub_vqa: lmms-eval cannot load a task's data: Couldn't reach 'lmms-lab/no-such-cached-set' "
            "on the Hub (OfflineModeIsEnabled); download it once where the Hub is reachable (the same command without "
            f"HF_HUB_OFFLINE / HF_DATASETS_OFFLINE caches it in {tmp_path / 'hf_home' / 'datasets'}), or give "
            "--include-path task YAMLs whose dataset_path is a local copy (docs/benchmarks.md)")
    shown = [shown for shown in proc.stderr.strip().splitlines() if " INFO " not in shown]
    if source == "megatron-tp2":  # the first rank's line, as run.py reports a rank's failure (torchrun's status)
        assert proc.returncode == 1 and len(shown) == 1 and shown[0].startswith(line + " (rank "), proc.stderr
    else:
        assert proc.returncode == 2 and shown == [line], proc.stderr
    assert not (tmp_path / "out").exists()
