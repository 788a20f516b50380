"""`megatron-ext-data inspect`: one self-contained HTML page of what the model sees of a dataset's
samples through the trainer's own task encoder (sample_encoding.py): each sample's images as the model
gets them (media_views.py), its conversation as tokens coloured by role with the trained ones
marked, each image or video one block of its positions, its counts and what truncation cut; the
packed rows; and a summary (lengths, images per sample, trained share, skipped and truncated
samples by reason). A preference pair shows its images once, then its chosen and rejected
sequences, each as a conversation's tokens with its counts. No network, no server: charts are
matplotlib's inline SVG, pictures data: URIs.
"""

from __future__ import annotations

import html
import statistics
from datetime import datetime, timezone
from pathlib import Path

from megatron_ext.fsutil import atomic_write_text
from megatron_ext.pages.charts import Histogram, histogram_svg
from megatron_ext.pages.encoded_sample import Inspected, Piece, Sequence
from megatron_ext.pages.media_views import model_html, original_html
from megatron_ext.pages.sample_encoding import EncoderSetup, Inspection, build_encoder, run_inspection
from megatron_ext.pages.sample_sources import Selection, open_source
from megatron_ext.pages.tables import table

PAGE_FILE = "sample_inspector.html"

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 80em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0; }
td, th { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: left; vertical-align: top; }
.charts { display: flex; flex-wrap: wrap; gap: 1em; }
.chart svg { width: 26em; height: auto; }
.sample { border-top: 2px solid #888; margin-top: 2em; }
.sequence { border-left: 3px solid #ccc; padding-left: 0.8em; margin: 1em 0; }
.media, .medium { display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; margin: 0.5em 0; }
figure { margin: 0; }
figcaption, .caption { font-size: 0.85em; color: #555; max-width: 30em; }
img.tile, img.original { image-rendering: pixelated; min-width: 10em; max-width: 24em; border: 1px solid #ccc; }
img.original { max-height: 24em; object-fit: contain; }  /* a thin image stays its shape */
svg.grid { width: 24em; height: auto; }
svg.grid .tile-edge { stroke: #fff; stroke-width: 1; stroke-dasharray: 3 2; }
svg.grid .unpadded { fill: none; stroke: #2a2; stroke-width: 1.5; }
svg.grid .newline { fill: #d22; }
.strip { display: flex; flex-wrap: wrap; gap: 0.3em; }
img.frame { width: 7em; image-rendering: pixelated; }
svg.native { max-width: 100%; height: auto; image-rendering: pixelated; border: 1px solid #ccc; }
svg.native .patch { stroke: #fff; stroke-opacity: 0.6; stroke-width: 1; vector-effect: non-scaling-stroke; }
svg.native .token { fill: none; stroke: #2a2; stroke-width: 2; vector-effect: non-scaling-stroke; }
figure.pair svg.native { margin-right: 0.2em; }
.tokens { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 0.9em; line-height: 1.8; }
.tok { border-bottom: 3px solid transparent; box-shadow: inset -1px 0 rgba(0, 0, 0, 0.18); }
.tok.joined { outline: 1px dotted #777; outline-offset: -1px; }
.role-system { background: #eee8f8; } .role-user { background: #e6f0fb; }
.role-assistant { background: #fdf1dc; } .role-added { background: #eee; }
.tok.trained { border-bottom-color: #c60; font-weight: 600; }
.tok.cut, .block.cut { opacity: 0.45; text-decoration: line-through; }
.block { background: #335; color: #fff; border-radius: 3px; padding: 0 0.4em; }
.legend span { margin-right: 1em; padding: 0 0.3em; }
.skipped { color: #a00; }
"""


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def summary_rows(found: Inspection) -> list[tuple[str, str]]:
    trained = found.trained
    text, train, positions = (sum(getattr(s, name) for s in trained) for name in ("text_tokens", "trained_tokens", "positions"))
    truncated = sum(s.truncated for s in trained)
    unit = found.unit
    rows = [(f"{unit}s counted", f"{len(found.counted)} ({found.scope})"),
            (f"{unit}s shown", str(len(found.shown))),
            (f"{unit}s the trainer uses", str(len(trained))),
            (f"{unit}s skipped", str(sum(found.skipped.values())))]
    rows += [(f"  skipped: {reason}", str(count)) for reason, count in found.skipped.most_common()]
    rows += [(f"{unit}s truncated", f"{truncated} ({_share(truncated, len(trained))})"),
             ("text tokens / total positions", f"{text:,} / {positions:,}"),
             ("trained tokens", f"{train:,} ({_share(train, text)} of text tokens, {_share(train, positions)} of positions)")]
    if trained:
        rows.append((f"images per {unit} (mean)", f"{statistics.mean(s.images for s in trained):.2f}"))
    if found.rows:
        rows.append(("packed rows", f"{len(found.rows)}, padding {statistics.mean(r.padding_share for r in found.rows):.1%} (mean)"))
    return rows


def _charts(found: Inspection) -> str:
    trained = found.trained
    if not trained:
        return ""
    unit = found.unit
    charts = [Histogram(f"{unit.capitalize()} lengths", "tokens / positions",
                        {"text tokens": [s.text_tokens for s in trained], "total positions": [s.positions for s in trained]}),
              Histogram(f"Images per {unit}", "images", {"images": [s.images for s in trained]}, integer_bins=True),
              Histogram("Trained share", "trained tokens / text tokens",
                        {f"{unit}s": [s.trained_tokens / s.text_tokens for s in trained if s.text_tokens]})]
    return '<div class="charts">' + "".join(f'<div class="chart">{histogram_svg(c)}</div>' for c in charts) + "</div>"


def _packing(found: Inspection) -> str:
    if not found.rows:
        return ""
    shown = {s.key for s in found.shown}
    rows = [(i + 1, ", ".join(r.keys), " + ".join(map(str, r.lengths)), f"{r.length} of {r.capacity}", f"{r.padding_share:.1%}")
            for i, r in enumerate(found.rows) if shown & set(r.keys)]
    unit = found.unit
    return (f'<h2>Packed rows</h2>\n<p>The rows the trainer\'s packing makes of the {unit}s counted, a packing buffer at a '
            f'time (training draws them shuffled, so its rows mix other {unit}s); those holding a shown {unit}:</p>\n'
            '<div id="packing">' + table(rows, ("row", f"{unit}s", "positions each", "row length", "padding"), "packing")
            + "</div>\n")


def _piece(piece: Piece, sample: Inspected) -> str:
    if piece.media is not None:
        css = "block cut" if piece.cut else "block"
        number = sample.media[piece.media].number if sample.media else piece.media + 1
        pair = f" pair {piece.pair}" if piece.pair else ""
        return (f'<span class="{css}" data-positions="{piece.positions}">{piece.role} {number}{pair}: '
                f'{piece.positions:,} positions</span>')
    css = f"tok role-{piece.role}" + (" trained" if piece.trained else "") + (" cut" if piece.cut else "")
    if piece.tokens > 1:  # a character split over tokens: one box, the count on hover
        return (f'<span class="{css} joined" data-tokens="{piece.tokens}" title="{piece.tokens} tokens">'
                f'{html.escape(piece.text)}</span>')
    return f'<span class="{css}">{html.escape(piece.text)}</span>'


def _cut_text(sample: Inspected, sequence: Sequence) -> str:
    cut = sequence.cut
    if not sample.truncated:
        return "no"
    tokens = sum(1 for p in cut if p.media is None)
    return f"yes: {tokens} tokens cut at the end: " + "".join(p.text for p in cut)[:200]


def _detail(sample: Inspected) -> str:
    shown = sample.skip_detail and sample.skip_detail != sample.skip_reason
    return f" ({html.escape(sample.skip_detail)})" if shown else ""


def _sequence(sequence: Sequence, sample: Inspected) -> tuple[str, str]:
    """(its counts, its tokens) of one sequence of `sample`."""
    stats = [("tokens", f"{sequence.text_tokens:,}"), ("trained tokens", f"{sequence.trained_tokens:,}"),
             ("image positions", f"{sequence.image_positions:,}"), ("total positions", f"{sequence.positions:,}")]
    if not sequence.name:  # a conversation; a pair is skipped rather than cut
        stats.append(("truncated", _cut_text(sample, sequence)))
    tokens = "".join(_piece(p, sample) for p in sequence.pieces)
    return table(stats, css="stats"), f'<div class="tokens">{tokens}</div>'


def _sample(sample: Inspected, found: Inspection) -> str:
    title = f"{found.unit.capitalize()} {sample.key} (index {sample.index}" + \
        (f", record id {sample.record_id})" if sample.record_id else ")")
    head = f'<section class="sample" data-key="{html.escape(sample.key)}"><h3>{html.escape(title)}</h3>'
    if sample.skip_reason:
        return (f'{head}<p class="skipped">skipped by the trainer: {html.escape(sample.skip_reason)}'
                f'{_detail(sample)}</p></section>')
    media = "".join(f'<div class="medium">{original_html(m)}{model_html(m, found.tiled)}</div>' for m in sample.media)
    media = f'<div class="media">{media}</div>'
    if not found.pairs:
        (conversation,) = sample.sequences
        stats, tokens = _sequence(conversation, sample)
        return f"{head}{stats}{media}{tokens}</section>"
    sequences = "".join(f'<div class="sequence" data-answer="{s.name}"><h4>the prompt with the {s.name} answer</h4>'
                        + "".join(_sequence(s, sample)) + "</div>" for s in sample.sequences)
    return f"{head}{media}{sequences}</section>"


_LEGEND = ('<p class="legend">Roles: <span class="role-system">system</span><span class="role-user">user</span>'
           '<span class="role-assistant">assistant</span><span class="role-added">added by the tokenizer (BOS, EOS)'
           '</span> (what the template renders around a message counts with it); <span class="tok trained">underlined '
           'bold</span>: trained (the model learns to predict the token: the loss mask is 1 at the position before it); '
           '<span class="block">image 1: N positions</span>: an image or video as the positions the model expands it '
           'to; struck out: cut by truncation; a thin line ends each token, and <span class="tok joined">dotted</span> '
           'boxes are characters the tokenizer splits over several tokens (hover for how many).</p>')
_PAIRS = ('<p class="legend">A pair is one sample of two sequences, the prompt with the chosen answer then with the '
          'rejected one; both use the pair\'s images and videos, which the model gets once (shown once, above the '
          'sequences).</p>')


def render(found: Inspection) -> str:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    title = "What the model sees"
    samples = "\n".join(_sample(s, found) for s in found.shown)
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title>"
            f"<style>{_STYLE}</style></head><body>\n<h1>{title}</h1>\n"
            f"<p>{html.escape(found.source)} through the trainer's task encoder, read {now}.</p>\n"
            f'<div id="encoder">{table(found.encoder)}</div>\n'
            f'<h2>Summary</h2>\n<div id="summary">{table(summary_rows(found))}</div>\n{_charts(found)}\n'
            f"{_packing(found)}<h2>{found.unit.capitalize()}s</h2>\n{_LEGEND}\n{_PAIRS if found.pairs else ''}"
            f"{samples}\n</body></html>\n")


def write_inspection(data: str | Path, output: str | Path, setup: EncoderSetup, selection: Selection,
                     split: str = "train", image_root: str | Path | None = None) -> Path:
    """Write the page for `selection` of DATA (a prepared dataset or a LLaVA JSON / JSONL file)."""
    source = open_source(data, split, image_root, selection)
    encoder = build_encoder(setup, source.pairs)
    found = run_inspection(source, encoder, selection.everything, selection.keys)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output, render(found))
    return output
