"""The library's packages import downward only: the trainer may use evaluation, evaluation never the
trainer, and the building blocks (model, data, HF I/O, checkpoints, converters) neither."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_ext"
UPPER = {"train", "eval", "launch", "commands"}
MAY_NOT_IMPORT = {
    "eval": {"train", "launch", "commands"},
    **{lower: UPPER for lower in ("model", "data", "hf", "checkpoint", "convert")},
}


def _imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        found |= {name.split(".")[1] for name in names if name.startswith("megatron_ext.")}
    return found


@pytest.mark.parametrize("package", sorted(MAY_NOT_IMPORT))
def test_a_package_does_not_import_the_ones_above_it(package):
    offending = {f"{path.relative_to(PACKAGE)} imports megatron_ext.{name}"
                 for path in (PACKAGE / package).rglob("*.py")
                 for name in _imported_packages(path) & MAY_NOT_IMPORT[package]}
    assert not offending, sorted(offending)
