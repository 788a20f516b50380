"""The GPU rehearsal: real trainer iterations on the CPU in which every tensor is known to live on
the host or on the GPU a real run would use, and mixing the two fails as it does on a GPU.

    torchrun --nproc-per-node 1 tests/train/gpu_rehearsal.py SCRIPT ARGS...

runs SCRIPT (the trainer's scripts/train/pretrain_llava.py, a test worker) as `__main__` under the
rehearsal. With REHEARSAL_REPORT=PATH set, rank 0 writes there, at exit, how often each core attention
layer ran, how often an attention kernel did, and the sync ledger: every read of a device tensor's
values on the host (`.item()`, `.tolist()`, `bool()`/`int()`/`float()`, `nonzero`, boolean-mask
indexing, a copy to the host...), each a stall of the CPU until a GPU has caught up, by call site;
and the collectives made, by name.

Why not PyTorch's meta device: megatron-core's LLaVA preprocessing reads tensor values (split
sizes, the longest combined row), which meta tensors do not have. Here every tensor is a real CPU
tensor with real values, and `DeviceLedger` keeps where a GPU run would hold it:
- device: created for or moved to `cuda` (what `distributed.device()` names in the rehearsal, and
  every CUDA request of megatron-core), or computed from such a tensor. Its `.device` reads
  `cuda:0`, so code that allocates "beside" it does so on the device too.
- host: created without a device or on `cpu`, moved with `.cpu()`/`.to("cpu")`, handed out by the
  data loader, or computed from host tensors only.
An op given both (except a 0-dim host tensor in an elementwise op, which CUDA takes as a scalar;
not in `cat`/`stack`/`index_select`...) raises CUDA's error, as does a host tensor indexed with
device indices, `.numpy()` of a device tensor, and a collective given a host tensor over a group
that is NCCL on a GPU (every group but megatron-core's gloo ones; the group read by keyword or
position; megatron-core's import-time aliases of the collectives included). `nn.Parameter(t)`
keeps `t`'s place; `.device`, `is_cuda` and `get_device()` agree. Tensors of unknown origin
(numpy's) are neither.

Backward is watched whole. Custom autograd functions' backward (megatron-core's tensor-parallel
linears and their gradient all-reduces, vocab-parallel cross entropy, activation recomputation,
which reruns the forward) and megatron-core DDP's gradient hooks (the buckets' reduce or
reduce-scatter) run under the ledger, autograd's gradients in them counted as the device tensors a
GPU run makes them (torch's function modes do not reach into backward by themselves). Autograd's C++
backward functions, which run no Python, are checked at the dispatcher (`_BackwardKernels`): the
same rules, their reads recorded as "autograd (NodeName)".
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import json
import os
import runpy
import sys
import types
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

HOST, DEVICE = "host", "device"
_PLACE = "_rehearsal_place"
GPU = torch.device("cuda", 0)
# Calls that may take tensors from both sides: moves, copies, indexing with host indices, reads.
_CROSSING = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.copy_, torch.Tensor.pin_memory,
             torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.item, torch.Tensor.tolist,
             torch.Tensor.__repr__, torch.Tensor.__format__}


class DeviceMixError(RuntimeError):
    pass


# Ops in which CUDA refuses a 0-dim host tensor beside device ones (elementwise ops take it as a scalar;
# the fused optimizers' kernels read their `step` tensors on the device).
_NO_SCALARS = {torch.cat, torch.concat, torch.concatenate, torch.stack, torch.hstack, torch.vstack,
               torch.index_select, torch.Tensor.index_select, torch.gather, torch.Tensor.gather, torch.scatter,
               torch.Tensor.scatter, torch.Tensor.scatter_, torch.where, torch._fused_adam_, torch._fused_adamw_}


# Reads of a device tensor's values on the host: each waits for the GPU to finish all queued work.
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.equal,
          torch.allclose, torch.Tensor.__repr__, torch.Tensor.__format__, torch.masked_select, torch.unique}
_HERE = os.path.abspath(__file__)
_TORCH = os.path.dirname(torch.__file__)


def _call_site() -> str:
    """file:line (function) of the first frame outside torch and this module: who asked."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path != _HERE and not path.startswith(_TORCH) and not path.startswith("<"):
            parts = Path(path).parts
            for root in ("megatron_ext", "megatron", "tests", "scripts"):
                if root in parts:
                    path = "/".join(parts[parts.index(root):])
                    break
            return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "unknown"


