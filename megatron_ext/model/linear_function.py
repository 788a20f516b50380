"""megatron-core's linear function (`linear_with_grad_accumulation_and_async_allreduce`), which its
linear layers look up by name at every call: the modules that take over some of its calls
(`compiled_linear`, `float8_linears`) replace it here, each passing on what it does not take to the
function it replaced."""

from __future__ import annotations

from collections.abc import Callable

NAME = "linear_with_grad_accumulation_and_async_allreduce"


def take_over(function: Callable, owner: str, also_needed: tuple[str, ...] = ()) -> Callable:
    """Have megatron-core's linear layers call `function` from now on; returns the function replaced.
    UserError, nothing changed, where the installed megatron-core lacks it (or `also_needed`)."""
    from megatron.core.tensor_parallel import layers

    from megatron_ext.compat.cpu_support import check_megatron_core

    check_megatron_core({"megatron.core.tensor_parallel.layers": (NAME, *also_needed)}, owner)
    previous = getattr(layers, NAME)
    # megatron-core's function reads and sets its warn-once flag through the name, so on its replacement.
    function.warned = getattr(previous, "warned", False)
    setattr(layers, NAME, function)
    return previous
