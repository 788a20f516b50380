"""Where the megatron-core releases we support differ (0.16 on Python 3.11 through 0.19 on Python 3.12),
bridged by detecting what the installed one does, never by comparing version numbers.

- 0.19's import runs `git rev-parse` in megatron-core's own folder unless NO_VCS_VERSION=1:
  a process per import, and a venv inside a git checkout reports the checkout's commit as
  megatron-core's version. `quiet_import` sets NO_VCS_VERSION=1 for this process and its children.
- 0.19's tensor_parallel/random.py imports torch.utils.cpp_extension, which logs "No CUDA runtime is
  found" where a CUDA build of torch runs without a GPU (PyPI's torch for Python 3.12 on a CPU
  machine). We compile no extension: `quiet_import` drops that one message.
- 0.19 gives a layer's MLP as `functools.partial(MLP.as_mlp_submodule, submodules=...)` where 0.16
  gives `ModuleSpec(module=MLP, submodules=...)`: `mlp_spec` builds the installed release's form,
  `mlp_submodules` reads either.
- 0.19 saves a checkpoint's common (non-tensor) state inside its .distcp files, 0.16 reads it from
  common.pt only (and 0.19 still reads common.pt): `write_common_file` writes it where the save did
  not, so each release loads what the other saved.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from pathlib import Path

# pyproject.toml's pin, which README's tested matrix explains: 0.16.1 is the newest release for Python
# 3.11, 0.19.2 (Python >= 3.12) the newest we test.
SUPPORTED = "megatron-core>=0.16,<0.20"
COMMON_FILE = "common.pt"  # megatron-core's COMMON_STATE_FNAME in every release


class _NoCudaRuntimeNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No CUDA runtime is found")


def quiet_import() -> None:
    """Before megatron-core is imported: no git call, no note about the CUDA runtime we do not use."""
    os.environ.setdefault("NO_VCS_VERSION", "1")
    logging.getLogger("torch.utils.cpp_extension").addFilter(_NoCudaRuntimeNote())


def mlp_spec(submodules):
    """A layer's MLP spec of `submodules` (MLPSubmodules) in the form the installed release builds."""
    from megatron.core.transformer.mlp import MLP

    if hasattr(MLP, "as_mlp_submodule"):  # 0.19 rewraps (and logs a warning) a ModuleSpec of MLP
        return functools.partial(MLP.as_mlp_submodule, submodules=submodules)
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=MLP, submodules=submodules)


def mlp_submodules(spec):
    """The MLPSubmodules of a layer spec's `mlp` entry, whichever form the release builds it in."""
    if isinstance(spec, functools.partial):
        return spec.keywords["submodules"]
    return spec.submodules


def write_common_file(snapshot_dir: str | Path) -> None:
    """After every rank's `dist_checkpointing.save` returned: on rank 0, common.pt where the release
    kept the common state inside the .distcp files."""
    import torch
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    path = Path(snapshot_dir) / COMMON_FILE
    if torch.distributed.get_rank() != 0 or path.exists():
        return
    with warnings.catch_warnings():  # torch's DCP on how megatron-core calls it (one process reading)
        warnings.simplefilter("ignore", UserWarning)
        common = load_common_state_dict(str(snapshot_dir))
    torch.save(common, path)
