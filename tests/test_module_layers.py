"""The library is a stack of layers (ARCHITECTURE.md): a part imports only parts of its own layer or
below, imports inside functions included, and no two parts import each other in a circle."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from tests.support.helpers import run

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_ext"
# Lowest first. A part is a sub-package or a module at the package's top level.
LAYERS = [
    ("foundation", {"errors", "rank_failures", "shared_failure", "environ", "fsutil", "logs", "progress", "lifetime",
                    "stop_signals", "compat", "distributed", "container", "hf_loading", "preloaded"}),
    ("model", {"model"}),
    ("families", {"families"}),
    ("checkpoint", {"checkpoint"}),
    ("data", {"data"}),
    ("hf", {"hf"}),
    ("lora", {"lora"}),
    ("convert", {"convert"}),
    ("eval", {"eval"}),
    ("config", {"config"}),
    ("objectives", {"objectives"}),
    ("train", {"train"}),
    ("memory", {"memory"}),
    ("verify", {"verify"}),
    ("launch", {"launch"}),
    ("pages", {"pages"}),
    ("entry points", {"commands", "demo"}),
]
LEVEL = {part: level for level, (_, parts) in enumerate(LAYERS) for part in parts}


def _part(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _imports(path: Path, text: str | None = None) -> set[str]:
    """The parts of megatron_ext a file (its `text`, default: read) imports, wherever the import is."""
    package = ["megatron_ext", *path.relative_to(PACKAGE).parent.parts]
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if text is None else text)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, [base, node.module]))
            modules = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for module in modules:
            names = module.split(".")
            if names[0] == "megatron_ext" and len(names) > 1 and names[1] in LEVEL:
                found.add(names[1])
    return found


# Outside code the library may not import, by top-level module: the parts allowed to, inside functions
# only (an extra's dependency, imported where the command that needs it runs), else none at all.
ONLY_LAZILY_IN = {"tests": set(), "trl": set(), "peft": {"verify"}}


def _outside_imports(text: str) -> list[tuple[str, bool]]:
    """(top-level module, imported inside a function) for each absolute import in `text`."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name.split(".")[0], in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and not child.level:
                found.append((child.module.split(".")[0], in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(text), False)
    return found


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {part: set() for part in LEVEL}
    for path in PACKAGE.rglob("*.py"):
        if path.parent != PACKAGE or path.stem != "__init__":
            graph[_part(path)] |= _imports(path) - {_part(path)}
    return graph


def test_every_part_of_the_library_has_a_layer():
    parts = {_part(path) for path in PACKAGE.rglob("*.py")} - {"__init__"}  # the package's own, empty
    assert parts == set(LEVEL), f"parts without a layer, or layers naming no part: {sorted(parts ^ set(LEVEL))}"


def test_no_part_imports_a_higher_layer():
    upward = sorted(f"{part} ({LAYERS[LEVEL[part]][0]}) imports {other} ({LAYERS[LEVEL[other]][0]})"
                    for part, imported in _graph().items() for other in imported if LEVEL[other] > LEVEL[part])
    assert not upward, upward


def test_no_import_cycle_between_parts():
    graph, cycles = _graph(), []

    def visit(part: str, trail: list[str]) -> None:
        for other in sorted(graph[part]):
            if other in trail:
                cycles.append(" -> ".join(trail[trail.index(other):] + [other]))
            elif other not in done:
                visit(other, trail + [other])
        done.add(part)

    done: set[str] = set()
    for part in sorted(graph):
        if part not in done:
            visit(part, [part])
    assert not cycles, cycles


def test_the_graph_sees_every_kind_of_import():
    """Module-level, in-function, `from megatron_ext import x` and relative imports all count."""
    text = ("from megatron_ext import train\n"
            "def f():\n    import megatron_ext.eval.answer_scores\n    from ..launch import runner\n    from . import mapping\n")
    assert _imports(PACKAGE / "convert" / "probe.py", text) == {"train", "eval", "launch", "convert"}


@pytest.mark.multiprocess
def test_the_run_configuration_imports_no_torch():
    """run.py --dry-run and the plan's checks stay fast: config/ is read before torch is imported."""
    modules = [f"megatron_ext.config.{path.stem}" for path in (PACKAGE / "config").glob("*.py")]
    code = f"import sys, {', '.join(modules)}; print('torch' in sys.modules)"
    assert run([sys.executable, "-c", code], timeout=120, fresh=True).stdout.strip() == "False"


def test_the_library_imports_no_test_code_and_an_extras_dependency_only_lazily_where_it_is_used():
    """tests/ and TRL (a dev dependency) never; peft (the parity extra) only inside verify/'s functions."""
    wrong = sorted(f"{path.relative_to(PACKAGE)} imports {name}{'' if lazy else ' at module level'}"
                   for path in PACKAGE.rglob("*.py") for name, lazy in _outside_imports(path.read_text())
                   if name in ONLY_LAZILY_IN and not (lazy and _part(path) in ONLY_LAZILY_IN[name]))
    assert not wrong, wrong


def test_outside_imports_are_seen_at_module_level_and_inside_functions():
    text = "import peft.tuners\nfrom tests.support import helpers\ndef f():\n    from trl import DPOTrainer\n"
    assert _outside_imports(text) == [("peft", False), ("tests", False), ("trl", True)]


# Where the run's objective is chosen: the package of objectives, and their torch-free description.
CHOOSES_OBJECTIVES = ("objectives/", "config/objective_specs.py")
# A value compared with an objective's name: `stage == "dpo"`, `"dpo" != x`, `stage in (2, "dpo")`.
_OBJECTIVE_TEST = re.compile(r"""(==|!=)\s*["']dpo["']|["']dpo["']\s*(==|!=)|\bin\s*[(\[{][^)\]}]*["']dpo["']""")
_ONE_OBJECTIVE = ("megatron_ext.objectives.dpo", "megatron_ext.objectives.sft")


def _objective_tests(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if _OBJECTIVE_TEST.search(line)]


def _objectives_imported_by_name(text: str) -> list[str]:
    """The modules of one objective that `text` imports (`objectives.for_run` is the way in)."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [m for m in modules if m.startswith(_ONE_OBJECTIVE)]
    return found


def _outside_the_objectives() -> list[tuple[Path, str]]:
    return [(path, path.read_text()) for path in PACKAGE.rglob("*.py")
            if not path.relative_to(PACKAGE).as_posix().startswith(CHOOSES_OBJECTIVES)]


def test_only_the_objectives_compare_a_stage_with_an_objective():
    wrong = [f"{path.relative_to(PACKAGE)}: {line}" for path, text in _outside_the_objectives()
             for line in _objective_tests(text)]
    assert not wrong, wrong


def test_no_module_outside_the_objectives_imports_one_by_name():
    wrong = [f"{path.relative_to(PACKAGE)} imports {name}" for path, text in _outside_the_objectives()
             for name in _objectives_imported_by_name(text)]
    assert not wrong, wrong


def test_objective_tests_and_imports_are_seen_in_every_form():
    text = ('if cfg.stage == "dpo" or "dpo" != x:\n    pass\nok = stage not in (2, "dpo")\n'
            "from megatron_ext.objectives.dpo.loss import METRICS\nimport megatron_ext.objectives.sft\n"
            "from megatron_ext.objectives import sft, for_run\n")
    assert len(_objective_tests(text)) == 2
    assert _objectives_imported_by_name(text) == [
        "megatron_ext.objectives.dpo.loss", "megatron_ext.objectives.dpo.loss.METRICS", "megatron_ext.objectives.sft",
        "megatron_ext.objectives.sft"]
    assert _objective_tests('choices = ["1", "2", "dpo"]\nstage = "dpo" if pairs else 2\n') == []
