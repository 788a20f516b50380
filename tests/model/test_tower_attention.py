"""model/tower_attention.py: --vision-attention varlen runs each layer of a Qwen-VL tower as one
attention call over all its images (or windows), with the features of transformers' own sdpa tower.
On the CPU that call is the masked SDPA one; the flash one runs here on the GPU rehearsal's stand-in
for torch's `varlen_attn`, which checks the kernel's contract (tests/gpu compares its numbers)."""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_ext.model import attention, tower_attention
from megatron_ext.model.tower_inputs import tower_kwargs
from tests.model.test_tower_inputs import FAMILIES, features, tower_and_inputs
from tests.train.gpu_rehearsal import rehearsed_varlen_attn


def _tower(name: str, dtype=torch.float32):
    """(a tiny tower, what it computes from a grid, the grids, pixels) of family `name`."""
    tower, family_inputs, grid, pixels = tower_and_inputs(name, dtype)
    return tower, functools.partial(family_inputs, tower), grid, pixels


@pytest.mark.parametrize("name", FAMILIES)
def test_a_varlen_tower_gives_the_features_of_transformers_sdpa_tower(name):
    tower, compute, grid, pixels = _tower(name)
    theirs = features(tower, pixels, grid)
    tower_attention.use(tower, "varlen")
    own = features(tower, pixels, grid)
    given = features(tower, pixels, grid, **tower_kwargs(compute, grid, lambda t: t, flash=True))
    for a, b in zip(own, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(given, own))


@pytest.mark.parametrize("name", FAMILIES)
def test_on_a_gpu_each_tower_layer_is_one_varlen_call_within_its_contract(name, monkeypatch):
    """bf16 as on a GPU; the stand-in refuses host boundaries, tensor maxima, and a bound below the
    longest sequence (the windows' maximum given for the whole images, say)."""
    reference, _, grid, pixels = _tower(name)
    exact = features(reference, pixels, grid)  # fp32, transformers' sdpa
    tower, compute, grid, pixels = _tower(name, torch.bfloat16)
    calls = []

    @functools.wraps(rehearsed_varlen_attn)  # its keywords are read off its signature
    def counted(*args, **kwargs):
        calls.append(1)
        return rehearsed_varlen_attn(*args, **kwargs)

    monkeypatch.setattr(tower_attention, "varlen_serves", lambda t: True)
    monkeypatch.setattr(attention, "varlen_attn", counted)
    tower_attention.use(tower, "varlen")
    ours = features(tower, pixels, grid, **tower_kwargs(compute, grid, lambda t: t, flash=True))
    assert len(calls) == len(tower.blocks)
    # bf16's rounding: transformers' own bf16 tower is 0.6-0.8% off the fp32 features here.
    assert all((a.float() - b).norm() <= 0.02 * b.norm() for a, b in zip(ours, exact, strict=True))


def test_qwen2_5_vl_windowed_layers_attend_within_their_windows():
    """The same boundaries in every layer (window attention over whole images, or the reverse) change
    the features: the windowed and full layers each get their own."""
    tower, compute, grid, pixels = _tower("qwen2_5_vl")
    tower_attention.use(tower, "varlen")
    values = tower_kwargs(compute, grid, lambda t: t, flash=True)
    right = features(tower, pixels, grid, **values)
    whole = {**values, "cu_window_seqlens": values["cu_seqlens"], "max_window_seqlen": values["max_seqlen"]}
    assert not torch.equal(features(tower, pixels, grid, **whole)[0], right[0])


def test_an_unknown_vision_attention_is_refused():
    tower, *_ = _tower("qwen3_vl")
    with pytest.raises(ValueError, match="'flash' is not one of"):
        tower_attention.use(tower, "flash")
    assert tower_attention.use(tower, "sdpa").config._attn_implementation == "sdpa"


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("vision", tower_attention.CHOICES)
def test_compiled_layers_take_a_towers_blocks_where_they_attend_through_varlen(name, vision):
    """Under sdpa a block splits by image at lengths read from the data (a graph break in each: left eager)."""
    tower = tower_attention.use(_tower(name)[0], vision)
    blocks = tower_attention.compilable_blocks(torch.nn.ModuleDict({"vision_model": tower}))
    assert blocks == (list(tower.blocks) if vision == "varlen" else [])


@pytest.mark.parametrize("name", FAMILIES)
def test_compiled_each_tower_block_is_one_graph_on_a_gpus_flash_path(name, monkeypatch):
    """Each block as `compile_layers` compiles it, called with the arguments the tower gives it (its
    boundaries and their maxima from the host), on `meta` in bf16: torch's own `varlen_attn` on the
    GPU's path, whose contract `test_on_a_gpu_each_tower_layer...` checks."""
    from torch._dynamo.utils import counters

    tower, compute, grid, pixels = _tower(name, torch.bfloat16)
    tower_attention.use(tower, "varlen")
    calls = []
    tower.blocks[0].register_forward_pre_hook(lambda _, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    monkeypatch.setattr(tower_attention, "varlen_serves", lambda t: True)
    monkeypatch.setattr(attention, "varlen_attn", rehearsed_varlen_attn)
    features(tower, pixels, grid, **tower_kwargs(compute, grid, lambda t: t, flash=True))
    monkeypatch.setattr(attention, "varlen_attn", None)  # torch's own, imported as in a fresh process
    with monkeypatch.context() as cuda:
        cuda.setattr(torch.cuda, "is_available", lambda: True)  # where prepare_for_compile probes (meta stands in)
        attention.prepare_for_compile()
    meta = lambda value: value.to("meta") if isinstance(value, torch.Tensor) else value  # noqa: E731
    args, kwargs = torch.utils._pytree.tree_map(meta, calls[0])
    block = tower.blocks[0].to("meta")
    torch._dynamo.reset()
    counters.clear()
    block.compile(dynamic=True, fullgraph=True, backend="eager")
    with torch.no_grad():
        out = block(*args, **kwargs)
    assert out.shape == args[0].shape and out.is_meta
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
