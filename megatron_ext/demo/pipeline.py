"""The whole pipeline on a CPU laptop, through the same commands a user types.

tiny HF models -> build_llava_jp.py -> convert_hf_to_megatron.py (TP2) -> a synthetic image
dataset -> prepared energon shards -> run.py stage 1 then stage 2 (2 processes, TP2, with
validation loss and scored answers) -> convert_megatron_to_hf.py -> generate.py answers a question
about an image with the HF model -> evaluate.py scores the Megatron checkpoint on the val split
-> `megatron-ext-train report` draws the stage 2 run as an HTML page -> synthetic preference pairs
about the same pictures, prepared -> run.py --stage dpo tunes the stage 2 checkpoint on them (2
processes, TP2), its held-out pairs evaluated before and after.

`--family qwen2_5_vl` or `qwen3_vl` runs a native-resolution model instead (`run_qwen_vl_demo`): a
tiny Qwen2.5-VL or Qwen3-VL -> TP2 -> the same synthetic images at their own sizes -> stage 2 -> HF
-> an answer from transformers' generate.

Each step runs the real command (`python -m megatron_ext.commands.<group> <command>`, what the
megatron-ext-* console scripts and the files under scripts/ run) in a process of its own, so the demo
works from an installed package as from a checkout, and is printed as a copyable shell command. On a
CPU machine that process is a fork of the demo's, which has imported the commands' libraries once
(launch/forked.py): each step would otherwise spend seconds importing them again.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.errors import UserError


@dataclass(frozen=True)
class DemoSettings:
    samples: int = 256
    stage1_iters: int = 60
    stage2_iters: int = 150
    global_batch_size: int = 8
    micro_batch_size: int = 4
    seq_length: int = 256
    processes: int = 2
    tp: int = 2
    eval_samples: int = 16
    max_new_tokens: int = 16
    # DPO on CPU in a few iterations: a learning rate far above the recipe's 5e-7 and a strong beta.
    dpo_iters: int = 10
    dpo_lr: float = 1e-4
    dpo_beta: float = 0.5


# Every step's environment: one thread per process (two run side by side), tokenizers without threads.
STEP_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@functools.cache
def _forking() -> bool:
    """Whether the steps will be forked from this process (a CPU machine's: `launch.forked`), which
    then imports their libraries once, in the steps' environment."""
    from megatron_ext import preloaded

    if not preloaded.can_fork():
        return False
    os.environ.update(STEP_ENV)
    preloaded.preload()
    return True


def _run(title: str, command_name: str, *args, log: Path) -> None:
    """`command_name`: "<module of megatron_ext.commands> [<command>]", e.g. "convert hf-to-megatron"."""
    from megatron_ext.launch import forked

    module, *command = command_name.split()
    shown = ["-m", f"megatron_ext.commands.{module}", *command, *map(str, args)]
    command = [sys.executable, *shown]
    print(f"\n==> {title}\n$ {shlex.join(['python', *shown])}", flush=True)
    start = time.perf_counter()
    env = {**os.environ, **STEP_ENV}
    with log.open("a") as out:
        out.write(f"\n$ {shlex.join(command)}\n")
        out.flush()
        if _forking():
            status = forked.call(shown, env, out)
        else:
            status = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    if status != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        raise UserError(f"demo step '{title}' failed (exit {status}); its output is in {log}\n{tail}")
    print(f"    done in {time.perf_counter() - start:.1f} s", flush=True)


def first_sample(dataset_dir: Path) -> tuple[Path, str, str]:
    """(image, question, reference answer) of the synthetic dataset's first sample."""
    sample = json.loads((dataset_dir / "llava.json").read_text())[0]
    question, reference = (turn["value"] for turn in sample["conversations"][:2])
    return dataset_dir / sample["image"], question.replace("<image>", "").strip(), reference


def held_out_rewards(save_dir: Path) -> tuple[dict, dict]:
    """The DPO run's first and last evaluations on the val pairs (metrics.jsonl's val records)."""
    records = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["split"] == "val"]
    return val[0], val[-1]


def _log_in(out: Path) -> Path:
    """The demo's log in `out` (made if missing), which every step's output goes to."""
    out.mkdir(parents=True, exist_ok=True)
    return out / "demo.log"


