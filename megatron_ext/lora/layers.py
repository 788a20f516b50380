"""LoRA adapters around megatron-core's tensor-parallel linear layers (local and Transformer Engine).

`LoraLinear` wraps a column- or row-parallel layer and adds `scaling * B(A(dropout(x)))` to its
output. The adapter shards the way the wrapped weight does:
- column-parallel (output split): B is split along its output like the weight, A is replicated;
- row-parallel (input split): A is split along its input like the weight, B is replicated, and the
  rank-r partial products A_t x_t are summed over the TP group (reduce-scattered under sequence
  parallelism) the way the base layer sums its partial outputs.
A is drawn from the full-size matrix with a generator seeded by the layer's name, so every TP/PP
layout starts from the same adapters; B starts at zero, so training starts from the base model.

Checkpoint keys: the wrapped layer keeps its own (`...linear_qkv.weight`), the adapter adds
`...linear_qkv.lora_a.weight` and `...linear_qkv.lora_b.weight`, A as (rank, in) and B as
(out, rank) globally, as PEFT stores them.
"""

from __future__ import annotations

import contextlib
import math
import zlib

import torch

from megatron_ext.errors import UserError
from megatron_ext.lora.settings import TARGETS, LoraSettings

ADAPTER_SUFFIXES = (".lora_a.weight", ".lora_b.weight")
_BASE = "base."


