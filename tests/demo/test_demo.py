"""The README's main job end to end, shortened: every real CLI, two processes with TP2 on CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_ext.checkpoint import layout
from tests.support.helpers import run_script


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_demo_runs_the_whole_pipeline(tmp_path):
    from transformers import LlavaForConditionalGeneration

    out = tmp_path / "demo"
    proc = run_script("demo/run_demo.py", "--output-dir", out, "--stage1-iters", 4, "--stage2-iters", 4,
                      "--dpo-iters", 4, timeout=600)
    assert "answer:" in proc.stdout and "demo finished" in proc.stdout
    assert json.loads((out / "answer.jsonl").read_text())["answer"] in proc.stdout

    # run.py -g 2 --tp 2 --stage 1 trained, saved and exited 0; stage 2 started from its checkpoint, DPO from stage 2's.
    for stage in ("stage1", "stage2", "dpo"):
        snapshot = layout.find_snapshot(out / stage)
        assert (snapshot.iteration, snapshot.tp, snapshot.meta["kind"]) == (4, 2, "trained")
        records = [json.loads(line) for line in (out / stage / "metrics.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in records if r["split"] == "train"][-1] == 4
    assert layout.find_snapshot(out / "stage2").meta["run_config"]["start"].startswith(str(out / "stage1"))
    assert layout.find_snapshot(out / "dpo").meta["run_config"]["start"].startswith(str(out / "stage2"))
    # Stage 2 evaluated at its last iteration: loss and 16 answers scored, the answers kept.
    val = [json.loads(line) for line in (out / "stage2" / "metrics.jsonl").read_text().splitlines()][-1]
    assert val["split"] == "val" and val["iteration"] == 4 and val["generated_samples"] == 16 and "cider" in val
    assert len((out / "stage2" / "predictions" / "iter_0000004.jsonl").read_text().splitlines()) == 16
    scores = json.loads((out / "eval" / "metrics.json").read_text())
    assert scores["samples"] == 16 and scores["loss_tokens"] > 0 and f"loss {scores['loss']:.3f}" in proc.stdout
    model, info = LlavaForConditionalGeneration.from_pretrained(out / "hf-trained", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # The report of stage 2, opened in a browser: its 4 iterations, its checkpoint, no error.
    from tests.pages.browser import opened

    assert str(out / "stage2" / "report.html") in proc.stdout
    with opened(out / "stage2" / "report.html") as shown:
        assert "4 of 4" in shown.page.locator("#summary").inner_text()
        assert shown.page.locator("#checkpoints td").all_inner_texts()[0] == "4"
        assert shown.page.locator(".chart svg").count() == 6 and not shown.console_errors and not shown.requests

    # DPO on the pairs about the same pictures: its held-out pairs evaluated before training (policy = reference:
    # no reward, loss log 2; the accuracy 0 only because every reward ties) and after it, when the policy
    # prefers the held-out chosen answers: the hallucinated half of the rejected ones it learns to reject.
    assert (out / "pref-src" / "preference.json").is_file() and (out / "pref-energon" / ".nv-meta").is_dir()
    records = [json.loads(line) for line in (out / "dpo" / "metrics.jsonl").read_text().splitlines()]
    before, after = [r for r in records if r["split"] == "val"]
    assert (before["iteration"], after["iteration"]) == (0, 4) and before["pairs"] == after["pairs"] > 0
    assert before["rewards/margins"] == pytest.approx(0, abs=1e-4)
    assert before["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert after["rewards/margins"] > 0 and after["loss"] < before["loss"] and after["rewards/accuracies"] > 0.5
    assert f"rewards/accuracies {after['rewards/accuracies']:.3f}" in proc.stdout


# family: (transformers' class, its tower's tensor prefix, the prefixes of the tower's mergers stage 2 trains)
QWEN_VL = {"qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "visual.", ("visual.merger.",)),
           "qwen3_vl": ("Qwen3VLForConditionalGeneration", "model.visual.",
                        ("model.visual.merger.", "model.visual.deepstack_merger_list."))}


@pytest.mark.multiprocess
@pytest.mark.timeout(900)  # about 2 minutes on 2 idle cores; 8 with 5 other suites on them
@pytest.mark.parametrize("family", QWEN_VL)
def test_the_qwen_vl_demo_trains_at_tp2_converts_back_and_answers_with_transformers(tmp_path, family):
    import transformers

    from tests.support.helpers import hf_tensors

    model_class, tower_prefix, merger_prefixes = QWEN_VL[family]
    out = tmp_path / "demo"
    proc = run_script("demo/run_demo.py", "--family", family, "--output-dir", out, "--stage2-iters", 4, timeout=600)
    answer = json.loads((out / "answer.jsonl").read_text())["answer"]
    assert f"answer:    {answer}\n" in proc.stdout and "demo finished" in proc.stdout
    assert "megatron_ext.commands.demo answer --hf-dir " + str(out / "hf-trained") in proc.stdout
    # run.py -g 2 --tp 2 --stage 2 trained the converted checkpoint and saved it.
    snapshot = layout.find_snapshot(out / "stage2")
    assert (snapshot.iteration, snapshot.tp, snapshot.meta["kind"]) == (4, 2, "trained")
    assert snapshot.meta["run_config"]["start"].startswith(str(out / "megatron-tp2"))
    records = [json.loads(line) for line in (out / "stage2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if r["split"] == "train"][-1] == 4
    # Back in HF, stage 2 moved the decoder and the tower's mergers, and no other tower tensor.
    before, after = hf_tensors(out / f"hf-{family}"), hf_tensors(out / "hf-trained")
    assert before.keys() == after.keys()
    tower = {name for name in before if name.startswith(tower_prefix)}
    mergers = {name for name in tower if name.startswith(merger_prefixes)}
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == set(before) - tower | mergers
    untrained = [prefix for prefix in merger_prefixes if not any(name.startswith(prefix) for name in mergers)]
    assert not untrained, f"no trained tensor under {untrained}"
    _, info = getattr(transformers, model_class).from_pretrained(out / "hf-trained", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
