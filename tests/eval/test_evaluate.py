"""scripts/eval/evaluate.py and the trainer's --eval-generate-samples: the trainer's last validation
(loss and scored answers, at DP2) equals evaluate.py's on the checkpoint it saved; the files and table
evaluate.py writes; --fast-n on an HF checkpoint; one-line errors."""

from __future__ import annotations

import json
import math

import pytest

from megatron_ext.eval import answer_scores
from tests.support.helpers import run_script
from tests.support.training import metrics as logged_metrics
from tests.support.training import train, trainer_args

MAX_NEW_TOKENS = 8
VAL_SAMPLES = 16  # the whole val split of `train_data`
SCORES = ("exact_match", "bleu", "rouge_l", "cider")


def _written(out) -> tuple[list[dict], dict]:
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    return records, json.loads((out / "metrics.json").read_text())


def _check_scores_match_predictions(records: list[dict], result: dict) -> None:
    answered = [r for r in records if "prediction" in r]
    expected = answer_scores.score_all([r["prediction"] for r in answered], [[r["reference"]] for r in answered])
    for name in SCORES:
        assert result[name] == pytest.approx(expected[name]), name


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_trainer_validation_equals_evaluate_on_the_saved_checkpoint(megatron_clip, train_data, tmp_path):
    save = tmp_path / "run"
    train(2, *trainer_args(megatron_clip, train_data, save, train_iters=2, eval_interval=2, eval_iters=10,
                           eval_generate_samples=VAL_SAMPLES, eval_max_new_tokens=MAX_NEW_TOKENS), timeout=300)
    logged = logged_metrics(save, split="val")[2]

    out = tmp_path / "eval"
    proc = run_script("eval/evaluate.py", "--megatron-dir", save, "--data-path", train_data, "--output-dir", out,
                      "--max-new-tokens", MAX_NEW_TOKENS, timeout=240)
    records, result = _written(out)
    assert len(records) == result["samples"] == VAL_SAMPLES
    assert result["generated_samples"] + result["too_long_samples"] == VAL_SAMPLES and result["generated_samples"] > 0
    assert all(r["reference"] and ("prediction" in r) != ("too_long" in r) for r in records)
    _check_scores_match_predictions(records, result)

    # Same weights, same val samples, same truncation and chat template: the same numbers.
    assert result["loss_tokens"] == logged["loss_tokens"] > 0
    assert result["loss"] == pytest.approx(logged["loss"], rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    trainer_records = [json.loads(line) for line in (save / "predictions/iter_0000002.jsonl").read_text().splitlines()]
    assert trainer_records == records
    for name in (*SCORES, "generated_samples", "too_long_samples"):
        assert result[name] == pytest.approx(logged[name]), name

    for name in ("loss", "perplexity", *SCORES):
        assert name in proc.stdout
    assert f"predictions and metrics written to {out}" in proc.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_fast_n_on_an_hf_checkpoint_and_bad_input(llava_clip, train_data, tmp_path):
    out = tmp_path / "eval"
    run_script("eval/evaluate.py", "--hf-dir", llava_clip, "--data-path", train_data, "--output-dir", out,
               "--fast-n", 3, "--max-new-tokens", MAX_NEW_TOKENS, timeout=120)
    records, result = _written(out)
    assert len(records) == result["samples"] == 3 and result["format"] == "hf"
    assert "loss" not in result  # HF checkpoints are scored on their answers only
    _check_scores_match_predictions(records, result)

    cases = {
        "existing output": (["--output-dir", out], f"error: --output-dir {out}"),
        "empty split": (["--output-dir", tmp_path / "e1", "--split", "test"], "error: --data-path"),
        "bad --fast-n": (["--output-dir", tmp_path / "e2", "--fast-n", 0], "error: --fast-n must be at least 1"),
    }
    for name, (args, start) in cases.items():
        proc = run_script("eval/evaluate.py", "--hf-dir", llava_clip, "--data-path", train_data, *args, check=False,
                          timeout=60, fresh=True)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), (name, proc.stderr)
    assert not (tmp_path / "e1").exists() and not (tmp_path / "e2").exists()
