"""Where megatron-core 0.16 breaks for want of Transformer Engine and Apex, on a GPU as on a CPU.

Our attention backend `sdpa` runs on torch alone, so a GPU machine without TE (a plain pip install)
builds the same megatron-core modules a CPU does. Two failures there are not about CUDA at all, and
were first fixed in `cpu_support` (CPU only), where a GPU run never saw the fix: a GPU run without
TE crashed building the vision tower (found on an H100). `apply()` runs before every model build
(`model.provider.build_model`), on any device; each patch does nothing where TE/Apex is present.

1. Norms: CLIPViTModel defaults `ln_pre_impl`/`ln_post_impl` to `torch.nn.LayerNorm` and passes
   `config=` to it -> TypeError. LLaVAModel cannot pass other implementations, so the defaults
   become megatron's `WrappedTorchNorm`.
2. Distributed optimizer on torch Adam: `sharded_state_dict(is_loading=True)` on a fresh optimizer
   reads the `step` of every parameter, which does not exist before the first update ->
   `assert len(steps) == 1`. The state (zeros, step 0) is created first, as the optimizer's own
   `init_state_fn` does for the non-distributed optimizers. Loading then copies every state of
   torch Adam, including `step`, which the checkpoint keeps separately -> `KeyError: 'step'`; `step`
   is left as the param-group load set it, one tensor per parameter (the load shares one tensor
   among all, and Adam's in-place increment would then count N times).
3. Gradient norm: without Apex's multi-tensor kernel, `clip_grads` takes `local_multi_tensor_l2_norm`,
   which builds a host tensor from every parameter's norm: one device -> host read per trained
   tensor per step (102 for the ~1B LLaVA on an H200, `bench/gpu_profile.py --find-syncs`). The same
   norm stays on the device here (`_foreach_norm`, one stacked norm); megatron-core reads the total
   once afterwards, as it does with Apex.
4. Multi-tensor scale: without Apex, `local_multi_tensor_scale` launches a multiply and a copy per
   tensor, for the clipping of every gradient and the copy of every fp32 main parameter into the
   model's bf16 one after each step (~400 launches per step for the ~1B LLaVA, whose step is
   host-bound without TE). `scale_as_foreach` does the same in place (`_foreach_mul_`) or as a copy
   (`_foreach_copy_`) in a few launches, with no temporary copy of all the tensors; other calls keep
   megatron-core's loop.
5. Gradient accumulation fusion: megatron-core's linear layers refuse it without Apex's
   `fused_weight_gradient_mlp_cuda`; `wgrad_accumulation` offers the same functions on torch's GEMMs.
"""

from __future__ import annotations

import torch

from megatron_ext.compat import wgrad_accumulation
from megatron_ext.compat.cpu_support import check_megatron_core

_APPLIED = False
# The private megatron-core names the patches read or replace (as cpu_support._MEGATRON_NAMES).
_MEGATRON_NAMES = {
    "megatron.core.models.vision.clip_vit_model": (
        "NORM_IMPL",
        "CLIPViTModel.__init__(ln_pre_impl)",
        "CLIPViTModel.__init__(ln_post_impl)",
    ),
    "megatron.core.transformer.torch_norm": ("WrappedTorchNorm",),
    "megatron.core.optimizer.clip_grads": ("l2_norm_impl", "multi_tensor_scale_impl"),
    "megatron.core.tensor_parallel.layers": ("_grad_accum_fusion_available",),
    "megatron.core.utils": ("local_multi_tensor_l2_norm", "local_multi_tensor_scale"),
    "megatron.core.optimizer.optimizer": ("multi_tensor_scale_impl",),
    "megatron.core.optimizer.distrib_optimizer": (
        "HAVE_APEX_OR_TE",
        "DistributedOptimizer.sharded_state_dict",
        "DistributedOptimizer._set_main_param_and_optimizer_states",
    ),
}


def _patch_vision_norm_defaults() -> None:
    from megatron.core.models.vision import clip_vit_model
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if clip_vit_model.NORM_IMPL is torch.nn.LayerNorm:
        defaults = list(clip_vit_model.CLIPViTModel.__init__.__defaults__)
        defaults = [WrappedTorchNorm if d is torch.nn.LayerNorm else d for d in defaults]
        clip_vit_model.CLIPViTModel.__init__.__defaults__ = tuple(defaults)


def _patch_distributed_optimizer_loading() -> None:
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    original = distrib_optimizer.DistributedOptimizer.sharded_state_dict

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, **kwargs):
        if is_loading and not self.optimizer.state:
            self.init_state_fn(self.optimizer, self.config)
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    self.optimizer.state[param]["step"] = torch.tensor(0.0)
        return original(self, model_sharded_state_dict or {}, is_loading=is_loading, **kwargs)

    set_states = distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states

    def set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state.get(main_param, {})
            if "step" in state:
                # The param-group load gave every parameter the same step tensor, which torch Adam
                # would then increment once per parameter: give each its own.
                state["step"] = state["step"].clone()
                tensors = {**tensors, "step": state["step"]}
        return set_states(self, model_param, tensors)

    distrib_optimizer.DistributedOptimizer.sharded_state_dict = sharded_state_dict
    distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states


def l2_norm_on_device(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """`local_multi_tensor_l2_norm`'s result ([1] float32: the L2 norm of all the tensors) computed
    where the tensors are, with nothing read back."""
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    norms = torch.stack(torch._foreach_norm(tensors)).float()
    return torch.linalg.vector_norm(norms).reshape(1), None


def scale_as_foreach(chunk_size, noop_flag, tensor_lists, scale):
    """`local_multi_tensor_scale` (each target = source * scale): in place or, at scale 1, a copy, as
    foreach kernels; otherwise megatron-core's own loop."""
    from megatron.core.utils import local_multi_tensor_scale

    sources, targets = tensor_lists[0], tensor_lists[1]
    if all(s is t for s, t in zip(sources, targets)):
        torch._foreach_mul_(targets, scale)
    elif scale == 1.0:
        torch._foreach_copy_(targets, sources)
    else:
        local_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale)


def _patch_multi_tensor_scale() -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = scale_as_foreach


def _patch_grad_norm() -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = l2_norm_on_device


def apply() -> None:
    """The patches, once per process (idempotent); UserError, nothing patched, when the installed
    megatron-core lacks a name they need."""
    global _APPLIED
    if _APPLIED:
        return
    check_megatron_core(_MEGATRON_NAMES, "no-Transformer-Engine")
    _patch_vision_norm_defaults()
    _patch_distributed_optimizer_loading()
    _patch_grad_norm()
    _patch_multi_tensor_scale()
    wgrad_accumulation.install()
    _APPLIED = True
