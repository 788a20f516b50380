"""Does our trainer train the model transformers would? The parity check behind
scripts/train/check_parity.py.

1. `run_ours`: the HF checkpoint converted, N steps of our real trainer on N processes (under
   torchrun on GPUs, forked on a CPU) in the layout asked for (`verify.parity_run` records each
   global batch and the first step's gradients), the result exported to HF (LoRA: its initial and
   final adapters exported to PEFT).
2. `run_hf`: N steps of `verify.hf_loop` (transformers' model, trained as its Trainer trains; LoRA:
   a PEFT model starting from our initial adapters) on the same global batches, with the same
   optimizer (AdamW or SGD), schedule and frozen parts.
3. `compare`: per step, loss and gradient norm of both sides; per trained parameter, the first
   step's gradient; per module, the largest weight difference of the two final models (LoRA: the
   adapters). Frozen parameters must be bit-identical (at the compute dtype).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_ext.config.options import TrainConfig
from megatron_ext.errors import UserError

if TYPE_CHECKING:
    from megatron_ext.verify.hf_loop import Adapters

# fp32: the two sides differ by float rounding only (summation order, fused kernels).
FP32_RTOL = 1e-5
# bf16 (a GPU's default): both sides round activations to 8 mantissa bits, in different places (Megatron
# keeps bf16 weights and runs norms and residual adds in bf16, autocast runs those in fp32). On an H200,
# 4 steps of a hidden-512 LLaVA: losses within 5.7e-3, gradient norms within 2.0e-2 (docs/training.md).
BF16_RTOL = 3e-2
RTOL = {"float32": FP32_RTOL, "bfloat16": BF16_RTOL}
# First-step gradients, per parameter: the largest |ours - HF| of its elements over the L2 norm of
# its HF gradient. A gradient's float noise scales with its size; dividing element by element would
# blow up the noise of elements near zero.
GRAD_RTOL = {"float32": 1e-5, "bfloat16": BF16_RTOL}


@dataclass
class OurRun:
    plan: object  # the trainer's RunPlan
    record_dir: Path
    hf_out: Path  # our trained model exported to HF; LoRA: its final adapters exported to PEFT
    steps: list[dict]  # metrics.jsonl's records, by iteration
    source: Path  # the HF checkpoint it started from
    initial_adapters: Path | None = None  # LoRA: the adapters it started from, exported to PEFT


@dataclass
class HfRun:
    model: object  # transformers' model (LoRA: the PEFT model) after the steps
    steps: list[tuple[float, float, float]]  # (loss, grad norm, lr) per step
    first_grads: dict[str, torch.Tensor]  # by `hf_key`


@dataclass
class Row:
    step: int
    lr: float
    ours: tuple[float, float]  # loss, grad norm
    hf: tuple[float, float]

    @property
    def rel(self) -> tuple[float, float]:
        return tuple(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(self.ours, self.hf))


@dataclass
class Report:
    rows: list[Row]
    modules: dict[str, tuple[float, bool]]  # module -> (largest |difference|, trained)
    rtol: float
    weight_atol: float
    problems: list[str] = field(default_factory=list)
    dtype: str = "float32"  # the compute dtype of both sides
    grads: dict[str, float] = field(default_factory=dict)  # module -> largest relative first-step gradient difference
    grad_rtol: float = GRAD_RTOL["float32"]
    compared_grads: int = 0  # trained parameters whose first-step gradients were compared

    @property
    def ok(self) -> bool:
        return not self.problems

    def table(self) -> str:
        lines = [f"{'step':>4} {'lr':>9} {'loss ours':>12} {'loss HF':>12} {'rel':>8} {'grad ours':>12} "
                 f"{'grad HF':>12} {'rel':>8}"]
        for r in self.rows:
            lines.append(f"{r.step:>4} {r.lr:>9.3g} {r.ours[0]:>12.7f} {r.hf[0]:>12.7f} {r.rel[0]:>8.1e} "
                         f"{r.ours[1]:>12.7f} {r.hf[1]:>12.7f} {r.rel[1]:>8.1e}")
        lines.append(f"{'module':<36} {'max |dw|':>9} {'grad rel':>9}  (trained: bound {self.weight_atol:.1e}, first-step "
                     f"gradients {self.grad_rtol:g}; frozen: 0)")
        for name, (diff, trained) in self.modules.items():
            grad = f"{self.grads[name]:>9.1e}" if name in self.grads else f"{'':>9}"
            lines.append(f"{name:<36} {diff:>9.1e} {grad}  {'trained' if trained else 'frozen'}")
        lines += [f"FAIL: {p}" for p in self.problems] or [f"OK: within rtol {self.rtol:g} ({self.dtype})"]
        return "\n".join(lines)


def trainer_config(megatron_dir: Path, data_path: str, save_dir: Path, steps: int, options: dict) -> TrainConfig:
    """Our run: `options` (trainer option names) over a short run that logs and saves every step."""
    unknown = set(options) - set(TrainConfig.__dataclass_fields__)
    if unknown:
        raise UserError(f"unknown trainer options for the parity check: {', '.join(sorted(unknown))}")
    if options.get("vision_lr") is not None:
        raise UserError("the parity check does not cover --vision-lr yet")
    if options.get("lora_rank") and options.get("lora_dropout"):
        raise UserError("--lora-dropout: the two sides' dropout masks cannot match; check LoRA parity without it")
    return TrainConfig(**{"num_workers": 0, "train_iters": steps, **options, "megatron_load_dir": str(megatron_dir),
                          "data_path": data_path, "save": True, "save_dir": str(save_dir), "log_interval": 1,
                          "exit_interval": steps})


def run_ours(hf_dir: str | Path, data_path: str, work_dir: Path, steps: int, gpus: int, options: dict,
             quiet: bool = False, megatron_dir: Path | None = None) -> OurRun:
    """`megatron_dir`: `hf_dir` converted already (TP1 x PP1), so several runs need not each convert it."""
    from megatron_ext.config.run_plan import make_plan
    from megatron_ext.convert import to_hf, to_megatron
    from megatron_ext.verify.hf_loop import require_peft

    if options.get("lora_rank"):
        require_peft()  # before anything runs

    work_dir = Path(work_dir)
    if megatron_dir is None:
        megatron_dir = to_megatron.convert(hf_dir, work_dir / "megatron", tp=1, pp=1, force=True)
    config = trainer_config(megatron_dir, data_path, work_dir / "ours", steps, options)
    on_gpu = torch.cuda.is_available()
    plan = make_plan(config, gpus, on_gpu)
    if plan.resume is not None:
        raise UserError(f"{work_dir / 'ours'} holds a run already: give the parity check an empty --work-dir")
    config_json = work_dir / "config.json"
    config_json.write_text(json.dumps(config.to_dict()))
    (_torchrun_ranks if on_gpu else _forked_ranks)(work_dir, config_json, gpus, quiet)
    metrics = [json.loads(line) for line in (work_dir / "ours" / "metrics.jsonl").read_text().splitlines()]
    steps_logged = {r["iteration"]: r for r in metrics if r["split"] == "train"}
    steps_logged = [steps_logged[i] for i in sorted(steps_logged)]
    if not config.lora_rank:
        hf_out = to_hf.convert(work_dir / "ours", work_dir / "ours_hf", force=True)
        return OurRun(plan, work_dir / "batches", hf_out, steps_logged, Path(hf_dir))
    from megatron_ext.checkpoint import layout
    from megatron_ext.convert.lora_export import write_peft_adapter

    initial = write_peft_adapter(work_dir / "ours" / layout.snapshot_name(0), work_dir / "adapter_initial", force=True)
    final = write_peft_adapter(work_dir / "ours", work_dir / "adapter", force=True)
    return OurRun(plan, work_dir / "batches", final, steps_logged, Path(hf_dir), initial)


def _torchrun_ranks(work_dir: Path, config_json: Path, gpus: int, quiet: bool) -> None:
    """Our trainer's ranks on GPUs: `verify.parity_run` under torchrun."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
           "-m", "megatron_ext.verify.parity_run", str(work_dir / "batches"), str(config_json)]
    done = subprocess.run(cmd, capture_output=quiet, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode:
        raise UserError(f"our trainer failed (exit {done.returncode}){': ' + done.stderr[-2000:] if quiet else ''}")


def _forked_ranks(work_dir: Path, config_json: Path, gpus: int, quiet: bool) -> None:
    """Our trainer's ranks on a CPU: `verify.parity_run` forked from the converters' preloaded server
    (convert.cpu_ranks), which spares each rank the fresh interpreter's imports torchrun would start
    (about 10 s of CPU each, more than a check's few steps compute). `quiet`: their output in a log."""
    from torch.multiprocessing.spawn import ProcessException

    from megatron_ext.convert.cpu_ranks import run_on_cpu_ranks

    log = work_dir / "ours.log" if quiet else None
    try:
        run_on_cpu_ranks(_trainer_rank, gpus, str(work_dir / "batches"), str(config_json), log and str(log))
    except ProcessException as exc:
        shown = f": {log.read_text()[-2000:]}" if log else ""
        raise UserError(f"our trainer failed ({exc}){shown}") from None


def _trainer_rank(record_dir: str, config_json: str, log: str | None) -> None:
    """One forked rank: `parity_run.main`, exiting with its status; `log`: where its output goes
    (every rank appends). parity_run is imported here, in the rank: it arms the rank to die with its parent."""
    from megatron_ext.verify import parity_run

    if log:
        with open(log, "a") as out:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
    status = parity_run.main([record_dir, config_json])
    if status:
        sys.exit(status)


def global_batch(ours: OurRun, iteration: int) -> list[dict]:
    """Every micro batch of this iteration, data-parallel replica by replica."""
    from megatron_ext.verify.parity_run import batch_file

    replicas = ours.plan.execution.data_parallel_size
    return [b for r in range(replicas) for b in torch.load(batch_file(ours.record_dir, iteration, r))]


def run_hf(ours: OurRun, progress=print) -> HfRun:
    """transformers' model (the checkpoint `ours` started from) trained the same steps on the same
    batches (LoRA: PEFT's, from our initial adapters)."""
    from megatron_ext.convert.mapping import hf_name_of
    from megatron_ext.train.model_setup import warmup_steps
    from megatron_ext.verify.hf_loop import HfLoop, TrainingSettings

    cfg = ours.plan.config
    hyper = TrainingSettings(stage=cfg.stage, unfreeze_vit=cfg.unfreeze_vit, lr=cfg.lr, min_lr=cfg.min_lr,
                  warmup=warmup_steps(ours.plan), steps=ours.plan.train_iters, style=cfg.lr_decay_style,
                  weight_decay=cfg.weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                  clip_grad=cfg.clip_grad, optimizer=cfg.optimizer, momentum=cfg.sgd_momentum)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where our ranks ran (config.run_plan's on_gpu)
    loop = HfLoop(str(ours.source), hyper, ours.plan.arch.img_seq_len, device, ours.plan.dtype, adapters=hf_adapters(ours))
    spell = hf_name_of(ours.plan.arch)
    results = []
    for record in ours.steps:
        lr = loop.scheduler.get_last_lr()[0]
        loss, norm = loop.step(global_batch(ours, record["iteration"]))
        progress(f"HF loop step {record['iteration']}: loss {loss:.6f} grad norm {norm:.6f}")
        results.append((loss, norm, lr))
    return HfRun(loop.model, results, {hf_key(name, spell): grad for name, grad in loop.first_grads.items()})


def hf_adapters(ours: OurRun) -> Adapters | None:
    """LoRA: our initial adapters for the transformers loop, the A of each fused layer (a mapping row
    of several HF weights) tied across the HF modules it feeds (hf_loop.Adapters)."""
    from megatron_ext.convert.lora_export import ADAPTER_CONFIG_FILE, hf_module_names
    from megatron_ext.convert.mapping import llava_mapping
    from megatron_ext.verify.hf_loop import Adapters

    if ours.initial_adapters is None:
        return None
    targets = set(json.loads((ours.initial_adapters / ADAPTER_CONFIG_FILE).read_text())["target_modules"])
    modules = hf_module_names(ours.plan.hf_config)
    tied = [tuple(modules[name] for name in row.hf) for row in llava_mapping(ours.plan.arch).values()
            if len(row.hf) > 1 and modules.get(row.hf[0]) in targets]
    return Adapters(ours.initial_adapters, tuple(tied))


def hf_key(name: str, spell=None) -> str:
    """An HF parameter's canonical name (`convert.mapping`'s; `spell`: the model's `hf_name_of`, a
    LLaVA's by default), also for a PEFT model's parameters and adapter files: PEFT's prefix, adapter
    name and wrapped `base_layer` dropped."""
    from megatron_ext.convert.lora_export import PEFT_PREFIX
    from megatron_ext.convert.mapping import normalize_hf_name

    return (spell or normalize_hf_name)(name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".").replace(".default.", "."))


def first_step_grads(ours: OurRun) -> dict[str, torch.Tensor]:
    """Our iteration 1's gradients (`parity_run.save_grads`) by HF name (`hf_key`), through the
    converters' mapping table: a fused weight's gradient splits as the weight does; an adapter's goes
    to each HF module it feeds, as the PEFT export maps its weights."""
    from megatron_ext.convert.dist_read import SnapshotTensors, by_layer
    from megatron_ext.convert.lora_export import hf_module_names, peft_modules
    from megatron_ext.convert.mapping import model_mapping
    from megatron_ext.lora.layers import ADAPTER_SUFFIXES
    from megatron_ext.verify.parity_run import GRADS_DIR

    a_suffix, b_suffix = ADAPTER_SUFFIXES
    grads_dir = ours.record_dir / GRADS_DIR
    table, modules = model_mapping(ours.plan.arch), hf_module_names(ours.plan.hf_config)
    grads = SnapshotTensors(grads_dir)
    stored = grads.stored(tuple({name.split(".")[0] for name in table}))
    # A read takes a layer at a time; an adapter's A and B are paired once all are read.
    tensors = {name: t for group in by_layer(stored) for name, t in grads.read(group).items()}
    out = {}
    for name, grad in tensors.items():
        if name.endswith(a_suffix):
            weight = name.removesuffix(a_suffix)
            for module, a, b in peft_modules(table[weight + ".weight"], modules, grad, tensors[weight + b_suffix]):
                out[hf_key(f"{module}.lora_A.weight")], out[hf_key(f"{module}.lora_B.weight")] = a, b
        elif not name.endswith(b_suffix):
            out.update(zip(table[name].hf, table[name].rule.megatron_to_hf(grad)))
    return out


def compare_grads(ours: dict[str, torch.Tensor], hf: dict[str, torch.Tensor], rtol: float) -> tuple[dict, float, list[str]]:
    """(per module, the largest relative difference of a trained parameter's first-step gradient (GRAD_RTOL's
    measure); the largest absolute difference of any element; problems). Every parameter transformers
    trains must have our gradient."""
    modules, largest, problems = {}, 0.0, []
    for name, ref in hf.items():
        if name not in ours:
            problems.append(f"{name}: no first-step gradient from our run")
            continue
        diff = (ours[name].float() - ref.float()).abs().max().item()
        norm = ref.float().norm().item()
        rel = diff / norm if norm else (0.0 if diff == 0 else math.inf)
        key = module_of(name)
        modules[key] = max(modules.get(key, 0.0), rel)
        largest = max(largest, diff)
        if not rel <= rtol:
            problems.append(f"{name}: first-step gradient differs by {rel:.1e} of its norm (> {rtol:g})")
    return modules, largest, problems


def module_of(name: str) -> str:
    """The part of an HF LLaVA a parameter belongs to, as the report groups them (a layer's LoRA
    adapters apart from its frozen weights)."""
    layer = re.search(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\.", name)
    if layer:
        return f"language_model.layers.{layer.group(1)}" + (" (LoRA)" if ".lora_" in name else "")
    for part in ("vision_tower", "multi_modal_projector", "visual.merger", "visual.deepstack_merger_list", "visual",
                 "image_newline", "embed_tokens", "lm_head"):
        if part in name:
            return part
    return name.replace("language_model.model.", "language_model.")


def our_weights(ours: OurRun) -> dict[str, torch.Tensor]:
    """Our trained model's parameters by `hf_key`. LoRA: the original checkpoint's (our run loads its
    base from the checkpoint it was converted from, and saves only what it trains) with our final
    PEFT export's adapters (and projector) over them."""
    from megatron_ext import families
    from megatron_ext.convert.mapping import hf_name_of

    if ours.initial_adapters is None:
        model = families.load_model(ours.hf_out, "--work-dir", dtype=torch.float32)
        spell = hf_name_of(ours.plan.arch)
        return {hf_key(name, spell): p.detach() for name, p in model.named_parameters()}
    from safetensors.torch import load_file

    from megatron_ext.convert.lora_export import ADAPTER_WEIGHTS_FILE

    base = families.load_model(ours.source, "--hf-dir", dtype=torch.float32)
    weights = {hf_key(name): p.detach() for name, p in base.named_parameters()}
    weights.update({hf_key(key): t for key, t in load_file(ours.hf_out / ADAPTER_WEIGHTS_FILE).items()})
    return weights


def compare_weights(ours: dict[str, torch.Tensor], reference, dtype: str, spell=None) -> tuple[dict, list[str]]:
    """Per module, the largest |ours - reference|, and whether any of its parameters trained. Frozen
    parameters must equal the reference's (the original checkpoint's) at the compute dtype bit for bit:
    in bf16 our model holds bf16 weights where transformers' autocast keeps fp32 ones. `spell`: `hf_key`'s."""
    modules, problems = {}, []
    for name, param in reference.named_parameters():
        name, ref, trained = hf_key(name, spell), param.detach().cpu(), param.requires_grad
        if name not in ours:
            problems.append(f"{name}: not in our model")
            continue
        diff = (ours[name] - ref).abs().max().item()
        key = module_of(name)
        prev_diff, prev_trained = modules.get(key, (0.0, False))
        modules[key] = (max(prev_diff, diff), prev_trained or trained)
        # A tower layer past the feature layer is not in our model: the export keeps the original's.
        if not trained and not (torch.equal(ours[name], ref.to(getattr(torch, dtype)).float())
                                or torch.equal(ours[name], ref)):
            problems.append(f"frozen {name} changed by {diff:.2e}")
    return modules, problems


def weight_bound(lr: float, steps: int, dtype: str = "float32", largest_weight: float = 0.0, optimizer: str = "adam",
                 grad_noise: float = 0.0) -> float:
    """How far apart the two runs' trained weights may drift.

    Adam's step, lr * m / (sqrt(v) + eps), is about lr whatever the gradient's size, so it amplifies
    float noise where a gradient is near zero: in fp32 a few such weights move by a fraction of lr
    differently on the two sides (a tiny Llama: up to 2e-5 at lr 1e-3 after 3 steps); a tenth of lr
    per step allows that, while a schedule off by one step or another loss normalisation moves every
    weight by about lr, far more. In bf16 the noise can turn such a step around (2 lr apart), and our
    exported weights are bf16, half a unit in the 8th bit of the largest weight off transformers' fp32
    ones: a loose bound, the losses are the sharper check.

    SGD's step is lr times the momentum buffer, a sum of at most `steps` gradients (momentum <= 1),
    so the sides' steps differ by lr times their gradients' difference, not by anything near lr.
    `grad_noise`, the largest element difference of the first step's gradients, is that float noise;
    later steps' gradients differ by as much again plus what the weights' difference changes (of the
    same size): 2 x noise per gradient, at most `steps` gradients per step, `steps` steps. Each update
    also rounds the weight (up to one unit in the last place of the largest weight, per step; in bf16
    the export's rounding as for Adam). With the noise of the order of 1e-7, at lr 1e-3 that is
    thousands of times tighter than Adam's bound: a wrong learning rate, momentum or decay shows."""
    if optimizer == "sgd":
        rounding = largest_weight * (2.0**-8 if dtype != "float32" else steps * 2.0**-23)
        return lr * steps * steps * 2 * grad_noise + rounding
    if dtype == "float32":
        return 0.1 * lr * steps
    return 2 * lr * steps + largest_weight * 2.0**-8


def compare(ours: OurRun, hf: HfRun, rtol: float | None = None, weight_atol: float | None = None) -> Report:
    """`rtol`: for losses and gradient norms, default by the compute dtype (RTOL)."""
    from megatron_ext.convert.mapping import hf_name_of

    rows = [Row(r["iteration"], r["lr"], (r["loss"], r["grad_norm"]), (loss, norm))
            for r, (loss, norm, _) in zip(ours.steps, hf.steps)]
    cfg, dtype = ours.plan.config, ours.plan.dtype
    rtol = RTOL[dtype] if rtol is None else rtol
    grads, grad_noise, problems = compare_grads(first_step_grads(ours), hf.first_grads, GRAD_RTOL[dtype])
    if weight_atol is None:
        largest = max(p.detach().abs().max().item() for p in hf.model.parameters() if p.requires_grad)
        weight_atol = weight_bound(cfg.lr, len(rows), dtype, largest, cfg.optimizer, grad_noise)
    modules, weight_problems = compare_weights(our_weights(ours), hf.model, dtype, hf_name_of(ours.plan.arch))
    problems += weight_problems
    for r, (_, _, hf_lr) in zip(rows, hf.steps):
        if not math.isclose(r.lr, hf_lr, rel_tol=1e-9, abs_tol=1e-15):
            problems.append(f"step {r.step}: learning rate {r.lr:.6g} (ours) vs {hf_lr:.6g} (transformers' schedule)")
        for what, rel in zip(("loss", "grad norm"), r.rel):
            if not rel <= rtol:
                problems.append(f"step {r.step}: {what} differs by {rel:.1e} relative (> {rtol:g})")
    problems += [f"{name}: weights differ by {diff:.1e} (> {weight_atol:.1e})" for name, (diff, trained)
                 in modules.items() if trained and not diff <= weight_atol]
    if any(not math.isfinite(v) for r in rows for v in (*r.ours, *r.hf)):
        problems.append("a loss or gradient norm is not finite")
    return Report(rows, modules, rtol, weight_atol, problems, dtype, grads, GRAD_RTOL[dtype], len(hf.first_grads))


def check_parity(hf_dir: str | Path, data_path: str, work_dir: Path, steps: int, gpus: int, options: dict,
                 rtol: float | None = None, quiet: bool = False, megatron_dir: Path | None = None) -> Report:
    """The whole check: our run, the transformers loop on its batches, the comparison."""
    ours = run_ours(hf_dir, data_path, work_dir, steps, gpus, options, quiet=quiet, megatron_dir=megatron_dir)
    return compare(ours, run_hf(ours, progress=(lambda line: None) if quiet else print), rtol=rtol)