def _converted_and_data(out: Path) -> dict[str, Path]:
    """Where either demo puts the converted checkpoint and the synthetic dataset, raw and prepared."""
    return {"Megatron checkpoint (TP2)": out / "megatron-tp2", "synthetic dataset": out / "data-src",
            "prepared energon dataset": out / "energon"}


def _train_common(s: DemoSettings) -> list:
    """run.py's options of every training step: its processes and layout, batches, checkpoints, logs."""
    return ["-g", s.processes, "--tp", s.tp, "--pp", 1, "--save", "--micro-batch-size", s.micro_batch_size,
            "--global-batch-size", s.global_batch_size, "--num-workers", 0, "--log-interval", 10]


def run_demo(out: Path, settings: DemoSettings = DemoSettings()) -> dict[str, Path]:
    """Run every step into `out`; returns where each artifact is."""
    log, s = _log_in(out), settings
    paths = {
        "tiny HF models": out / "tiny",
        "HF LLaVA": out / "hf-llava",
        **_converted_and_data(out),
        "stage 1 checkpoints": out / "stage1",
        "stage 2 checkpoints": out / "stage2",
        "trained HF LLaVA": out / "hf-trained",
        "answer (generate.py)": out / "answer.jsonl",
        "evaluation (evaluate.py)": out / "eval",
        "stage 2 report (HTML page)": out / "stage2" / "report.html",
        "preference pairs": out / "pref-src",
        "prepared preference pairs": out / "pref-energon",
        "DPO checkpoints": out / "dpo",
    }
    p = list(paths.values())
    train_common = _train_common(s)
    _run("1/14 tiny random HF models (Llama text with GQA, CLIP and SigLIP towers)", "demo tiny-models",
         "--save-dir", p[0], "--force", log=log)
    _run("2/14 assemble an HF LLaVA checkpoint", "convert build-llava", "--save-dir", p[1],
         "--text-model", p[0] / "text", "--vision-model", p[0] / "vision-clip", "--force", log=log)
    _run("3/14 convert it to a Megatron checkpoint for TP2", "convert hf-to-megatron", "--tp", s.tp,
         "--pp", 1, "--hf-dir", p[1], "--megatron-dir", p[2], "--force", log=log)
    _run("4/14 a synthetic image dataset (LLaVA JSON)", "data synthetic", "--output-dir", p[3],
         "--num-samples", s.samples, "--force", log=log)
    _run("5/14 energon shards, prepared", "data build", p[3] / "llava.json", "--output-dir", p[4],
         "--samples-per-shard", 16, "--num-workers", 0, "--force", log=log)
    _run("6/14 stage 1: train the projector", "train", *train_common, "--stage", 1, "--data-path", p[4],
         "--megatron-load-dir", p[2], "--save-dir", p[5], "--",
         "--train-iters", s.stage1_iters, "--lr", 1e-3, "--seq-length", s.seq_length, log=log)
    _run("7/14 stage 2: train the projector and the language model", "train", *train_common, "--stage", 2,
         "--data-path", p[4], "--megatron-load-dir", p[5], "--save-dir", p[6], "--",
         "--train-iters", s.stage2_iters, "--lr", 1e-3, "--seq-length", s.seq_length,
         "--eval-interval", s.stage2_iters, "--eval-generate-samples", s.eval_samples,
         "--eval-max-new-tokens", s.max_new_tokens, log=log)
    _run("8/14 convert the trained checkpoint back to HF", "convert megatron-to-hf", "--tp", s.tp,
         "--pp", 1, "--megatron-dir", p[6], "--hf-dir", p[7], "--tokenizer-dir", p[1], "--force", log=log)
    image, question, _ = first_sample(p[3])
    _run("9/14 answer a question about an image with the trained HF model", "eval generate", "--hf-dir", p[7],
         "--image", image, "--prompt", question, "--max-new-tokens", s.max_new_tokens, "--output-jsonl", p[8],
         log=log)
    _run("10/14 evaluate the trained Megatron checkpoint on the val split (TP2 snapshot, one process)",
         "eval evaluate", "--megatron-dir", p[6], "--data-path", p[4], "--output-dir", p[9], "--force",
         "--fast-n", s.eval_samples, "--max-new-tokens", s.max_new_tokens, log=log)
    _run("11/14 a report of the stage 2 run: loss, learning rate, throughput, checkpoints", "train report", p[6],
         log=log)
    _run("12/14 synthetic preference pairs: the same pictures and questions, rejected answers with an object "
         "added that is not there or a wrong colour, shape or place",
         "data synthetic", "--task", "preference", "--output-dir", p[11], "--num-samples", s.samples, "--force",
         log=log)
    _run("13/14 energon shards of the pairs, prepared", "data build", p[11] / "preference.json", "--task",
         "preference", "--output-dir", p[12], "--samples-per-shard", 16, "--num-workers", 0, "--force", log=log)
    _run("14/14 DPO: tune the stage 2 checkpoint on the pairs (it is also the reference); held-out pairs "
         "evaluated before and after", "train", *train_common, "--stage", "dpo", "--data-path", p[12],
         "--megatron-load-dir", p[6], "--save-dir", p[13], "--",
         "--train-iters", s.dpo_iters, "--lr", s.dpo_lr, "--dpo-beta", s.dpo_beta, "--seq-length", s.seq_length,
         "--eval-interval", s.dpo_iters, "--eval-on-start", log=log)
    paths["demo log"] = log
    return paths


