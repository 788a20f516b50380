"""Where one training step's device time goes: kernel category x phase, idle gaps, host reads.

    python bench/gpu_profile.py                     # the ~1B LLaVA of bench/gpu_bench.py, one GPU
    python bench/gpu_profile.py --preset tiny       # the same code on the CPU (CI)

One optimizer step of bench/gpu_bench.py's model and data (the trainer's own pieces: megatron DDP,
Adam, packing) runs under torch.profiler after `--warmup` unprofiled steps. Every device kernel is
charged to a category (from its name: GEMM, attention, norm, elementwise, copy, loss, optimizer,
communication, compiled) and to the phase that launched it (the module whose forward was running:
vit, projector, preprocess (megatron's LLaVA input assembly), lm, logits+loss; backward kernels
to the phase of the forward op they differentiate; the optimizer step; anything else "schedule").
On the CPU, where there are no kernels, leaf operators stand in for them with their host time.

Printed: the category x phase table (ms), the step's wall time against the device's busy time
(the rest is idle: the device waited for the host), the largest idle gaps with the operator that
ended each, host reads of device values (cudaStreamSynchronize / DtoH copies, `item()`), and the
GEMM throughput at the step's own shapes (the ceiling the GEMM rows can reach). The last line is
a JSON object with all of it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402  (its sibling: the same model and data)

# Kernel name (lower case) fragments -> category; the first match wins, so more specific first.
CATEGORIES = (
    ("communication", ("nccl", "allreduce", "all_reduce", "c10d", "gloo", "reduce_scatter", "allgather")),
    ("optimizer", ("multi_tensor", "adam", "_foreach", "fused_sgd")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "varlen", "cudnn_", "scaled_dot")),
    ("loss", ("cross_entropy", "log_softmax", "logsoftmax", "nll_loss", "softmax")),
    ("norm", ("layer_norm", "layernorm", "rms_norm", "rmsnorm", "norm_")),
    ("GEMM", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::baddbmm", "aten::linear", "aten::matmul", "sm90_", "sm80_")),
    ("compiled", ("triton",)),
    ("copy", ("copy", "memcpy", "memset", "cat", "index", "gather", "scatter", "fill", "where", "masked",
              "nonzero", "aten::to", "clone", "contiguous", "pad", "embedding")),
    ("reduction", ("reduce", "sum", "mean", "max", "norm")),
)
PHASES = ("vit", "projector", "preprocess", "lm", "logits+loss", "optimizer", "schedule")
HOST_READS = ("cudastreamsynchronize", "cudadevicesynchronize", "cudaeventsynchronize", "aten::_local_scalar_dense",
              "aten::item", "aten::nonzero")


def category(name: str) -> str:
    lowered = name.lower()
    for cat, fragments in CATEGORIES:
        if any(f in lowered for f in fragments):
            return cat
    return "elementwise"


@dataclass(frozen=True)
class Work:
    """A device kernel (or, on the CPU, an outermost aten operator) and the operator that launched
    it (None where the profiler does not say)."""
    name: str
    start_us: float
    end_us: float
    op: object = None


BACKWARD_NODE = "autograd::engine::evaluate_function"


def _lineage(event):
    """The event, then its parent, its parent's parent, ... (the profiler's CPU call tree)."""
    while event is not None:
        yield event
        event = event.cpu_parent


def _phase_of_op(op, backward_phase: dict) -> str:
    """The innermost phase range around `op`; backward nodes take their forward operator's phase."""
    for event in _lineage(op):
        if event.name.startswith("phase:"):
            return event.name[len("phase:"):]
        if event.name.startswith(BACKWARD_NODE):
            return "backward: " + backward_phase.get(event.sequence_nr, "schedule")
    return "schedule"


def _forward_phases(events) -> dict:
    """sequence number -> phase of the forward operator recorded with it (the number its backward
    node carries): the first forward operator of a sequence number decides."""
    phases = {}
    for event in events:
        in_backward = any(e.name.startswith(BACKWARD_NODE) for e in _lineage(event))
        if event.sequence_nr >= 0 and event.sequence_nr not in phases and not in_backward:
            phases[event.sequence_nr] = _phase_of_op(event, {})
    return phases


def _inside_aten(event) -> bool:
    return any(e.name.startswith("aten::") for e in _lineage(event.cpu_parent))


def _cpu_ops(events) -> list:
    from torch.autograd import DeviceType

    return [e for e in events if e.device_type == DeviceType.CPU]


