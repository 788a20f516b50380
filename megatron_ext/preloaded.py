"""A process that has imported the commands' libraries once, so that the processes it forks start with them.

A fresh `python -m megatron_ext.commands...` first imports torch, megatron-core, transformers and
energon, 5-10 s of CPU before it does anything. A process that has imported them (`preload`) forks
commands instead (`launch/forked.py`: the demo's steps on a CPU machine, the tests' prestarted
jobs), and a command forked so forks its converter and parity ranks directly (`convert/cpu_ranks.py`).
Only a process without CUDA preloads (`can_fork`): CUDA does not survive a fork, and megatron-core
is imported as a CPU process imports it (`compat/lean_import.py`).
"""

from __future__ import annotations

# What the commands import first; a fork finds them imported.
PRELOAD = ("torch", "megatron.core.models.multimodal.llava_model", "megatron.core.optimizer",
           "megatron.core.distributed", "megatron.core.dist_checkpointing", "megatron.energon",
           "transformers", "transformers.image_processing_utils", "transformers.tokenization_utils_fast",
           "safetensors.torch", "tokenizers", "PIL.Image", "numpy")

# Whether this process, or the one it was forked from, ran `preload`: it holds PRELOAD, and no CUDA.
loaded = False


def can_fork() -> bool:
    """No CUDA here (asking initialises CUDA where there is one; this process then never forks)."""
    import torch

    return not torch.cuda.is_available()


def preload() -> None:
    """Import PRELOAD, megatron-core as a CPU process does; the caller checks `can_fork` first."""
    import importlib

    from megatron_ext.compat.lean_import import import_lean

    global loaded
    import_lean()
    for name in PRELOAD:
        importlib.import_module(name)
    loaded = True