def _is_read(func, args, kwargs) -> bool:
    """Whether this call reads a device tensor's values back to the host."""
    if func in _READS:
        return any(place(t) == DEVICE for t in _tensors(args))
    if func in (torch.Tensor.cpu, torch.Tensor.to) and place(args[0]) == DEVICE:
        return func is torch.Tensor.cpu or _move_target(args[0], args[1:], kwargs) == HOST
    if func is torch.Tensor.__getitem__:  # boolean-mask indexing: its size is the mask's count
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and place(i) == DEVICE for i in index)
    return False


def place(t: torch.Tensor) -> str | None:
    where = getattr(t, _PLACE, None)
    if where is None and isinstance(t, torch.Tensor) and type(t) not in (torch.Tensor, torch.nn.Parameter):
        # A wrapper subclass (torchao's float8 tensors) is made with its data's `.device`, which reads cuda:0
        # for a device tensor here: its own device says where its data is.
        with torch._C.DisableTorchFunction():
            return DEVICE if t.device.type == "cuda" else None
    return where


def mark(t: torch.Tensor, where: str | None) -> torch.Tensor:
    if where is not None:
        setattr(t, _PLACE, where)
    elif hasattr(t, _PLACE):
        delattr(t, _PLACE)
    return t


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _named_place(device) -> str | None:
    """host/device for a device argument as the code wrote it."""
    if isinstance(device, torch.device):
        device = device.type
    if isinstance(device, int) and not isinstance(device, bool):
        return DEVICE  # a CUDA ordinal, as torch.cuda.current_device() returns
    if isinstance(device, str):
        return DEVICE if device.startswith("cuda") else HOST if device == "cpu" else None
    return None


def _move_target(self: torch.Tensor, args, kwargs) -> str | None:
    """Where `Tensor.to(...)` sends `self`."""
    for arg in (*args, kwargs.get("device"), kwargs.get("other")):
        if isinstance(arg, torch.Tensor):
            return place(arg)
        if isinstance(arg, (torch.device, str, int)) and not isinstance(arg, bool):
            return _named_place(arg)
    return place(self)


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype}"


class DeviceLedger(TorchFunctionMode):
    """Tracks host/device for every tensor made through torch's Python API (see the module doc)."""

    on_call = None  # called with every function the ledger sees (REHEARSAL_REPORT's counts)

    def __init__(self):
        super().__init__()
        self.reads: dict[str, int] = {}  # device -> host reads by call site (the sync ledger)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.on_call is not None:
            self.on_call(func)
        if torch._C._current_autograd_node() is not None:
            # In backward: autograd's gradients of device tensors are device tensors.
            for t in (*_tensors(args), *_tensors(kwargs)):
                if place(t) is None:
                    mark(t, DEVICE)
        if _is_read(func, args, kwargs):
            site = _call_site()
            self.reads[site] = self.reads.get(site, 0) + 1
        if getattr(func, "__self__", None) is torch.Tensor.device:  # the `.device` property
            return GPU if place(args[0]) == DEVICE else func(*args)
        if getattr(func, "__self__", None) is torch.Tensor.is_cuda:
            return place(args[0]) == DEVICE or func(*args)
        if func is torch.Tensor.get_device:
            return 0 if place(args[0]) == DEVICE else func(*args)
        if getattr(func, "__name__", "") == "scaled_dot_product_attention":
            _check_kernel(args, kwargs)
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        if func is torch.Tensor.numpy and place(args[0]) == DEVICE:
            raise DeviceMixError("can't convert cuda:0 device type tensor to numpy (rehearsal): .cpu() it first")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            _check_indices(args[0], _tensors(args[1]))
        if func not in _CROSSING:
            self._check(func, inputs)
        _in_python_call[0] += 1  # the aten ops below are this call's: _BackwardKernels leaves them alone
        try:
            result = func(*args, **kwargs)
        finally:
            _in_python_call[0] -= 1
        if func in (torch.Tensor.item, torch.Tensor.tolist) or not isinstance(result, (torch.Tensor, list, tuple)):
            return result
        if func is torch.Tensor.to:
            where = _move_target(args[0], args[1:], kwargs)
        elif func is torch.Tensor.cuda:
            where = DEVICE
        elif func is torch.Tensor.cpu:
            where = HOST
        elif func in (torch.Tensor.copy_, torch.Tensor.__setitem__):
            where = place(args[0])
        elif "device" in kwargs:
            where = _named_place(kwargs["device"])
        elif not inputs:
            where = HOST  # a factory without a device: the host
        else:
            places = {place(t) for t in inputs}
            where = DEVICE if DEVICE in places else HOST if HOST in places else None
        moved = args and result is args[0] and isinstance(result, torch.Tensor) and place(result) != where
        if moved and not isinstance(result, torch.nn.Parameter):
            # The CPU "moves" a tensor by returning it: the object left behind keeps its place.
            result = result.view_as(result)
        for out in _tensors(result):
            mark(out, where)
        return result

    @staticmethod
    def _check(func, inputs, no_scalars=_NO_SCALARS) -> None:
        devices = [t for t in inputs if place(t) == DEVICE]
        hosts = [t for t in inputs if place(t) == HOST and (t.dim() > 0 or func in no_scalars)]
        if devices and hosts:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            raise DeviceMixError(
                f"Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
                f"(rehearsal: {name} got host tensor {_describe(hosts[0])} and device tensor {_describe(devices[0])})")


