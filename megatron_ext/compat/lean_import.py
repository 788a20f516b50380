"""Import megatron-core for a CPU process: without compiling its fused kernels, without its W&B.

megatron-core decorates its fused kernels with `torch.compile` when it is imported, which imports
TorchDynamo and Inductor, and it imports W&B for its inference logging; on this project's CPU
machines the two are most of megatron-core's import time (1.2 s instead of 6.5 s measured for
the converters' workers). A CPU process never runs those kernels (the fusions are GPU-only, see
model/provider.py), so `import_lean` imports megatron-core with its jit fuser made the identity
and W&B hidden from it; `torch.compile` and W&B are as they were afterwards, for anyone else
(the trainer's own W&B logging included). Used where a process without CUDA first needs
megatron-core: `distributed.init_parallel` and the converters' fork server.
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


def import_lean(modules: list[str] = ()) -> None:
    """Import megatron-core, then `modules`; megatron-core's fused kernels then run uncompiled in
    this process, whatever imports them later. Does nothing where megatron-core is imported already."""
    if "megatron.core" in sys.modules:
        return
    with _no_compile_no_wandb():
        from megatron.core import jit

        jit.disable_jit_fuser()  # megatron-core's own switch, for modules it imports later
        for name in modules:
            importlib.import_module(name)
