"""The trainer (scripts/train/pretrain_llava.py) with megatron-core's checkpoint writer failing in its
Nth save (FAIL_SAVE=N): the writer writes the snapshot's files, then raises, as a full disk or a
dying file system would."""

import os
import runpy
from pathlib import Path

from megatron.core import dist_checkpointing

original_save = dist_checkpointing.save
calls = 0


def failing_save(state, path, *args, **kwargs):
    global calls
    calls += 1
    result = original_save(state, path, *args, **kwargs)
    if calls == int(os.environ["FAIL_SAVE"]):
        raise OSError(f"injected checkpoint writer failure in {path}")
    return result


if __name__ == "__main__":
    dist_checkpointing.save = failing_save
    runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts/train/pretrain_llava.py"), run_name="__main__")