def charged_work(events, on_gpu: bool) -> list[Work]:
    """What the table charges: on a GPU each kernel with the operator that launched it (the
    profiler attaches kernels to their operator, without start times); on the CPU the outermost
    aten operators (they do not overlap; their children run inside them)."""
    if on_gpu:
        return [Work(k.name, 0.0, k.duration, e) for e in _cpu_ops(events) for k in e.kernels]
    return [Work(e.name, e.time_range.start, e.time_range.end, e) for e in _cpu_ops(events)
            if e.name.startswith("aten::") and not _inside_aten(e)]


def device_timeline(events, on_gpu: bool) -> list[Work]:
    """The device's activity in time: kernels, copies and sets (not the profiler's annotation
    ranges); on the CPU the charged operators."""
    from torch.autograd import DeviceType

    if not on_gpu:
        return charged_work(events, on_gpu)
    return [Work(e.name, e.time_range.start, e.time_range.end) for e in events
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
            and not e.name.startswith("phase:")]


def busy_intervals(work: list[Work]) -> list[tuple[float, float, Work]]:
    """The union of the activities' time ranges, each merged interval with what ended it."""
    merged = []
    for w in sorted(work, key=lambda w: w.start_us):
        if merged and w.start_us <= merged[-1][1]:
            if w.end_us > merged[-1][1]:
                merged[-1] = (merged[-1][0], w.end_us, w)
        else:
            merged.append((w.start_us, w.end_us, w))
    return merged


def idle_gaps(intervals, top: int) -> list[dict]:
    """The longest stretches with nothing running, each with what ran before and after it."""
    gaps = [(b[0] - a[1], a[2], b[2]) for a, b in zip(intervals, intervals[1:])]
    gaps.sort(key=lambda g: -g[0])
    return [{"us": round(us, 1), "after": before.name[:70], "then": after.name[:70]} for us, before, after in gaps[:top]]


def table(work: list[Work], phases: dict) -> dict:
    """{category: {phase: ms}}."""
    out = defaultdict(lambda: defaultdict(float))
    for w in work:
        out[category(w.name)][_phase_of_op(w.op, phases)] += (w.end_us - w.start_us) / 1e3
    return {c: dict(p) for c, p in out.items()}


def host_reads(events) -> dict:
    counts = defaultdict(int)
    for e in events:
        lowered = e.name.lower()
        if any(lowered.startswith(r) for r in HOST_READS):
            counts[e.name] += 1
        elif lowered.startswith("cudamemcpy") and "dtoh" in str(getattr(e, "metadata_json", "")).lower():
            counts[e.name + " (DtoH)"] += 1
    return dict(counts)


@contextmanager
def _phase_hooks(model):
    """record_function ranges named phase:<name> around the LLaVA's parts (innermost wins)."""
    import torch

    llava = model
    while not hasattr(llava, "add_encoder"):
        llava = llava.module
    lm = llava.language_model
    parts = {"preprocess": llava, "vit": llava.vision_model, "projector": llava.vision_projection, "lm": lm,
             "logits+loss": lm.output_layer}
    handles, stack = [], []

    def enter(name):
        def hook(module, args):
            scope = torch.profiler.record_function("phase:" + name)
            scope.__enter__()
            stack.append(scope)
        return hook

    def leave(module, args, output):
        stack.pop().__exit__(None, None, None)

    for name, module in parts.items():
        if module is not None:
            handles += [module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave)]
    loss = lm.compute_language_model_loss

    def timed_loss(*args, **kwargs):
        with torch.profiler.record_function("phase:logits+loss"):
            return loss(*args, **kwargs)

    lm.compute_language_model_loss = timed_loss
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        lm.compute_language_model_loss = loss


def gemm_ceiling(preset: gpu_bench.Preset, tokens: int) -> list[dict]:
    """bf16 TFLOP/s of torch.mm at the LM's shapes (tokens x in -> out), forward's orientation."""
    import torch

    t = preset.text
    head_dim = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    h, ffn = t["hidden_size"], t["intermediate_size"]
    qkv = (t["num_attention_heads"] + 2 * t["num_key_value_heads"]) * head_dim
    shapes = {"qkv": (h, qkv), "proj": (t["num_attention_heads"] * head_dim, h), "fc1": (h, 2 * ffn),
              "fc2": (ffn, h), "logits": (h, t["vocab_size"])}
    dev, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    rows = []
    for name, (k, n) in shapes.items():
        a, b = torch.randn(tokens, k, device=dev, dtype=dtype), torch.randn(k, n, device=dev, dtype=dtype)
        seconds = _time(lambda: torch.mm(a, b), repeats=10 if dev == "cuda" else 1)
        rows.append({"gemm": name, "m": tokens, "k": k, "n": n, "tflops": round(2 * tokens * k * n / seconds / 1e12, 1)})
    return rows


