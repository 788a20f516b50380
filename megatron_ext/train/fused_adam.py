"""torch's AdamW as one fused kernel (`--fused-adam`) where megatron-core builds the foreach one.

Without Transformer Engine or Apex, megatron-core's optimizer is `torch.optim.AdamW` with torch's
default implementation, foreach: about a dozen multi-tensor kernels per step, each reading and
writing the fp32 parameters and moments again. `fused=True` does the update in one pass per
parameter group. torch takes the choice only at construction, which megatron-core makes without
it, and a checkpoint's load replaces the param groups' settings with those it was saved with; so
the choice is set on each param group before every step, with `step` moved to where that kernel
keeps it (fused: a float32 tensor beside its parameter; foreach: the host).
"""

from __future__ import annotations

import torch

from megatron_ext.errors import UserError


def torch_adams(optimizer) -> list[torch.optim.Adam]:
    """The torch Adam/AdamW optimizers inside megatron-core's (chained) optimizer."""
    found = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            found.append(inner)
    return found


def _check_params(adam: torch.optim.Optimizer) -> None:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    for group in adam.param_groups:
        for param in group["params"]:
            if param.device.type not in devices or not torch.is_floating_point(param):
                raise UserError(f"--fused-adam: torch's fused AdamW takes floating-point parameters on {', '.join(devices)}, "
                                f"not {param.dtype} on {param.device.type}; drop --fused-adam")


def _keep_choice(fused: bool):
    def before_step(adam: torch.optim.Optimizer, args, kwargs) -> None:
        for group in adam.param_groups:
            group["fused"], group["foreach"] = (True, False) if fused else (None, None)
            for param in group["params"]:
                state = adam.state.get(param)
                step = state.get("step") if state else None
                if step is None:
                    continue  # torch creates it at the first step, where the group's choice puts it
                where = param.device if fused or group.get("capturable") else torch.device("cpu")
                if step.device != where or step.dtype != torch.float32:
                    state["step"] = step.to(device=where, dtype=torch.float32)
    return before_step


def use(optimizer, fused: bool) -> int:
    """Run each torch Adam in megatron-core's `optimizer` fused (or as torch's default, foreach, when
    not `fused`), whatever a loaded checkpoint says; the number of torch Adams (0 with TE's or Apex's
    FusedAdam, fused already)."""
    adams = torch_adams(optimizer)
    for adam in adams:
        if fused:
            _check_params(adam)
        adam.register_step_pre_hook(_keep_choice(fused))
    return len(adams)
