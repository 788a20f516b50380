"""torchao logs notes about its environment at import, in every process: each of its C++ extensions it
cannot load for this torch (mx formats, CUTLASS kernels), kernels it cannot offer without Triton; and
torch logs that torchao's way of registering its enums is deprecated. transformers imports torchao
whenever it is installed (the `fp8` extra), so every command would print these on every rank, and the
word "error" in torch's note reads as a failure in a job's log. Float8 training (`--fp8-backend
torchao`) needs none of those extensions or kernels. `install()` (at megatron_ext's import) keeps
torchao's loggers to errors and drops torch's note."""

from __future__ import annotations

import logging

_TORCH_NOTE = "Calling register_constant() on Enum subclasses is deprecated"


class _DropTorchNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _TORCH_NOTE not in record.getMessage()


def install() -> None:
    # Its modules log through children of "torchao" (torchao.kernel.intmm, ...), which inherit this level.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").addFilter(_DropTorchNote())