def _check_indices(indexed: torch.Tensor, indices) -> None:
    """CUDA's rule for indexing: indices on the host or beside the indexed tensor."""
    if place(indexed) == HOST and any(place(t) == DEVICE for t in indices):
        raise DeviceMixError("indices should be either on cpu or on the same device as the indexed tensor (cpu) "
                             "(rehearsal: a host tensor indexed with device indices)")


_in_python_call = [0]  # > 0 while DeviceLedger runs a call of torch's Python API
_aten = torch.ops.aten
# The aten ops of autograd's C++ backward functions that read a device tensor back (CUDA needs the
# values to size the output or to answer), and those that refuse a 0-dim host tensor beside device ones.
_ATEN_READS = {_aten._local_scalar_dense.default, _aten.nonzero.default, _aten.masked_select.default,
               _aten.masked_scatter_backward.default,  # its masked_select, one op at the dispatcher
               _aten.is_nonzero.default, _aten.equal.default, _aten._unique2.default, _aten.unique_dim.default,
               _aten.repeat_interleave.Tensor}
# Indexing: its indices (boolean ones are read back) may be host tensors into a device tensor.
_ATEN_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
                  _aten._index_put_impl_.default}
_ATEN_NO_SCALARS = {_aten.cat.default, _aten.stack.default, _aten.index_select.default, _aten.gather.default,
                    _aten.scatter.src, _aten.scatter_add.default, _aten.where.self}


class _BackwardKernels(TorchDispatchMode):
    """The aten ops that autograd's C++ backward functions run (MmBackward0, IndexBackward0, ...), which
    no function mode sees: the ledger's rules at the dispatcher. Gradients, whatever they meet with no
    place and what backward formulas create are device tensors, as on a GPU; a host tensor beside them
    fails; a read of a device tensor's values is a ledger read at "autograd (NodeName)". Ops that
    DeviceLedger handed down (the Python API's, Python backward functions' included) pass untouched."""

    def __init__(self, ledger: DeviceLedger):
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _in_python_call[0]:
            return func(*args, **kwargs)
        inputs = list(_tensors((args, kwargs)))
        for t in inputs:
            if place(t) is None:
                mark(t, DEVICE)
        node = torch._C._current_autograd_node()
        where_from = node.name() if node is not None else "autograd's engine"
        indices = [t for t in args[1] if t is not None] if func in _ATEN_INDEXING else []
        try:
            _check_indices(args[0], indices)
            # CUDA's index and index_put take host indices into a device tensor (IndexBackward0's).
            DeviceLedger._check(func, [t for t in inputs if not any(t is i for i in indices)], _ATEN_NO_SCALARS)
        except DeviceMixError as error:
            raise DeviceMixError(f"{error} in backward, {where_from}") from None
        bool_index = any(t.dtype == torch.bool and place(t) == DEVICE for t in indices)
        if (func in _ATEN_READS or bool_index) and any(place(t) == DEVICE for t in inputs):
            site = f"autograd ({where_from})"
            self.ledger.reads[site] = self.ledger.reads.get(site, 0) + 1
        result = func(*args, **kwargs)
        # A factory here (a backward formula's zeros) takes the options of a forward tensor: the device's.
        where = HOST if inputs and all(place(t) == HOST for t in inputs) else DEVICE
        for out in _tensors(result):
            mark(out, where)
        return result


# --- attention kernels ------------------------------------------------------------------------
class KernelError(RuntimeError):
    pass


def _math_limit() -> int:
    from megatron_ext.model.kernel_rules import MATH_KERNEL_LIMIT

    return int(os.environ.get("REHEARSAL_MATH_LIMIT", MATH_KERNEL_LIMIT))


