"""Each transformer layer (language model and vision tower) compiled with torch.compile
(`--compile-layers`): without Transformer Engine a layer is some 50 small kernels in forward and 60
in backward, each launched from megatron-core's Python, and the step waits for the host; compiled,
its elementwise work is fused and its Python runs once per graph. A native-resolution tower's blocks
(transformers' modules) are compiled where they attend through varlen (`tower_attention.compilable_blocks`).

Dynamic shapes, so packed micro batches of any length reuse one graph. megatron-core's layer
traces whole once one lookup is made traceable: its row-parallel linear asks for the default
tensor-parallel group by passing None, and the lookup warns (`warnings.warn`, which torch.compile
cannot trace: a graph break in every layer); other warnings inside a layer are moved after its graph.
`compile_problems` says what is still left uncompiled.
"""

from __future__ import annotations

import logging
import sys
import warnings

import torch

log = logging.getLogger(__name__)
_TRACEABLE = False


def _traceable_tp_group_lookup() -> None:
    """megatron-core's tensor-parallel group lookup without its deprecation warning for None."""
    global _TRACEABLE
    if _TRACEABLE:
        return
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers

    lookup = layers.get_tensor_model_parallel_group_if_none

    def group_or_default(tp_group, is_expert=False, check_initialized=True):
        if tp_group is None and torch.distributed.is_initialized() and parallel_state.is_initialized():
            default = (parallel_state.get_expert_tensor_parallel_group if is_expert
                       else parallel_state.get_tensor_model_parallel_group)
            return default(check_initialized=check_initialized)
        return lookup(tp_group, is_expert, check_initialized)

    layers.get_tensor_model_parallel_group_if_none = group_or_default
    # megatron-core warns inside the layer where it cannot fuse a RoPE (mRoPE over micro batches of several
    # rows): said after the graph instead of breaking it.
    torch._dynamo.config.reorderable_logging_functions.add(warnings.warn)
    _TRACEABLE = True


def compile_layers(model: torch.nn.Module) -> int:
    """Compile every megatron-core TransformerLayer of `model` in place, and the tower blocks torch.compile
    traces whole; how many there are. Their linear layers call `compiled_linear.linear`, which takes the
    calls megatron-core's own function would break the graph at (fused weight gradients, TP > 1)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_ext.model import attention, compiled_linear, tower_attention

    _traceable_tp_group_lookup()
    compiled_linear.use()
    attention.prepare_for_compile()
    # Every layer (tower and language model) shares TransformerLayer.forward's code and so its recompile limit:
    # graphs with and without grad (a frozen tower), and per range of lengths that inductor picks kernels for.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    layers = [module for module in model.modules() if isinstance(module, TransformerLayer)]
    blocks = tower_attention.compilable_blocks(model)
    for layer in layers + blocks:
        layer.compile(dynamic=True)
    log.info("--compile-layers: %d megatron-core layers and %d blocks of a transformers vision tower", len(layers),
             len(blocks))
    return len(layers) + len(blocks)


def compile_problems() -> list[str]:
    """What torch.compile left uncompiled in this process so far: each reason a graph broke, with how often,
    and the frames it gave up on (past its recompile limit, or failing); empty: all compiled whole."""
    from torch._dynamo.utils import counters

    problems = [f"{reason} ({count}x)" for reason, count in counters["graph_break"].items()]
    if given_up := counters["frames"]["total"] - counters["frames"]["ok"]:
        problems.append(f"{given_up} frame(s) not compiled (e.g. past torch._dynamo's recompile limit)")
    return problems


def compile_failed(error: BaseException) -> bool:
    """Whether `error` is torch.compile failing to build what it traced. Looked up, not imported: a CPU process
    imports no TorchDynamo (`compat.lean_import`) unless something compiled, and only then can this fail."""
    dynamo_errors = sys.modules.get("torch._dynamo.exc")
    return dynamo_errors is not None and isinstance(error, dynamo_errors.BackendCompilerFailed)


def compile_failure(error: Exception, layers_compiled: bool) -> str:
    """One line for a compilation that failed (a missing C compiler, a Triton that cannot build its kernels):
    what failed, and how to train without it or see torch's whole report."""
    inner = getattr(error, "inner_exception", error)
    first = (str(inner).strip().splitlines() or [""])[0]
    instead = "train with --no-compile-layers for eager layers, or " if layers_compiled else ""
    return (f"torch.compile could not compile ({type(inner).__name__}: {first}); {instead}add --debug for its "
            "whole report")