def _time(fn, repeats: int) -> float:
    fn()
    gpu_bench._synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    gpu_bench._synchronize()
    return (time.perf_counter() - start) / repeats


def profile_step(preset_name: str, options: dict, warmup: int, gaps: int, find_syncs: bool = False,
                 host_functions: int = 0) -> dict:
    import torch

    from megatron_ext.distributed import init_parallel, shutdown
    from megatron_ext.model.forward_step import make_forward_step
    from megatron_ext.model.inputs import ModelInputs
    from megatron_ext.train.model_setup import build_training_model
    from megatron_ext.train.step import train_step

    preset = gpu_bench.PRESETS[preset_name]
    plan = gpu_bench.make_plan(preset, options, warmup + 2)
    init_parallel(1, 1, seed=1234)
    trained = build_training_model(plan)
    from megatron_ext.distributed import device

    inputs = ModelInputs.for_model(plan.arch, trained.model, device())
    forward_step = make_forward_step(inputs)
    rng = np.random.default_rng(0)
    steps = [gpu_bench.synthetic_micro_batches(plan, preset, True, rng) for _ in range(warmup + 1)]
    gpu_bench.warm_up(lambda batches: train_step(trained, forward_step, batches, plan.seq_length, micro_batch_size=1),
                      steps, warmup, plan.execution.model.compile_layers)
    on_gpu = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    if find_syncs:
        return {"sync_sites": sync_sites(
            lambda: train_step(trained, forward_step, steps[-1], plan.seq_length, micro_batch_size=1), top=30)}
    if host_functions:
        return {"host_functions": host_time(
            lambda: train_step(trained, forward_step, steps[-1], plan.seq_length, micro_batch_size=1), host_functions)}
    step_us = _optimizer_phase(trained)
    gpu_bench._synchronize()
    with torch.profiler.profile(activities=activities) as prof, _phase_hooks(trained.model):
        start = time.perf_counter()
        loss = train_step(trained, forward_step, steps[-1], plan.seq_length, micro_batch_size=1).loss
        gpu_bench._synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    step_us()
    events = prof.events()
    work = charged_work(events, on_gpu)
    intervals = busy_intervals(device_timeline(events, on_gpu))
    busy_ms = sum(b - a for a, b, _ in intervals) / 1e3
    tokens = max(int(inputs.combined_length(b["input_ids"])) for b in steps[-1])
    result = {
        "device": gpu_bench._device_name(), "preset": preset_name, "micro_batches": len(steps[-1]), "loss": loss,
        "wall_ms": round(wall_ms, 1), "device_busy_ms": round(busy_ms, 1),
        "device_idle_ms": round(max(wall_ms - busy_ms, 0.0), 1), "kernels": len(work),
        "table_ms": table(work, _forward_phases(events)), "idle_gaps": idle_gaps(intervals, gaps),
        "host_reads": host_reads(events), "gemm_ceiling": gemm_ceiling(preset, tokens),
    }
    shutdown()
    return result