def _check_kernel(args, kwargs) -> None:
    """An SDPA call that no kernel every GPU has would take (only the math kernel: fp32 scores of
    [b, heads, queries, keys]) fails, by CUDA's rules (`model/kernel_rules.py`), above the limit."""
    from megatron_ext.model.kernel_rules import PORTABLE, AttentionCall, fused_kernels, why_not

    def arg(name, index, default):
        return kwargs.get(name, args[index] if len(args) > index else default)

    call = AttentionCall.of(args[0], args[1], arg("attn_mask", 3, None), arg("is_causal", 5, False),
                            kwargs.get("enable_gqa", False))
    if call.keys > _math_limit() and not set(fused_kernels(call)) & set(PORTABLE):
        reasons = "; ".join(f"{k}: {', '.join(v)}" for k, v in why_not(call).items() if k in PORTABLE)
        raise KernelError(f"scaled_dot_product_attention would run the math kernel on a GPU (rehearsal: {call}; "
                          f"{reasons})")


def rehearsed_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                          window_size=(-1, -1), enable_gqa=False, **unsupported):
    """torch's `varlen_attn` (flash attention, CUDA only) as the rehearsal runs it: its argument
    contract checked as its CUDA kernel needs it (`kernel_rules.varlen_problems`), then the numbers
    from a CPU reference: one masked fp32 attention over the packed tokens."""
    from megatron_ext.model.kernel_rules import varlen_problems

    problems = varlen_problems(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, enable_gqa, window_size)
    problems += [f"{name} is not a varlen_attn argument" for name in unsupported]
    if not problems:
        problems += _bounds_below_longest(("max_q", max_q, cu_seq_q), ("max_k", max_k, cu_seq_k))
    if problems:
        raise KernelError("varlen_attn (rehearsal): " + "; ".join(problems))
    tokens = torch.arange(query.shape[0]).to(cu_seq_q)  # beside cu_seqlens, wherever the rehearsal holds them
    sample_q = torch.searchsorted(cu_seq_q[1:], tokens, right=True)
    sample_k = torch.searchsorted(cu_seq_k[1:], tokens[:key.shape[0]], right=True)
    position_q, position_k = tokens - cu_seq_q[sample_q], tokens[:key.shape[0]] - cu_seq_k[sample_k]
    offset = position_q[:, None] - position_k[None, :]  # how far each key lies before each query
    allowed = sample_q[:, None] == sample_k[None, :]
    left, right = window_size
    if left >= 0:
        allowed &= offset <= left
    if right >= 0:
        allowed &= offset >= -right
    q, k, v = (t.float().transpose(0, 1)[None] for t in (query, key, value))
    if enable_gqa:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    return out[0].transpose(0, 1).to(query.dtype)


def rehearsed_accumulate_on_cuda(main_grad, grad_output_t, total_input) -> None:
    """`wgrad_accumulation.accumulate_on_cuda` (CUDA's baddbmm with out_dtype, which the CPU lacks) as the
    rehearsal runs it: the contract of torch's `_baddbmm_out_dtype_cuda` checked (one dtype for both
    factors, bf16/fp16 into fp32; shapes that multiply into the buffer's), then the same sum in fp32."""
    problems = []
    if grad_output_t.dtype != total_input.dtype or grad_output_t.dtype not in (torch.bfloat16, torch.float16):
        problems.append(f"factors of {grad_output_t.dtype} and {total_input.dtype}: one half dtype needed")
    if main_grad.dtype != torch.float32:
        problems.append(f"a {main_grad.dtype} buffer: out_dtype float32 needs a float32 one")
    rows, inner = grad_output_t.shape
    if total_input.shape[0] != inner or tuple(main_grad.shape) != (rows, total_input.shape[1]):
        problems.append(f"{tuple(grad_output_t.shape)} @ {tuple(total_input.shape)} into {tuple(main_grad.shape)}")
    if problems:
        raise KernelError("baddbmm with out_dtype (rehearsal): " + "; ".join(problems))
    main_grad.addmm_(grad_output_t.float(), total_input.float())


def _bounds_below_longest(*bounds) -> list[str]:
    """The kernel tiles each sequence by max_q / max_k: a bound below the longest sequence leaves its end
    unattended, silently. Checked on the values (no GPU read: the ledger does not see this)."""
    problems = []
    with torch._C.DisableTorchFunction():
        for name, bound, cu in bounds:
            if bound < (longest := int((cu[1:] - cu[:-1]).max())):
                problems.append(f"{name} {bound} is less than the longest sequence ({longest})")
    return problems