def is_adapter_key(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def _parallel_kinds() -> dict[type, str]:
    """Layer class -> "column" / "row" / "fused-norm" (a norm inside the linear: not supported)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    kinds = {ColumnParallelLinear: "column", RowParallelLinear: "row"}
    try:
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelLinear,
            TELayerNormColumnParallelLinear,
            TERowParallelLinear,
        )
    except ImportError:
        return kinds
    kinds.update({TEColumnParallelLinear: "column", TERowParallelLinear: "row",
                  TELayerNormColumnParallelLinear: "fused-norm"})
    return kinds


def _full_lora_a(name: str, rank: int, in_features: int, seed: int) -> torch.Tensor:
    """A for the unsplit layer, the same at every TP size: kaiming-uniform as torch.nn.Linear (and PEFT)."""
    generator = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rank, in_features, generator=generator) * 2 - 1) * bound


class LoraLinear(torch.nn.Module):
    def __init__(self, base: torch.nn.Module, kind: str, settings: LoraSettings, name: str, seed: int,
                 gated: bool = False):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.base = base
        self.kind = kind
        self.gated = gated  # a gated-linear-unit fc1: [gate; up] rows
        self.scaling = settings.scaling
        self.dropout = torch.nn.Dropout(settings.dropout) if settings.dropout else torch.nn.Identity()
        self.sequence_parallel = bool(base.config.sequence_parallel)
        out_local, in_local = base.weight.shape
        # The checkpoint metadata needs the group too: without it a split adapter is described as
        # whole and a replicated one as written by every TP rank.
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        dtype = base.weight.dtype
        r = settings.rank
        if kind == "column":
            a = _full_lora_a(name, r, in_local, seed)
        else:
            a = _full_lora_a(name, r, in_local * tp, seed).chunk(tp, dim=1)[tp_rank]
        device = base.weight.device
        self.lora_a = torch.nn.Linear(in_local, r, bias=False, device=device, dtype=dtype)
        self.lora_b = torch.nn.Linear(r, out_local, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            self.lora_a.weight.copy_(a)
            self.lora_b.weight.zero_()
        split, split_dim = (self.lora_b.weight, 0) if kind == "column" else (self.lora_a.weight, 1)
        set_tensor_model_parallel_attributes(split, True, split_dim, 1)
        if self.sequence_parallel:
            # Replicated weights that see one sequence shard per rank: megatron all-reduces their
            # gradients over TP, as for the layer norms.
            replicated = self.lora_a.weight if kind == "column" else self.lora_b.weight
            replicated.sequence_parallel = True
        self.config = base.config
        self.enabled = True  # False: the base layer alone (`adapters_off`)

    def _adapter(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        h = self.lora_a(self.dropout(x))
        if self.kind == "column":
            # Every rank's B shard needs the whole rank-r activation; the backward sums their
            # contributions to it (the base layer does the same for its input). The group is passed:
            # looked up from None, megatron-core warns, which breaks a compiled layer's graph.
            h = (mappings.gather_from_sequence_parallel_region(h, group=self.tp_group) if self.sequence_parallel
                 else mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group))
        else:
            h = (mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group) if self.sequence_parallel
                 else mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group))
        return self.lora_b(h) * self.scaling

    def forward(self, x, *args, **kwargs):
        if not self.enabled:
            return self.base(x, *args, **kwargs)
        finish = getattr(self.base, "finish", None)
        if finish is None:
            output, bias = self.base(x, *args, **kwargs)
            return output + self._adapter(x), bias
        # The base normalises or scales its own output: the adapter's share joins its matmul's first.
        output, bias = self.base.linear_forward(x, *args, **kwargs)
        return finish(output + self._adapter(x), bias)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        # The wrapped layer's tensors keep their checkpoint keys; only the state-dict keys (what
        # load_state_dict matches) gain "base.".
        base = self.base.sharded_state_dict(prefix, sharded_offsets, metadata)
        entries = {prefix + _BASE + key[len(prefix):]: value for key, value in base.items()}
        axis = {"lora_b.weight": 0} if self.kind == "column" else {"lora_a.weight": 1}
        adapter = {"lora_a.weight": self.lora_a.weight, "lora_b.weight": self.lora_b.weight}
        entries.update(make_sharded_tensors_for_checkpoint(adapter, prefix, axis, sharded_offsets, tp_group=self.tp_group,
                                                           dp_cp_group=metadata["dp_cp_group"]))
        if self.gated:
            # A gated fc1 holds [gate shard; up shard] per rank: megatron's MLP stores such a weight
            # as [gate; up] globally, and B's rows follow the weight's. MLP only recognises its own
            # keys, which are renamed here, so the split is applied here.
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            singleton = metadata.get("singleton_local_shards", False)
            for key in (prefix + _BASE + "weight", prefix + _BASE + "bias", prefix + "lora_b.weight"):
                if key in entries:
                    entries[key] = apply_swiglu_sharded_factory(entries[key], sharded_offsets, singleton)
        return entries


def add_lora(model, settings: LoraSettings, seed: int) -> list[str]:
    """Wrap the targeted linear layers of this rank's language-model layers in place; freeze every
    other parameter except, with `train_projector`, the projector's. Returns the wrapped layers' names."""
    kinds = _parallel_kinds()
    for param in model.parameters():
        param.requires_grad = False
    if settings.train_projector:
        for param in _projector_parameters(model):
            param.requires_grad = True
    wrapped = []
    for layer in model.language_model.decoder.layers:
        # Global layer number, so a layer's adapters are the same whichever stage holds it.
        prefix = f"language_model.decoder.layers.{layer.layer_number - 1}."
        for target in settings.targets:
            parent_path, attr = TARGETS[target].rsplit(".", 1)
            parent = layer.get_submodule(parent_path)
            base = getattr(parent, attr)
            # A layer with a step on its output (model/output_step.py) is its linear class plus that step.
            kind = kinds.get(getattr(base, "wrapped_linear", type(base)))
            if kind is None or kind == "fused-norm":
                raise UserError(f"--lora-targets {target}: {type(base).__name__} is not supported (LoRA wraps column- "
                                "and row-parallel linear layers without a fused layer norm); use "
                                "--attention-backend sdpa, whose layers keep the norm separate")
            name = prefix + TARGETS[target]
            gated = target == "fc1" and layer.config.gated_linear_unit
            setattr(parent, attr, LoraLinear(base, kind, settings, name, seed, gated=gated))
            wrapped.append(name)
    return wrapped


def _projector_parameters(model) -> list:
    """LLaVA's projector, or the projection inside a native-resolution model's encoder (marked by
    `model.mrope_vlm`, which has no separate projector)."""
    if model.vision_projection is not None:
        return list(model.vision_projection.parameters())
    return [param for param in model.parameters() if getattr(param, "is_vision_projection", False)]


def has_lora(model) -> bool:
    return any(isinstance(module, LoraLinear) for module in model.modules())


@contextlib.contextmanager
def adapters_off(model):
    """The model without its adapters (the base it was trained from: DPO's reference policy)."""
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    for layer in layers:
        layer.enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.enabled = True
