"""Model weights in and out of a snapshot directory (megatron-core dist_checkpointing, torch_dist).

Every snapshot stores the model under `MODEL_KEY`: `{"model": model.sharded_state_dict(), ...}`;
the trainer adds its optimizer and other keys beside it. Tensors are stored by global name and
shape, so any TP/PP layout loads any other. The converters, the trainer and evaluation all go
through these functions.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

MODEL_KEY = "model"
_EXTRA_STATE = "_extra_state"


def save_sharded(state: dict, snapshot_dir: str | Path, sharded_strategy=None) -> None:
    """Collective: a sharded state dict saved as torch_dist, readable by megatron-core 0.16 to 0.19
    (compat/releases.py). `sharded_strategy`: written in this process (in_process_save.py) unless given."""
    from megatron.core import dist_checkpointing

    from megatron_ext.checkpoint.in_process_save import InProcessSaveStrategy
    from megatron_ext.compat.releases import write_common_file

    Path(snapshot_dir).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(state, str(snapshot_dir), sharded_strategy=sharded_strategy or InProcessSaveStrategy())
    write_common_file(snapshot_dir)


def save_model_weights(model, snapshot_dir: str | Path, extra: dict | None = None, sharded_strategy=None,
                       select=None) -> None:
    """Collective: every rank of the world calls it. `extra`: more sharded entries (optimizer, ...).
    `sharded_strategy`: as `save_sharded`'s (the converter's computes its tensors).
    `select` (state-dict name -> bool): only the tensors it selects (a LoRA run's trained ones)."""
    model_state = {name: entry for name, entry in model.sharded_state_dict().items() if select is None or select(name)}
    save_sharded({MODEL_KEY: model_state, **(extra or {})}, snapshot_dir, sharded_strategy)


def _stored_keys(snapshot_dir: Path) -> set[str]:
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    return set(load_sharded_metadata(str(snapshot_dir)))


def load_model_weights(model, snapshot_dir: str | Path, select=None) -> None:
    """Load this rank's part of every model tensor from a snapshot, whatever TP/PP it was saved with;
    with `select` (state-dict name -> bool), only the tensors it selects (e.g. a LoRA model's base).

    Collective. Keys the snapshot holds beside the model (optimizer, trainer state) are ignored.
    `_extra_state` entries the snapshot lacks are skipped (e.g. Transformer Engine's FP8 scaling
    history when the snapshot was written by a model of other layers: it starts afresh).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    stored = _stored_keys(Path(snapshot_dir))
    request, skipped = {}, []
    for name, entry in model.sharded_state_dict().items():
        if select is not None and not select(name):
            continue
        if name.endswith(_EXTRA_STATE) and isinstance(entry, ShardedObject) and entry.unique_key not in stored:
            skipped.append(name)
        else:
            request[name] = entry
    loaded = dist_checkpointing.load({MODEL_KEY: request}, str(snapshot_dir))[MODEL_KEY]
    result = model.load_state_dict({name: loaded[name] for name in request}, strict=False)
    missing = [name for name in result.missing_keys if name not in skipped and (select is None or select(name))]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"model weights from {snapshot_dir} do not fit the model: missing {missing}, "
                           f"unexpected {result.unexpected_keys}")
    if skipped:
        log.debug("snapshot %s has no %s for %d modules", snapshot_dir, _EXTRA_STATE, len(skipped))
