"""Import megatron-core for a process that never compiles a kernel nor logs to W&B.

megatron-core decorates its fused kernels with `torch.compile` when it is imported, which imports
TorchDynamo and Inductor, and it imports W&B for its inference logging; on this project's CPU
machines the two are most of megatron-core's import time (1.2 s instead of 6.5 s measured for
the converters' workers). A CPU process never runs those kernels (the fusions are GPU-only, see
model/provider.py), so `import_lean` imports modules with megatron-core's jit fuser made the
identity and W&B hidden; `torch.compile` and W&B are as they were afterwards, for anyone else.
"""

from __future__ import annotations

import contextlib
import importlib
import sys


def _identity_compile(model=None, **_options):
    return model if model is not None else _identity_compile


@contextlib.contextmanager
def _no_compile_no_wandb():
    import torch

    compile_fn, had_wandb = torch.compile, "wandb" in sys.modules
    torch.compile = _identity_compile
    if not had_wandb:
        sys.modules["wandb"] = None  # `import wandb` raises ImportError: megatron-core goes without
    try:
        yield
    finally:
        torch.compile = compile_fn
        if not had_wandb:
            sys.modules.pop("wandb", None)


def import_lean(modules: list[str]) -> None:
    """Import `modules` (megatron-core, or modules importing it, not yet imported in this
    process); megatron-core's fused kernels then run uncompiled in this process."""
    if "megatron.core" in sys.modules:
        raise RuntimeError("import_lean must run before megatron-core is imported")
    with _no_compile_no_wandb():
        for name in modules:
            importlib.import_module(name)
    from megatron.core import jit

    jit.disable_jit_fuser()  # megatron-core's own switch, so its state says what the import did