# --- collectives ------------------------------------------------------------------------------
_HOST_GROUPS: set = set()  # megatron-core's gloo groups: host tensors are right there
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                "broadcast", "reduce", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "gather",
                "scatter", "_all_gather_base", "_reduce_scatter_base")
_OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
_in_object_collective = [False]
_in_collective = [False]


COLLECTIVE_CALLS: dict[str, int] = {}  # by name, for REHEARSAL_REPORT (objects' inner calls not counted)


def _refuse_host(name: str, tensors, group) -> None:
    if not _in_object_collective[0]:
        COLLECTIVE_CALLS[name] = COLLECTIVE_CALLS.get(name, 0) + 1
    if not _in_object_collective[0] and group not in _HOST_GROUPS:
        host = [t for t in tensors if place(t) == HOST]
        if host:
            raise DeviceMixError(f"No backend type associated with device type cpu (rehearsal: "
                                 f"torch.distributed.{name} of host tensor {_describe(host[0])} over an NCCL group)")


def _device_collective(name, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def collective(*args, **kwargs):
        if _in_collective[0]:
            # torch's collectives hand themselves, by their patched module name, to the active function
            # mode (cpu_support's), which calls them again: one call, counted and checked once.
            return original(*args, **kwargs)
        # The group, wherever the caller put it (megatron-core passes it by keyword and by position).
        group = signature.bind_partial(*args, **kwargs).arguments.get("group")
        _refuse_host(name, list(_tensors((args, kwargs))), group)
        _in_collective[0] = True
        try:
            return original(*args, **kwargs)
        finally:
            _in_collective[0] = False

    return collective


def _batch_isend_irecv(original):
    @functools.wraps(original)
    def batch_isend_irecv(p2p_op_list):
        for op in p2p_op_list:
            _refuse_host(f"batch_isend_irecv ({op.op.__name__})", [op.tensor], op.group)
        return original(p2p_op_list)

    return batch_isend_irecv


def _object_collective(original):
    # They place their own buffers (on the GPU under NCCL); under gloo here they use the host.
    @functools.wraps(original)
    def collective(*args, **kwargs):
        COLLECTIVE_CALLS[original.__name__] = COLLECTIVE_CALLS.get(original.__name__, 0) + 1
        _in_object_collective[0] = True
        try:
            return original(*args, **kwargs)
        finally:
            _in_object_collective[0] = False

    return collective


def _new_group(original):
    @functools.wraps(original)
    def new_group(*args, **kwargs):
        group = original(*args, **kwargs)
        if kwargs.get("backend") == "gloo":
            _HOST_GROUPS.add(group)
        return group

    return new_group


def _patch_distributed() -> None:
    """Every tensor collective checked, also where megatron-core bound it to a name of its own at import
    (tensor_parallel.mappings/layers, distributed.param_and_grad_buffer: `dist_all_gather_func` ...)."""
    from torch.distributed import distributed_c10d as c10d

    checked = {}
    for name in _COLLECTIVES:
        if hasattr(c10d, name):
            checked[getattr(c10d, name)] = _device_collective(name, getattr(c10d, name))
    for name in _OBJECT_COLLECTIVES:
        checked[getattr(c10d, name)] = _object_collective(getattr(c10d, name))
    checked[c10d.batch_isend_irecv] = _batch_isend_irecv(c10d.batch_isend_irecv)
    checked[c10d.new_group] = _new_group(c10d.new_group)
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name in ("torch.distributed", "torch.distributed.distributed_c10d")
                                  or module_name.startswith(("megatron.", "megatron_ext."))):
            continue
        for attribute, value in list(vars(module).items()):
            if isinstance(value, types.FunctionType) and value in checked:
                setattr(module, attribute, checked[value])


def _keep_marks_in_parameters() -> None:
    """`nn.Parameter(t)` is a new tensor object: it takes `t`'s place (LoRA adapters are made after the
    model moved to its device; their place must be known to be checked)."""
    original = torch.nn.Parameter.__new__

    def new(cls, data=None, requires_grad=True):
        param = original(cls, data, requires_grad)
        if data is not None and place(data) is not None:
            mark(param, place(data))
        return param

    torch.nn.Parameter.__new__ = staticmethod(new)


