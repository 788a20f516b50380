"""Adapter checkpoints: which tensors they hold, and the base checkpoint they apply to.

A LoRA run's snapshots hold only the tensors it trains (adapters, and the projector with
--lora-train-projector) and their optimizer state. Their metadata names the base checkpoint
(`lora_base`: path and fingerprint); loading one loads the base first, after checking that the
base is still the checkpoint the adapters were trained on.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from megatron_ext.checkpoint import layout
from megatron_ext.checkpoint.model_io import load_model_weights
from megatron_ext.errors import UserError

# The fingerprint reads this much of each file's start and end: enough to tell other weights
# apart without reading a 14 GB base again.
_SAMPLE_BYTES = 1 << 20


def fingerprint(snapshot_dir: Path) -> str:
    """Names, sizes and the first and last MiB of every file of a snapshot directory."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(snapshot_dir).iterdir() if p.is_file()):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            digest.update(f.read(_SAMPLE_BYTES))
            if size > 2 * _SAMPLE_BYTES:
                f.seek(size - _SAMPLE_BYTES)
                digest.update(f.read())
    return digest.hexdigest()


def base_record(source: layout.Snapshot) -> dict:
    """The `lora_base` entry of a LoRA run's snapshots, the run having started from (or resumed) `source`."""
    if source.lora_base is not None:
        return source.lora_base
    return {"path": str(source.path), "fingerprint": fingerprint(source.path)}


def verified_base(adapters: layout.Snapshot) -> layout.Snapshot:
    """The base checkpoint of an adapter snapshot, checked to be the one it was trained on."""
    record = adapters.lora_base
    path = Path(record["path"])
    if not path.is_dir():
        raise UserError(f"{adapters.path} holds LoRA adapters for the base checkpoint {path}, which does not exist; "
                        "put the base checkpoint back at that path")
    if fingerprint(path) != record["fingerprint"]:
        raise UserError(f"{adapters.path} holds LoRA adapters trained on another version of {path} (its files "
                        "changed since); load them with the base checkpoint they were trained on")
    return layout.find_snapshot(path, "the adapters' base checkpoint")


def trainable_names(model) -> set[str]:
    return {name for name, param in model.named_parameters() if param.requires_grad}


def load_snapshot_weights(model, snapshot: layout.Snapshot) -> None:
    """A snapshot's weights into this rank's model (collective). A whole checkpoint loads as is, into
    a LoRA model without the adapters (they start afresh); an adapter checkpoint loads its verified
    base, then the tensors it trained (the model's trainable ones)."""
    from megatron_ext.lora.layers import has_lora, is_adapter_key

    lora = has_lora(model)
    if snapshot.lora_base is None:
        load_model_weights(model, snapshot.path, select=(lambda name: not is_adapter_key(name)) if lora else None)
        return
    if not lora:
        raise UserError(f"{snapshot.path} holds LoRA adapters, not a whole model: train on with the --lora-* options "
                        "it was saved with (its run config), or merge them with convert_megatron_to_hf.py --lora-merge")
    trained = trainable_names(model)
    load_model_weights(model, verified_base(snapshot).path, select=lambda name: name not in trained)
    load_model_weights(model, snapshot.path, select=trained.__contains__)


def load_for_inference(model, snapshot: layout.Snapshot) -> None:
    """A freshly built model given a snapshot's weights (collective): an adapter checkpoint's adapters
    are added first (unmerged, the model its LoRA run trained), then its base and they are loaded."""
    from megatron_ext.lora.layers import add_lora
    from megatron_ext.lora.settings import saved_settings

    if snapshot.lora_base is not None:
        add_lora(model, saved_settings(snapshot.trainer_options), seed=0)
    load_snapshot_weights(model, snapshot)
