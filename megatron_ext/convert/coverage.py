"""Coverage checks: every source tensor used exactly once, every destination tensor written.

Both directions reduce to name bookkeeping over the mapping table, so the checks run before
anything is written (Megatron -> HF; the comparison with the names transformers expects, before
the exported directory appears) or before the snapshot is saved (HF -> Megatron), and a failure
lists the offending names.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from megatron_ext.model.mapping_rules import Mapping

_SHOWN = 20


@dataclass
class FillReport:
    """What one rank did while filling its model from HF tensors (canonical Megatron names)."""

    filled: list[str] = field(default_factory=list)  # Megatron tensors written
    failed: list[str] = field(default_factory=list)  # Megatron tensors whose HF tensors are missing or misfit
    unmapped: list[str] = field(default_factory=list)  # Megatron tensors with no table row
    missing_hf: list[str] = field(default_factory=list)  # HF tensors a row needs that the checkpoint lacks
    misfits: list[str] = field(default_factory=list)  # "HF names: why they do not fit the Megatron tensor"


def _listing(what: str, names) -> str:
    names = sorted(set(names))
    more = f" ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return f"{what} ({len(names)}): {', '.join(names[:_SHOWN])}{more}"


def _used_twice(rows: list[Mapping]) -> list[str]:
    uses = Counter(name for row in rows if not row.tied for name in row.hf)
    return [name for name, count in uses.items() if count > 1]


def hf_to_megatron_problems(table: dict[str, Mapping], reports: list[FillReport], hf_names, kept_aside) -> list[str]:
    """Problems of an HF -> Megatron fill, from every rank's report (DP replicas repeat each other).

    `kept_aside`: HF tensors LLaVA never uses, stored beside the checkpoint instead.
    """
    filled = {name for report in reports for name in report.filled}
    rows = [table[name] for name in filled]
    tried = rows + [table[name] for report in reports for name in report.failed]
    consumed = {hf for row in tried for hf in row.hf}
    problems = []
    unmapped = [name for report in reports for name in report.unmapped]
    if unmapped:
        problems.append(_listing("Megatron tensors with no row in the mapping table", unmapped))
    missing = [name for report in reports for name in report.missing_hf]
    if missing:
        problems.append(_listing("HF tensors the mapping needs but the checkpoint lacks", missing))
    misfits = [text for report in reports for text in report.misfits]
    if misfits:
        problems.append(_listing("HF tensors that do not fit the model", misfits))
    unused = set(hf_names) - consumed - set(kept_aside)
    if unused:
        problems.append(_listing("HF tensors no Megatron tensor uses", unused))
    twice = _used_twice(rows)
    if twice:
        problems.append(_listing("HF tensors used by more than one Megatron tensor", twice))
    return problems


def megatron_to_hf_problems(table: dict[str, Mapping], megatron_names, kept_aside) -> list[str]:
    """Problems of a Megatron -> HF export that the names alone show, checked before any tensor is
    written. `megatron_names`: canonical names of the full (TP1/PP1) model; `kept_aside`: HF
    tensors restored from beside the checkpoint."""
    problems = []
    unmapped = [name for name in megatron_names if name not in table]
    if unmapped:
        problems.append(_listing("Megatron tensors with no row in the mapping table", unmapped))
    twice = [name for name, count in Counter(hf_names_written(table, megatron_names, kept_aside)).items() if count > 1]
    if twice:
        problems.append(_listing("HF tensors produced more than once", twice))
    return problems


def hf_names_written(table: dict[str, Mapping], megatron_names, kept_aside) -> list[str]:
    """The HF tensors an export of these Megatron tensors writes (tied copies once)."""
    rows = [table[name] for name in megatron_names if name in table and not table[name].tied]
    return [hf for row in rows for hf in row.hf] + list(kept_aside)


def expected_hf_problems(written, expected_hf) -> list[str]:
    """HF tensors `transformers` expects for the config (`expected_hf`) that the export does not
    write, and the reverse: checked before the exported directory appears."""
    problems = []
    missing = set(expected_hf) - set(written)
    if missing:
        problems.append(_listing("HF tensors transformers expects that nothing produces", missing))
    unexpected = set(written) - set(expected_hf)
    if unexpected:
        problems.append(_listing("HF tensors produced that transformers does not expect", unexpected))
    return problems