def _host_batches(train_data_cls, val_data_cls) -> None:
    """What the data loader hands the trainer, training and evaluation batches alike, is in host
    memory, as on a GPU machine."""
    train_data_cls.next_micro_batches = _marked_host(train_data_cls.next_micro_batches)
    val_data_cls.global_batches = _marked_host(val_data_cls.global_batches)


def _marked_host(original):
    @functools.wraps(original)
    def batches(*args, **kwargs):
        made = original(*args, **kwargs)
        for t in _tensors(made):
            mark(t, HOST)
        return made

    return batches


ATTENTION_KERNELS = ("scaled_dot_product_attention", "varlen_attn")


class _Counts:
    """Core attention forwards (SDPAttention) and attention kernel calls, for REHEARSAL_REPORT."""

    def __init__(self):
        self.layers = 0
        self.kernels = 0

    def watch(self, ledger: DeviceLedger) -> None:
        from megatron_ext.model import attention

        forward = attention.SDPAttention.forward

        def counted_forward(module, *args, **kwargs):
            self.layers += 1
            return forward(module, *args, **kwargs)

        attention.SDPAttention.forward = counted_forward
        ledger.on_call = lambda func: setattr(self, "kernels", self.kernels + (
            getattr(func, "__name__", "") in ATTENTION_KERNELS))

    def write(self, path: str, ledger: DeviceLedger) -> None:
        with open(path, "w") as f:
            json.dump({"attention_layers": self.layers, "attention_kernels": self.kernels, "reads": ledger.reads,
                       "collectives": COLLECTIVE_CALLS}, f)


def _watch_backward(ledger: DeviceLedger) -> None:
    """The Python autograd runs in backward, under the function modes active now (the ledger, and
    cpu_support's CUDA-to-CPU mode in a run), as in the forward (see the module doc); the C++ backward
    functions' aten ops under `_BackwardKernels`, entered wherever autograd's engine starts (torch's
    backward and grad, and megatron-core's own call of the engine in its pipeline schedules)."""
    from megatron.core.distributed import DistributedDataParallel
    from torch.autograd.variable import Variable

    modes = torch.overrides._get_current_function_mode_stack()

    def watched(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with contextlib.ExitStack() as active:
                for mode in modes:
                    active.enter_context(mode)
                return fn(*args, **kwargs)
        return run

    function = torch.autograd.function.BackwardCFunction
    function.apply = watched(function.apply)
    make_hook = DistributedDataParallel._make_backward_post_hook
    DistributedDataParallel._make_backward_post_hook = lambda self, param: watched(make_hook(self, param))
    Variable._execution_engine = _WatchedEngine(Variable._execution_engine, ledger)


class _WatchedEngine:
    """autograd's engine, running every backward under `_BackwardKernels` (once: recomputation's
    backward runs inside another)."""

    def __init__(self, engine, ledger: DeviceLedger):
        self._engine, self._kernels = engine, _BackwardKernels(ledger)
        self._depth = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def run_backward(self, *args, **kwargs):
        # `loss.backward()` is itself a Python API call in progress: the backward kernels are not its.
        outer_call, _in_python_call[0] = _in_python_call[0], 0
        self._depth += 1
        try:
            with self._kernels if self._depth == 1 else contextlib.nullcontext():
                return self._engine.run_backward(*args, **kwargs)
        finally:
            self._depth -= 1
            _in_python_call[0] = outer_call


def start() -> DeviceLedger:
    """Rehearse in this process: megatron-core on the CPU naming cuda:0, the ledger watching."""
    from megatron_ext.compat import cpu_support
    from megatron_ext.train.batches import TrainData, ValData

    cpu_support.apply()
    # The device a real run's code names; cpu_support lands its tensors on the CPU.
    cpu_support.NAMED_DEVICE = torch.device("cuda", 0)
    _patch_distributed()
    _keep_marks_in_parameters()
    from megatron_ext.compat import wgrad_accumulation
    from megatron_ext.model import attention

    attention.varlen_attn = rehearsed_varlen_attn
    wgrad_accumulation.accumulate_on_cuda = rehearsed_accumulate_on_cuda
    _host_batches(TrainData, ValData)
    ledger = DeviceLedger()
    if os.environ.get("REHEARSAL_REPORT") and os.environ.get("RANK", "0") == "0":  # one writer
        counts = _Counts()
        counts.watch(ledger)
        atexit.register(counts.write, os.environ["REHEARSAL_REPORT"], ledger)
    ledger.__enter__()
    _watch_backward(ledger)
    return ledger


if __name__ == "__main__":
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    start()
    runpy.run_path(script, run_name="__main__")
