"""Line charts as inline SVG (or PNG files), drawn by matplotlib without its global pyplot state."""

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


def svg(chart: Chart) -> str:
    buffer = io.StringIO()
    _figure(chart).savefig(buffer, format="svg")
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # inline: no XML declaration or DOCTYPE


def write_png(chart: Chart, directory: Path) -> Path:
    path = directory / f"{chart.name}.png"
    _figure(chart).savefig(path, format="png", dpi=120)
    return path
