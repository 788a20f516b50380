"""`megatron-ext-train report SAVE_DIR`: a run's page from its own records, resumed segments joined."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_ext.checkpoint import layout
from megatron_ext.pages.run_log import join_segments, read_run
from megatron_ext.pages.run_report import write_report
from megatron_ext.train.metrics_log import METRICS_FILE
from tests.support.helpers import run_python


def _train(iteration: int, loss: float, skipped: bool = False) -> dict:
    return {"split": "train", "iteration": iteration, "loss": loss, "lr": 1e-3 / iteration, "grad_norm": 1.0,
            "skipped": skipped, "tokens_per_s": 100.0 * iteration, "tflops_per_gpu": 98.9, "padding_share": 0.25,
            "skipped_samples": 1, "truncated_samples": 2}


def _killed_then_resumed_run(save_dir: Path) -> None:
    """Iterations 1-6 logged, a checkpoint at 4, killed; resumed from 4, iterations 5-8 logged again
    (5 skipped, 7 not finite), an evaluation at 4 and 8; the last line half-written."""
    first = [_train(i, 10.0 - i) for i in range(1, 7)] + [{"split": "val", "iteration": 4, "loss": 7.5}]
    second = [_train(5, 0.0, skipped=True), _train(6, 4.0), _train(7, math.nan), _train(8, 3.0),
              {"split": "val", "iteration": 8, "loss": 3.5}]
    save_dir.mkdir(parents=True)
    lines = [json.dumps(r) for r in first + second] + ['{"split": "train", "itera']
    (save_dir / METRICS_FILE).write_text("\n".join(lines))
    for iteration in (4, 8):
        snapshot = save_dir / layout.snapshot_name(iteration)
        snapshot.mkdir()
        layout.write_metadata(snapshot, kind="trained", iteration=iteration, hf_config={}, tp=1, pp=1, dtype="float32",
                              run_config={"train_iters": 8, "config": {"lr": 1e-3}})


def test_resumed_segments_replace_what_the_killed_one_logged_past_its_checkpoint(tmp_path):
    splits, segments = join_segments([_train(1, 9), _train(2, 8), _train(3, 7), _train(2, 6), _train(3, 5)])
    assert segments == 2
    assert [(r["iteration"], r["loss"]) for r in splits["train"]] == [(1, 9), (2, 6), (3, 5)]

    _killed_then_resumed_run(tmp_path / "run")
    run = read_run(tmp_path / "run")
    assert [r["iteration"] for r in run.train] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [r["loss"] for r in run.train][4:6] == [0.0, 4.0]  # the resumed segment's
    assert [r["iteration"] for r in run.val] == [4, 8]
    assert run.segments == 2 and run.train_iters == 8
    assert [c.iteration for c in run.checkpoints] == [4, 8]


@pytest.mark.multiprocess  # a browser
@pytest.mark.timeout(120)
def test_the_page_opens_offline_in_a_browser_and_shows_the_run(tmp_path):
    from tests.pages.browser import opened

    _killed_then_resumed_run(tmp_path / "run")
    page_path = write_report(tmp_path / "run", png=True)
    assert page_path == tmp_path / "run" / "report.html"
    assert sorted(p.name for p in (tmp_path / "run" / "report_png").iterdir()) == [
        "grad_norm.png", "loss.png", "lr.png", "padding_share.png", "tflops_per_gpu.png", "tokens_per_s.png"]
    with opened(page_path) as shown:
        rows = dict(zip(shown.page.locator("#summary td:nth-child(1)").all_inner_texts(),
                        shown.page.locator("#summary td:nth-child(2)").all_inner_texts()))
        assert rows["iterations"] == "8 of 8"
        assert rows["segments"] == "2 (resumed 1 times)"
        assert rows["skipped iterations"] == "5" and rows["non-finite losses"] == "7"
        assert rows["last train loss"] == "3.0000" and rows["last evaluation loss"] == "3.5000 (iteration 8)"
        assert rows["MFU (median, against 989 TFLOP/s)"] == "10.00%"
        assert rows["samples skipped / truncated"] == "1 / 2"
        charts = shown.page.locator(".chart svg")
        assert charts.count() == 6
        assert all(box["width"] > 100 and box["height"] > 50 for box in (charts.nth(i).bounding_box() for i in range(6)))
        assert shown.page.locator("#checkpoints td").all_inner_texts()[0::3] == ["4", "8"]
        assert shown.page.locator("#config").inner_text() .startswith("trainer options, run plan and model")  # folded
        shown.page.locator("#config summary").click()
        assert '"lr": 0.001' in shown.page.locator("#config").inner_text()
        assert shown.console_errors == [] and shown.requests == []


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_command_writes_the_page_and_refuses_a_directory_without_records(tmp_path):
    _killed_then_resumed_run(tmp_path / "run")
    done = run_python("scripts/train/report.py", tmp_path / "run", "--output", tmp_path / "out" / "page.html")
    assert (tmp_path / "out" / "page.html").is_file() and str(tmp_path / "out" / "page.html") in done.stdout
    refused = run_python("scripts/train/report.py", tmp_path, check=False, fresh=True)
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines() == [
        f"error: {tmp_path} has no metrics.jsonl: give the --save-dir of a training run (it is written from the "
        "first logged iteration on)"]
