"""Bytes that autograd keeps for the backward pass of a forward, as PyTorch itself reports them.

`torch.autograd.graph.saved_tensors_hooks` sees every tensor an autograd node saves. Counted once
per underlying tensor (a view saved by one op and its base saved by another share memory), and
without parameters (they live on the GPU anyway: the memory plan counts them as parameters). On the
meta device the same hooks see the same shapes with no memory and no compute, so a forward there
measures what a real one keeps.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


class SavedBytes:
    """Collects the tensors saved inside `counting()`; `bytes` is their total size."""

    def __init__(self, parameters=()):
        self._parameters = {id(p) for p in parameters}
        self._seen: dict[int, object] = {}  # id -> tensor, kept alive so ids stay unique

    @contextlib.contextmanager
    def counting(self) -> Iterator["SavedBytes"]:
        import torch

        def pack(tensor):
            base = tensor._base if tensor._base is not None else tensor
            if id(base) not in self._parameters:
                self._seen[id(base)] = base
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield self

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._seen.values())


def saved_bytes(forward, parameters=()) -> int:
    """Bytes saved for backward while `forward()` runs, not counting `parameters`."""
    saved = SavedBytes(parameters)
    with saved.counting():
        forward()
    return saved.bytes
