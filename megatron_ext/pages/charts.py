"""Line charts and histograms as inline SVG (line charts also as PNG files), drawn by matplotlib without
its global pyplot state."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Series:
    label: str
    x: list[float]
    y: list[float]
    style: str = "-"


@dataclass
class Chart:
    name: str  # file name of its PNG, and the anchor of its section
    title: str
    ylabel: str
    series: list[Series]
    marks: list[float] = field(default_factory=list)  # iterations drawn as red vertical lines
    mark_label: str = ""

    def has_data(self) -> bool:
        return any(any(math.isfinite(v) for v in s.y) for s in self.series)


def _figure(chart: Chart):
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(6.4, 3.2), layout="constrained")
    axes = figure.add_subplot()
    for series in chart.series:
        points = [(x, y) for x, y in zip(series.x, series.y) if math.isfinite(y)]
        if points:
            xs, ys = zip(*points)
            axes.plot(xs, ys, series.style, label=series.label, marker="o" if len(points) < 3 else None)
    for i, mark in enumerate(chart.marks):
        axes.axvline(mark, color="tab:red", alpha=0.5, linewidth=1, label=chart.mark_label if i == 0 else None)
    axes.set_title(chart.title)
    axes.set_xlabel("iteration")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel(chart.ylabel)
    axes.grid(alpha=0.3)
    if len(chart.series) > 1 or chart.marks:
        axes.legend(fontsize="small")
    return figure


def _inline_svg(figure) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg")
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # inline: no XML declaration or DOCTYPE


def svg(chart: Chart) -> str:
    return _inline_svg(_figure(chart))


def write_png(chart: Chart, directory: Path) -> Path:
    path = directory / f"{chart.name}.png"
    _figure(chart).savefig(path, format="png", dpi=120)
    return path


@dataclass
class Histogram:
    title: str
    xlabel: str
    series: dict[str, list[float]]  # label -> values, drawn side by side
    integer_bins: bool = False  # one bar per integer value (counts such as images per sample)


def histogram_svg(histogram: Histogram) -> str:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(4.8, 2.8), layout="constrained")
    axes = figure.add_subplot()
    values = [v for vs in histogram.series.values() for v in vs]
    if histogram.integer_bins:
        bins = [b - 0.5 for b in range(int(min(values, default=0)), int(max(values, default=0)) + 2)]
    else:
        bins = min(20, max(1, len(set(values))))
    axes.hist(list(histogram.series.values()), bins=bins, label=list(histogram.series))
    axes.set_title(histogram.title)
    axes.set_xlabel(histogram.xlabel)
    axes.set_ylabel("samples")
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    if histogram.integer_bins:
        axes.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    if len(histogram.series) > 1:
        axes.legend(fontsize="small")
    axes.grid(alpha=0.3)
    return _inline_svg(figure)
