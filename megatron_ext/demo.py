"""The whole pipeline on a CPU laptop, through the same commands a user types.

tiny HF models -> build_llava_jp.py -> convert_hf_to_megatron.py (TP2) -> a synthetic image
dataset -> prepared energon shards -> run.py stage 1 then stage 2 (2 processes, TP2) ->
convert_megatron_to_hf.py -> transformers generates an answer for an image.

Each step runs the real script in a subprocess and is printed as a copyable shell command.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.errors import UserError

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


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


def _run(title: str, script: str, *args, log: Path) -> None:
    command = [sys.executable, str(SCRIPTS / script), *map(str, args)]
    print(f"\n==> {title}\n$ {shlex.join(['python', f'scripts/{script}', *map(str, args)])}", flush=True)
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("a") as out:
        out.write(f"\n$ {shlex.join(command)}\n")
        out.flush()
        status = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    if status != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        raise UserError(f"demo step '{title}' failed (exit {status}); its output is in {log}\n{tail}")
    print(f"    done in {time.perf_counter() - start:.1f} s", flush=True)


def run_demo(out: Path, settings: DemoSettings = DemoSettings()) -> dict[str, Path]:
    """Run every step into `out`; returns where each artifact is."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "demo.log"
    s = settings
    paths = {
        "tiny HF models": out / "tiny",
        "HF LLaVA": out / "hf-llava",
        "Megatron checkpoint (TP2)": out / "megatron-tp2",
        "synthetic dataset": out / "data-src",
        "prepared energon dataset": out / "energon",
        "stage 1 checkpoints": out / "stage1",
        "stage 2 checkpoints": out / "stage2",
        "trained HF LLaVA": out / "hf-trained",
    }
    p = list(paths.values())
    train_common = ["-g", s.processes, "--tp", s.tp, "--pp", 1, "--data-path", p[4], "--save",
                    "--micro-batch-size", s.micro_batch_size, "--global-batch-size", s.global_batch_size,
                    "--num-workers", 0, "--log-interval", 10]
    _run("1/8 tiny random HF models (Llama text with GQA, CLIP and SigLIP towers)", "demo/make_tiny_hf_models.py",
         "--save-dir", p[0], "--force", log=log)
    _run("2/8 assemble an HF LLaVA checkpoint", "convert/build_llava_jp.py", "--save-dir", p[1],
         "--text-model", p[0] / "text", "--vision-model", p[0] / "vision-clip", "--force", log=log)
    _run("3/8 convert it to a Megatron checkpoint for TP2", "convert/convert_hf_to_megatron.py", "--tp", s.tp,
         "--pp", 1, "--hf-dir", p[1], "--megatron-dir", p[2], "--force", log=log)
    _run("4/8 a synthetic image dataset (LLaVA JSON)", "data/make_synthetic_dataset.py", "--output-dir", p[3],
         "--num-samples", s.samples, "--force", log=log)
    _run("5/8 energon shards, prepared", "data/build_energon_dataset.py", p[3] / "llava.json", "--output-dir", p[4],
         "--samples-per-shard", 16, "--num-workers", 0, "--force", log=log)
    _run("6/8 stage 1: train the projector", "train/run.py", *train_common, "--stage", 1,
         "--megatron-load-dir", p[2], "--save-dir", p[5], "--",
         "--train-iters", s.stage1_iters, "--lr", 1e-3, "--seq-length", s.seq_length, log=log)
    _run("7/8 stage 2: train the projector and the language model", "train/run.py", *train_common, "--stage", 2,
         "--megatron-load-dir", p[5], "--save-dir", p[6], "--",
         "--train-iters", s.stage2_iters, "--lr", 1e-3, "--seq-length", s.seq_length, log=log)
    _run("8/8 convert the trained checkpoint back to HF", "convert/convert_megatron_to_hf.py", "--tp", s.tp,
         "--pp", 1, "--megatron-dir", p[6], "--hf-dir", p[7], "--tokenizer-dir", p[1], "--force", log=log)
    paths["demo log"] = log
    return paths


def answer(hf_dir: Path, image: Path, question: str, max_new_tokens: int = 24) -> str:
    """What the trained HF model (through transformers) answers about `image`."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(hf_dir).eval()
    processor = AutoProcessor.from_pretrained(hf_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(images=Image.open(image).convert("RGB"), text=prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