def sync_sites(run_step, top: int) -> list[dict]:
    """Where a step makes the host wait for the device: CUDA's sync debug mode warns at every
    synchronizing call; each warning's Python stack (outside torch) names the site."""
    import torch

    counts = defaultdict(int)
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return show(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/torch/" not in f.filename and not f.filename.endswith("warnings.py")]
        site = " <- ".join(f"{Path(f.filename).name}:{f.lineno}({f.name})" for f in reversed(frames[-3:]))
        counts[site or "autograd (C++ backward)"] += 1

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            run_step()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = show
    return [{"count": n, "site": site} for site, n in sorted(counts.items(), key=lambda kv: -kv[1])[:top]]


def host_time(run_step, top: int) -> dict:
    """Where the host spends one step (the step is host-bound without TE): cProfile's own time per
    Python function, the `top` largest, and the step's wall time under it. C calls made by operator
    syntax (`a * b`) count in their caller's own time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    gpu_bench._synchronize()
    start = time.perf_counter()
    profiler.runcall(run_step)
    gpu_bench._synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return {"wall_ms": round(wall_ms, 1), "functions": [
        {"function": f"{_short(file)}:{line}({name})", "calls": calls, "own_ms": round(own * 1e3, 2),
         "cumulative_ms": round(cumulative * 1e3, 2)} for (file, line, name), (_, calls, own, cumulative, _) in rows]}


def _short(path: str) -> str:
    """A source path from its package on (megatron/..., torch/..., megatron_ext/...)."""
    parts = Path(path).parts
    for root in ("megatron_ext", "megatron", "torch", "transformers", "bench"):
        if root in parts:
            return "/".join(parts[parts.index(root):])
    return path


def _optimizer_phase(trained):
    """Names the optimizer step's range while profiling; returns the undo."""
    import torch

    step = trained.optimizer.step

    def named_step(*args, **kwargs):
        with torch.profiler.record_function("phase:optimizer"):
            return step(*args, **kwargs)

    trained.optimizer.step = named_step
    return lambda: delattr(trained.optimizer, "step")


def render(result: dict) -> str:
    """The category x phase table in ms, then the totals, gaps, host reads and GEMM ceiling."""
    phases = sorted({p for row in result["table_ms"].values() for p in row},
                    key=lambda p: (p.startswith("backward"), PHASES.index(p.split(": ")[-1])
                                   if p.split(": ")[-1] in PHASES else len(PHASES), p))
    lines = ["| category | " + " | ".join(phases) + " | total |", "|---|" + "---:|" * (len(phases) + 1)]
    rows = sorted(result["table_ms"].items(), key=lambda kv: -sum(kv[1].values()))
    for cat, row in rows:
        cells = [f"{row.get(p, 0):.1f}" if row.get(p) else "" for p in phases]
        lines.append(f"| {cat} | " + " | ".join(cells) + f" | {sum(row.values()):.1f} |")
    totals = [sum(r.get(p, 0) for r in result["table_ms"].values()) for p in phases]
    lines.append("| **total** | " + " | ".join(f"{t:.1f}" for t in totals) + f" | {sum(totals):.1f} |")
    lines += ["", f"step {result['wall_ms']} ms: device busy {result['device_busy_ms']} ms, idle "
              f"{result['device_idle_ms']} ms; {result['kernels']} kernels; {result['micro_batches']} micro batches",
              "largest idle gaps: " + "; ".join(f"{g['us']} us after {g['after']} -> {g['then']}"
                                                for g in result["idle_gaps"]),
              "host reads: " + ", ".join(f"{k} x{v}" for k, v in sorted(result["host_reads"].items())),
              "GEMM at the step's shapes: " + ", ".join(f"{g['gemm']} {g['m']}x{g['k']}x{g['n']} {g['tflops']} TFLOP/s"
                                                        for g in result["gemm_ceiling"])]
    return "\n".join(lines)


@click.command()
@click.option("--preset", type=click.Choice(sorted(gpu_bench.PRESETS)), default="1b", show_default=True)
@click.option("--attention-backend", type=click.Choice(["auto", "te", "sdpa", "local"]), default="sdpa",
              show_default=True)
@click.option("--warmup", type=int, default=1, show_default=True, help="Unprofiled steps first.")
@gpu_bench.compile_layers_option
@gpu_bench.gradient_accumulation_fusion_option
@click.option("--gaps", type=int, default=8, show_default=True, help="How many of the longest idle gaps to list.")
@click.option("--find-syncs", is_flag=True, help="Instead of profiling, run the step under CUDA's sync debug mode "
              "and list where the host waited for the device (GPU only).")
@click.option("--host-functions", type=int, default=0, help="Instead of profiling the device, list the N Python "
              "functions where the host spends the most of one step (cProfile's own time).")
def main(preset, attention_backend, warmup, compile_layers, gradient_accumulation_fusion, gaps, find_syncs,
         host_functions):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    if find_syncs and not torch.cuda.is_available():
        raise click.UsageError("--find-syncs needs a CUDA GPU (it uses CUDA's sync debug mode)")
    options = {"attention_backend": attention_backend, "recompute_granularity": "auto", "fp8": False,
               "packing_seq_length": gpu_bench.PRESETS[preset].seq_length, "compile_layers": compile_layers,
               "gradient_accumulation_fusion": gradient_accumulation_fusion}
    result = profile_step(preset, options, warmup, gaps, find_syncs, host_functions)
    if find_syncs:
        print("\n".join(f"x{s['count']}: {s['site']}" for s in result["sync_sites"]))
    elif host_functions:
        host = result["host_functions"]
        print(f"one step under cProfile: {host['wall_ms']} ms\n| function | calls | own ms | cumulative ms |\n|---|---:|---:|---:|")
        print("\n".join(f"| {f['function']} | {f['calls']} | {f['own_ms']} | {f['cumulative_ms']} |"
                        for f in host["functions"]))
    else:
        print(render(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