# The Qwen-VL demos: fewer samples and steps, so that each stays within about two minutes on 2 cores.
QWEN_VL_SETTINGS = DemoSettings(samples=64, stage2_iters=30)
# family: (its name, its tiny model: decoder and tower, each printed in the step's title)
QWEN_VL_DEMOS = {
    "qwen2_5_vl": ("Qwen2.5-VL", "windowed tower, mRoPE decoder"),
    "qwen3_vl": ("Qwen3-VL", "tower with a DeepStack feature, interleaved-mRoPE decoder"),
}


def run_qwen_vl_demo(out: Path, family: str = "qwen2_5_vl", settings: DemoSettings = QWEN_VL_SETTINGS) -> dict[str, Path]:
    """A native-resolution model through the pipeline: a tiny random Qwen2.5-VL or Qwen3-VL (`family`)
    -> Megatron (TP2) -> the synthetic dataset, prepared -> stage 2 (2 processes, TP2) -> HF -> one
    answer from transformers' generate. Returns where each artifact is."""
    log, s = _log_in(out), settings
    name, parts = QWEN_VL_DEMOS[family]
    paths = {
        f"tiny HF {name}": out / f"hf-{family}",
        **_converted_and_data(out),
        "stage 2 checkpoints": out / "stage2",
        f"trained HF {name}": out / "hf-trained",
        "answer (transformers)": out / "answer.jsonl",
    }
    p = list(paths.values())
    _run(f"1/7 a tiny random {name} ({parts}, byte-level BPE tokenizer in ChatML)",
         "demo tiny-qwen-vl", "--family", family, "--save-dir", p[0], "--force", log=log)
    _run("2/7 convert it to a Megatron checkpoint for TP2 (the tower whole on every rank)", "convert hf-to-megatron",
         "--tp", s.tp, "--pp", 1, "--hf-dir", p[0], "--megatron-dir", p[1], "--force", log=log)
    _run("3/7 a synthetic image dataset (LLaVA JSON; images of many sizes)", "data synthetic", "--output-dir", p[2],
         "--num-samples", s.samples, "--force", log=log)
    _run("4/7 energon shards, prepared", "data build", p[2] / "llava.json", "--output-dir", p[3],
         "--samples-per-shard", 16, "--num-workers", 0, "--force", log=log)
    _run("5/7 stage 2: each image at its own resolution; train the decoder and the tower's merger", "train",
         *_train_common(s), "--stage", 2, "--data-path", p[3], "--megatron-load-dir", p[1], "--save-dir", p[4], "--",
         "--train-iters", s.stage2_iters, "--lr", 1e-3, "--seq-length", s.seq_length, log=log)
    _run("6/7 convert the trained checkpoint back to HF", "convert megatron-to-hf", "--tp", s.tp, "--pp", 1,
         "--megatron-dir", p[4], "--hf-dir", p[5], "--force", log=log)
    image, question, _ = first_sample(p[2])
    _run("7/7 answer a question about an image with the trained HF model (transformers' generate, greedy)",
         "demo answer", "--hf-dir", p[5], "--image", image, "--prompt", question, "--max-new-tokens",
         s.max_new_tokens, "--output-jsonl", p[6], log=log)
    paths["demo log"] = log
    return paths
