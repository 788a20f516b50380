"""megatron-core's refusals while it builds a model, as one line naming the settings and their values.

megatron-core checks what it is given with asserts deep inside its constructors, most without a
message (`assert self.img_h % self.patch_dim == 0` in CLIPViTModel), and with ValueErrors in its own
terms (TransformerConfig's `num_query_groups`): a run would end in a long traceback and a bare
`AssertionError`. What users set is checked before anything starts (`LlavaArch.parallel_problems`,
`config/execution_choices.py`); whatever still reaches megatron-core is put into words here: the check that
failed, where, and the value of every name in it, with the config.json field or flag that sets it.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import textwrap

from megatron_ext.errors import UserError

# Where the user sets what megatron-core calls by these names (the last part of a name in a check).
SETTINGS = {
    "img_h": "config.json vision_config.image_size",
    "img_w": "config.json vision_config.image_size",
    "patch_dim": "config.json vision_config.patch_size",
    "num_attention_heads": "config.json num_attention_heads",
    "num_query_groups": "config.json num_key_value_heads",
    "ffn_hidden_size": "config.json intermediate_size",
    "kv_channels": "config.json head_dim",
    "hidden_size": "config.json hidden_size",
    "num_layers": "config.json num_hidden_layers",
    "tensor_model_parallel_size": "--tp",
    "world_size": "--tp",  # megatron-core's layers split over the tensor-parallel group
    "pipeline_model_parallel_size": "--pp",
    "context_parallel_size": "--cp",
    "sequence_parallel": "--sequence-parallel",
}
_MEGATRON = "megatron/core/"
_HELPERS = "megatron/core/utils.py"  # divide() / ensure_divisibility(): the caller's line says what is divided


@contextlib.contextmanager
def megatron_refusals():
    """Wrap the building of a model (its TransformerConfigs and modules): an AssertionError or ValueError
    raised by megatron-core itself becomes one UserError line; anything else propagates as it is."""
    try:
        yield
    except (AssertionError, ValueError) as exc:
        line = describe(exc)
        if line is None:
            raise
        raise UserError(line) from exc


def describe(exc: BaseException) -> str | None:
    """The line for megatron-core's refusal `exc`, or None when it was not raised by megatron-core's own code."""
    frames = [(tb.tb_frame, tb.tb_lineno) for tb in _walk(exc.__traceback__)]
    if not frames or _MEGATRON not in frames[-1][0].f_code.co_filename:
        return None
    frame, lineno = next(((f, n) for f, n in reversed(frames)
                          if _MEGATRON in f.f_code.co_filename and not f.f_code.co_filename.endswith(_HELPERS)),
                         frames[-1])
    found = _statement(frame, lineno)
    if found is None:
        return None
    check, expressions = found
    path = frame.f_code.co_filename
    where = f"{path[path.rindex(_MEGATRON):]}:{lineno}"
    values = [_setting(name, value) for name, value in _values(expressions, frame.f_locals)]
    said = f": {' '.join(str(exc).split())}" if str(exc) else ""
    return (f"megatron-core cannot build this model: {check}{said} ({where})"
            + (f", where {', '.join(values)}; change them in config.json or on the command line" if values else ""))


def _walk(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _statement(frame, lineno: int) -> tuple[str, list[ast.expr]] | None:
    """(the failed check in words, its expressions) for the statement at `lineno` of `frame`'s function."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(frame.f_code)))
    except (OSError, TypeError, SyntaxError):  # no source, or not a whole statement (a lambda's line)
        return None
    offset = frame.f_code.co_firstlineno - 1
    conditions, stmt = [], None
    for node, ifs in _statements(tree.body, []):
        if node.lineno + offset <= lineno <= node.end_lineno + offset:
            stmt, conditions = node, ifs  # later ones are nested deeper
    if stmt is None:
        return None
    if isinstance(stmt, ast.Assert):
        return f"it requires `{ast.unparse(stmt.test)}`", [stmt.test]
    if isinstance(stmt, ast.Raise):
        if not conditions:
            return "it refuses the settings", [stmt]
        return f"it refuses `{' and '.join(ast.unparse(c) for c in conditions)}`", conditions
    return f"`{ast.unparse(stmt)}` failed", [stmt]


def _statements(body: list[ast.stmt], ifs: list[ast.expr]):
    """Every statement in `body`, outer before inner, with the conditions of the `if`s that lead to it."""
    for stmt in body:
        yield stmt, ifs
        if isinstance(stmt, ast.If):
            yield from _statements(stmt.body, [*ifs, stmt.test])
            yield from _statements(stmt.orelse, [*ifs, ast.UnaryOp(ast.Not(), stmt.test)])
            continue
        for child in ast.iter_child_nodes(stmt):
            if isinstance(child, ast.stmt):
                yield from _statements([child], ifs)
            elif isinstance(child, (ast.excepthandler, ast.match_case)):
                yield from _statements(child.body, ifs)


def _values(expressions: list[ast.expr], scope: dict) -> list[tuple[str, object]]:
    """(name, value) of each plain name or attribute chain in `expressions` with a scalar value."""
    seen = {}
    for expression in expressions:
        for node in ast.walk(expression):
            if isinstance(node, (ast.Name, ast.Attribute)) and not isinstance(getattr(node, "ctx", None), ast.Store):
                name = ast.unparse(node)
                value = _lookup(node, scope)
                if name not in seen and isinstance(value, (bool, int, float, str)):
                    seen[name] = value
    return list(seen.items())


def _lookup(node: ast.expr, scope: dict):
    if isinstance(node, ast.Name):
        return scope.get(node.id)
    if isinstance(node, ast.Attribute):
        return getattr(_lookup(node.value, scope), node.attr, None)
    return None


def _setting(name: str, value) -> str:
    setting = SETTINGS.get(name.rsplit(".", 1)[-1])
    return f"{name} = {value!r}" + (f" ({setting})" if setting else "")
