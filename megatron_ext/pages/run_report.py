"""`megatron-ext-train report SAVE_DIR`: one self-contained HTML page of a training run from its own
records (run_log.py): loss and evaluation loss, learning rate, gradient norm, tokens/s, TFLOP/s
and MFU, padding share, skipped and non-finite iterations, the resolved configuration and the
checkpoints saved. Charts are matplotlib's inline SVG; `--png` also writes each as a PNG."""

from __future__ import annotations

import html
import json
import math
import statistics
from datetime import datetime, timezone
from pathlib import Path

from megatron_ext.fsutil import atomic_output_dir, atomic_write_text
from megatron_ext.pages.charts import Chart, Series, svg, write_png
from megatron_ext.pages.run_log import RunLog, read_run
from megatron_ext.pages.tables import table
from megatron_ext.train.flops import H100_BF16_PEAK_TFLOPS

REPORT_FILE = "report.html"
PNG_DIR = "report_png"

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
td, th { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
.charts { display: flex; flex-wrap: wrap; gap: 1em; }
.chart svg { width: 32em; height: auto; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; }
"""


def _values(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    points = [(r["iteration"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [float(p[1]) for p in points]


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def bad_iterations(run: RunLog) -> tuple[list[int], list[int]]:
    """(iterations whose batch was skipped, iterations whose loss was not finite)."""
    skipped = [r["iteration"] for r in run.train if r.get("skipped")]
    nonfinite = [r["iteration"] for r in run.train if not r.get("skipped") and not math.isfinite(r.get("loss", 0.0))]
    return skipped, nonfinite


def charts(run: RunLog) -> list[Chart]:
    skipped, nonfinite = bad_iterations(run)

    def one(name: str, title: str, ylabel: str, key: str) -> Chart:
        return Chart(name, title, ylabel, [Series(key, *_values(run.train, key))])

    loss = Chart("loss", "Loss", "loss", [Series("train", *_values(run.train, "loss"))],
                 marks=sorted(skipped + nonfinite), mark_label="skipped or non-finite")
    if run.val:
        loss.series.append(Series("evaluation", *_values(run.val, "loss"), style="--"))
    found = [loss,
             one("lr", "Learning rate", "lr", "lr"),
             one("grad_norm", "Gradient norm", "grad norm", "grad_norm"),
             one("tokens_per_s", "Throughput", "tokens/s", "tokens_per_s"),
             one("tflops_per_gpu", "Model TFLOP/s per GPU", "TFLOP/s", "tflops_per_gpu"),
             one("padding_share", "Padding share of the batch", "share", "padding_share")]
    return [chart for chart in found if chart.has_data()]


def summary(run: RunLog, peak_tflops: float) -> list[tuple[str, str]]:
    skipped, nonfinite = bad_iterations(run)
    last = run.train[-1] if run.train else {}
    done = last.get("iteration", 0)
    rows = [("iterations", f"{done} of {run.train_iters}" if run.train_iters else str(done)),
            ("segments", f"{run.segments} (resumed {run.segments - 1} times)" if run.segments > 1 else str(run.segments))]
    losses = _finite(_values(run.train, "loss")[1])
    if losses:
        rows.append(("last train loss", f"{losses[-1]:.4f}"))
    if run.val:
        rows.append(("last evaluation loss", f"{run.val[-1]['loss']:.4f} (iteration {run.val[-1]['iteration']})"))
    for key, label, unit in (("tokens_per_s", "tokens/s (median)", ""), ("tflops_per_gpu", "TFLOP/s per GPU (median)", "")):
        values = _finite(_values(run.train, key)[1])
        if values:
            rows.append((label, f"{statistics.median(values):.4g}{unit}"))
            if key == "tflops_per_gpu":
                rows.append((f"MFU (median, against {peak_tflops:g} TFLOP/s)", _share(statistics.median(values) / peak_tflops)))
    padding = _finite(_values(run.train, "padding_share")[1])
    if padding:
        rows.append(("padding share (mean)", f"{statistics.mean(padding):.1%}"))
    rows += [("skipped iterations", ", ".join(map(str, skipped)) or "none"),
             ("non-finite losses", ", ".join(map(str, nonfinite)) or "none"),
             ("samples skipped / truncated", f"{last.get('skipped_samples', 0)} / {last.get('truncated_samples', 0)}"),
             ("checkpoints", str(len(run.checkpoints)))]
    return rows


def _share(value: float) -> str:
    return f"{value:.2%}" if value >= 1e-4 else f"{value * 100:.2g}%"  # a CPU run's MFU is tiny, not zero


def render(run: RunLog, drawn: list[Chart], peak_tflops: float = H100_BF16_PEAK_TFLOPS) -> str:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    figures = "".join(f'<div class="chart" id="{c.name}">{svg(c)}</div>' for c in drawn)
    checkpoints = table([(c.iteration, str(c.path), c.saved_at.strftime("%Y-%m-%d %H:%M:%S UTC"))
                          for c in run.checkpoints], ("iteration", "path", "saved")) if run.checkpoints else \
        "<p>No checkpoint saved yet.</p>"
    config = ("<details><summary>trainer options, run plan and model (as the newest checkpoint stores them)</summary>"
              
              f"<pre>{html.escape(json.dumps(run.config, indent=2, sort_keys=True))}</pre></details>" if run.config else
              "<p>Not known before the first checkpoint (each one stores it).</p>")
    title = f"Training run {run.save_dir.name}"
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>\n<h1>{html.escape(title)}</h1>\n"
            f"<p>{html.escape(str(run.save_dir))}, read {now}.</p>\n"
            f'<h2>Summary</h2>\n<div id="summary">{table(summary(run, peak_tflops))}</div>\n'
            f'<h2>Charts</h2>\n<div class="charts">{figures}</div>\n'
            f'<h2>Checkpoints</h2>\n<div id="checkpoints">{checkpoints}</div>\n'
            f'<h2>Resolved configuration</h2>\n<div id="config">{config}</div>\n</body></html>\n')


def write_report(save_dir: str | Path, output: str | Path | None = None, png: bool = False,
                 peak_tflops: float = H100_BF16_PEAK_TFLOPS) -> Path:
    """Write the page (default SAVE_DIR/report.html), and with `png` each chart under report_png/ beside it."""
    run = read_run(save_dir)
    output = Path(output) if output else run.save_dir / REPORT_FILE
    output.parent.mkdir(parents=True, exist_ok=True)
    drawn = charts(run)
    atomic_write_text(output, render(run, drawn, peak_tflops))
    if png:
        with atomic_output_dir(output.parent / PNG_DIR) as tmp:
            for chart in drawn:
                write_png(chart, tmp)
    return output
