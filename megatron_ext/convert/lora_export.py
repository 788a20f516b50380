"""Adapter checkpoints to Hugging Face: merged into the base weights, or as a PEFT adapter.

Both start from the trained tensors of an adapter snapshot, read whole (TP1 shapes) whatever
TP/PP it was saved with. Merging adds `scaling * B @ A` to each adapted Megatron weight before the
mapping table turns it into HF tensors. The PEFT adapter maps each Megatron adapter onto the HF
modules of the fused layer: A is shared (the fused layer's input is each HF module's input) and B
is split the way the weight's rows are (q/k/v, gate/up); a row-parallel layer maps to one module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_ext.checkpoint import layout
from megatron_ext.convert.mapping import hf_name_of, model_mapping
from megatron_ext.errors import UserError
from megatron_ext.fsutil import atomic_output_dir, check_output_dir
from megatron_ext.lora.checkpoint import verified_base
from megatron_ext.lora.layers import ADAPTER_SUFFIXES
from megatron_ext.lora.settings import saved_settings

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_A, _B = ADAPTER_SUFFIXES


@dataclass(frozen=True)
class TrainedTensors:
    """What a LoRA run trained, as whole Megatron tensors by canonical name."""

    snapshot: layout.Snapshot
    base: layout.Snapshot
    scaling: float
    adapters: dict[str, tuple[torch.Tensor, torch.Tensor]]  # adapted weight name -> (A, B)
    full: dict[str, torch.Tensor]  # tensors trained in full (the projector): they replace the base's

    def merged(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The base tensor `name` with the adapter merged in (or replaced by a fully trained one)."""
        if name in self.full:
            return self.full[name]
        if name not in self.adapters:
            return tensor
        a, b = self.adapters[name]
        return (tensor.double() + self.scaling * (b.double() @ a.double())).to(tensor.dtype)


def read_trained(snapshot: layout.Snapshot) -> TrainedTensors:
    from megatron_ext.convert.dist_read import SnapshotTensors

    options = snapshot.trainer_options
    # One read per tensor: a checkpoint key stacks a tensor of every layer, and one read fills one layer's.
    # A native-resolution model's projector is inside its encoder (`vision_model.`).
    trained = ("language_model.", "vision_projection.", "vision_model.")
    weights = SnapshotTensors(snapshot.path)
    tensors = {name: weights.read({name: spec})[name] for name, spec in weights.stored(trained).items()}
    adapters = {name[: -len(_A)] + ".weight": (tensors.pop(name), tensors.pop(name[: -len(_A)] + _B))
                for name in list(tensors) if name.endswith(_A)}
    return TrainedTensors(snapshot=snapshot, base=verified_base(snapshot), scaling=saved_settings(options).scaling,
                          adapters=adapters, full=tensors)


def adapter_snapshot(megatron_dir, flag: str = "--megatron-dir") -> layout.Snapshot:
    snapshot = layout.find_snapshot(megatron_dir, flag)
    if snapshot.lora_base is None:
        raise UserError(f"{flag} {snapshot.path} holds no LoRA adapters (it was not saved by a --lora-rank run)")
    return snapshot


def hf_module_names(hf_config: dict) -> dict[str, str]:
    """Canonical HF weight name -> the name of that module in a transformers model (what PEFT uses)."""
    from megatron_ext.convert.hf_checkpoint import meta_hf_model
    from megatron_ext.families import read_model

    spell = hf_name_of(read_model(hf_config))
    return {spell(name): name[: -len(".weight")] for name, _ in meta_hf_model(hf_config).named_parameters()
            if name.endswith(".weight")}


def peft_modules(row, modules: dict[str, str], a: torch.Tensor, b: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The HF modules (transformers' names) one Megatron adapter (`row`: its weight's mapping row) maps
    onto, each with its (A, B): A is every module's, B is split as the weight's rows are."""
    parts = row.rule.megatron_to_hf(b) if len(row.hf) > 1 else [b]
    return [(modules[hf_name], a, b_part) for hf_name, b_part in zip(row.hf, parts)]


def write_peft_adapter(megatron_dir, adapter_dir, force: bool = False) -> Path:
    """A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for the HF export of the
    base checkpoint; with --lora-train-projector the projector travels as a module to save."""
    from safetensors.torch import save_file

    snapshot = adapter_snapshot(megatron_dir)
    out = check_output_dir(adapter_dir, force, "--lora-adapter-dir")
    trained = read_trained(snapshot)
    arch, options = snapshot.arch, snapshot.trainer_options
    table = model_mapping(arch)
    modules = hf_module_names(snapshot.hf_config)
    weights, targets = {}, set()
    for name, (a, b) in trained.adapters.items():
        for module, a, b_part in peft_modules(table[name], modules, a, b):
            weights[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.clone()  # safetensors stores no shared memory
            weights[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b_part.clone()
            targets.add(module)
    saved_modules = set()
    for name, tensor in trained.full.items():
        (hf_name,), (hf_tensor,) = table[name].hf, table[name].rule.megatron_to_hf(tensor)
        module_weight = modules[hf_name] if hf_name.endswith(".weight") else modules[hf_name[: -len(".bias")] + ".weight"]
        suffix = hf_name.rsplit(".", 1)[1]
        weights[f"{PEFT_PREFIX}{module_weight}.{suffix}"] = hf_tensor.contiguous()
        saved_modules.add(module_weight.rsplit(".", 1)[0])
    # A module inside another one saved is saved with it (Qwen2.5-VL's merger.mlp in its merger): PEFT
    # refuses nested modules to save.
    saved_modules = {m for m in saved_modules if not any(m.startswith(outer + ".") for outer in saved_modules)}
    config = {
        "peft_type": "LORA",
        "r": options["lora_rank"],
        "lora_alpha": options["lora_alpha"],
        "lora_dropout": options["lora_dropout"],
        # Exact module names: a pattern could also catch the vision tower's layers of the same name.
        "target_modules": sorted(targets),
        "modules_to_save": sorted(saved_modules) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "task_type": None,
        "inference_mode": True,
        "base_model_name_or_path": None,
    }
    with atomic_output_dir(out) as tmp:
        save_file(weights, str(tmp / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out
