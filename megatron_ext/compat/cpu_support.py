"""The one place that lets megatron-core run on a machine without CUDA.

megatron-core (0.16 to 0.19) assumes a GPU throughout. On a CPU-only torch each patch below works around
one measured failure, listed with it. `apply()` is a no-op when
CUDA is available, so GPU runs never touch any of this.

Patches, each with the failure it fixes:

1. Device redirection (`_CudaToCpuMode`, a TorchFunctionMode entered once per process):
   ~90 places ask for CUDA tensors (`.cuda()`, `device="cuda"`, `device=torch.cuda.current_device()`)
   -> "Torch not compiled with CUDA enabled". The mode rewrites CUDA device requests to CPU and
   makes `Tensor.cuda()` and `Tensor.pin_memory()` return the tensor. It also reports CPU float tensors' `type()` as
   `torch.cuda.*Tensor`, because clip_grads.py / optimizer.py assert on that string.
2. `torch.cuda` functions that have no CPU meaning (`current_device`, `synchronize`, `set_device`,
   streams, events, memory statistics): replaced with CPU-safe stand-ins so callers such as the
   torch_dist async writer, timers and pipeline p2p proceed.
3. RNG: `model_parallel_cuda_manual_seed` uses CUDA generators. `_CpuRNGStatesTracker` keeps
   named states of the CPU generator instead, and `_get/_set_cuda_rng_state` read/write the CPU
   generator. (Callers must still `torch.manual_seed(seed)`: on a CPU torch megatron never seeds
   the CPU generator.)
4. Backward passes that ask for CUDA: autograd runs custom backward functions outside the mode of
   patch 1 -> "Torch not compiled with CUDA enabled". megatron's `CheckpointFunction` (activation
   recomputation) re-runs the forward there (e.g. the causal mask of DotProductAttention), and its
   tensor-parallel linear allocates its placeholder weight gradient on `torch.cuda.current_device()`
   under gradient accumulation fusion. Both backward functions run under the mode.

Where megatron-core breaks for want of Transformer Engine/Apex rather than CUDA (norm defaults, the
distributed optimizer's torch Adam), the fix is `without_te`'s, applied on GPUs too.

Patches 3-4 use private megatron-core names (`_MEGATRON_NAMES`, the same in 0.16 to 0.19); `apply()` checks them all
before patching anything and refuses in one line, naming the installed version, when one is missing.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import os

import torch
from torch.overrides import TorchFunctionMode

from megatron_ext.compat import releases
from megatron_ext.errors import UserError

log = logging.getLogger(__name__)

_APPLIED = False
_MODE: TorchFunctionMode | None = None
# What `megatron_ext.distributed.device()` names without CUDA. A harness rehearsing a GPU run on the
# CPU (tests/train/gpu_rehearsal.py) sets it to the GPU a real run names; the requests for that
# device land on the CPU like every other CUDA request, and the harness tracks where tensors "are".
NAMED_DEVICE = torch.device("cpu")

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare integer is what torch.cuda.current_device() returns: CUDA ordinal semantics.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests to CPU for every torch call made while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            if name is not None:
                return name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func in (torch.Tensor.to, torch.Tensor.new_empty) or getattr(func, "__name__", "") == "to":
            args = tuple("cpu" if i > 0 and _is_cuda_device(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for torch.cuda.Stream / Event on CPU: everything is already synchronous."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


# Every megatron-core name patches 3-4 read or replace, by module. They are private and can change
# in any release, so `check_megatron_core` checks all of them before any patch is applied (a run
# never goes on half-patched). "A.b" is attribute b of A; "f(x)" is parameter x of f. Instance
# attributes the patched code uses (the tracker's `states_`/`seeds_`, the optimizer's
# `init_state_fn`/`model_param_group_index_map`) exist only once an object is built: not checked.
_MEGATRON_NAMES = {
    "megatron.core.tensor_parallel.random": (
        # patch 3 (RNG)
        "_get_cuda_rng_state",
        "_set_cuda_rng_state",
        "_CUDA_RNG_STATE_TRACKER",
        "_CUDA_RNG_STATE_TRACKER_INITIALIZED",
        "_MODEL_PARALLEL_RNG_TRACKER_NAME",
        "CudaRNGStatesTracker",
        # patch 4 (backward passes)
        "CheckpointFunction.backward",
    ),
    "megatron.core.tensor_parallel.layers": ("LinearWithGradAccumulationAndAsyncCommunication.backward",),
}


def _missing_megatron_names(wanted: dict[str, tuple[str, ...]] = _MEGATRON_NAMES) -> list[str]:
    missing = []
    for module_name, names in wanted.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        for name in names:
            path, _, parameter = name.partition("(")
            obj = module
            for part in path.split("."):
                if not hasattr(obj, part):
                    missing.append(f"{module_name}.{name}")
                    break
                obj = getattr(obj, part)
            else:
                if parameter and parameter.rstrip(")") not in inspect.signature(obj).parameters:
                    missing.append(f"{module_name}.{name}")
    return missing


def check_megatron_core(wanted: dict[str, tuple[str, ...]] = _MEGATRON_NAMES, patcher: str = "CPU support") -> None:
    """Refuse (UserError) unless every name in `wanted` (module -> names, as `_MEGATRON_NAMES`) exists
    in the installed megatron-core."""
    missing = _missing_megatron_names(wanted)
    if missing:
        import megatron.core

        # A release that lacks these names may lack `__version__` too: still say what to install.
        version = getattr(megatron.core, "__version__", "of unknown version")
        raise UserError(f"megatron-core {version} lacks {', '.join(missing)}, which megatron_ext's {patcher} "
                        f"patches: install {releases.SUPPORTED}, the releases it is written for")


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda *a, **k: None
    cuda.set_device = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _NullStream
    cuda.Event = _NullStream
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.max_memory_reserved = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    class _CpuRNGStatesTracker(mp_random.CudaRNGStatesTracker):
        """Named RNG states of the CPU generator, with the CUDA tracker's interface."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mp_random._CUDA_RNG_STATE_TRACKER = _CpuRNGStatesTracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _backward_on_cpu(function: type[torch.autograd.Function]) -> None:
    backward = function.backward

    def backward_on_cpu(ctx, *grads):
        # Where a harness runs backward under the modes again (the GPU rehearsal), one more on top
        # would rewrite CUDA requests before the modes beneath it see them.
        if any(isinstance(mode, _CudaToCpuMode) for mode in torch.overrides._get_current_function_mode_stack()):
            return backward(ctx, *grads)
        with _CudaToCpuMode():
            return backward(ctx, *grads)

    function.backward = staticmethod(backward_on_cpu)


def _patch_backwards() -> None:
    from megatron.core.tensor_parallel import layers
    from megatron.core.tensor_parallel import random as mp_random

    _backward_on_cpu(mp_random.CheckpointFunction)
    _backward_on_cpu(layers.LinearWithGradAccumulationAndAsyncCommunication)


def cpu_mode_active() -> bool:
    return _APPLIED


def apply() -> bool:
    """Make megatron-core usable without CUDA. Returns True when the patches are active.

    Idempotent; does nothing (and returns False) when CUDA is available. Raises UserError, with nothing patched, when
    the installed megatron-core lacks a name the patches need (`check_megatron_core`).
    """
    global _APPLIED, _MODE
    if _APPLIED:
        return True
    if torch.cuda.is_available():
        return False
    check_megatron_core()
    # One intra-op thread per process: two threads on a 2-core machine gave erratic 40x slower steps.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    _patch_torch_cuda()
    _patch_rng()
    _patch_backwards()
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _APPLIED = True
    log.info("CUDA not available: megatron-core runs on CPU through megatron_ext.compat.cpu_support")
    return True
