"""lmms-eval runtime of scripts/eval/benchmark.py on CPU: seconds per 1k samples for an HF checkpoint
(lmms-eval's llava_hf, one process) and the same weights as a Megatron checkpoint at TP2 (torchrun).

    python bench/lmms_eval_bench.py [--samples 40] [--max-new-tokens 16] [--workdir DIR]

The tiny test model (Llama 2 layers x 64 + tiny CLIP, 16 image tokens) answers a local VQA task of
`--samples` questions about small images, greedy, up to `--max-new-tokens` tokens. Fixed start-up
(imports, lmms-eval's task index, model load) is measured with 1 sample and subtracted, so the
per-sample figure is the marginal cost; both are printed. The last line is JSON.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _timed(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


@click.command()
@click.option("--samples", type=int, default=40, show_default=True)
@click.option("--max-new-tokens", type=int, default=16, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False))
def main(samples: int, max_new_tokens: int, workdir: str | None):
    from megatron_ext.convert.compare import synthetic_image
    from megatron_ext.convert.to_megatron import convert
    from megatron_ext.demo.tiny_models import make_all
    from megatron_ext.hf.build_llava import build_llava
    from tests.support.lmms_tasks import write_tasks

    work = Path(workdir or tempfile.mkdtemp(prefix="lmms_bench_"))
    tiny = make_all(work / "tiny")
    hf = build_llava(work / "hf", str(tiny["text"]), str(tiny["vision-clip"]))
    megatron = convert(hf, work / "megatron", tp=1, pp=1)
    (work / "images").mkdir(exist_ok=True)
    docs = []
    for i in range(samples):
        path = work / "images" / f"{i}.png"
        synthetic_image(i, (48 + i % 32, 64)).save(path)
        docs.append({"question_id": i, "image_path": str(path), "question": "What is written here?",
                     "answers": ["nothing"] * 10})
    tasks = write_tasks(work / "tasks", {"tiny_vqa": docs}, max_new_tokens)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(work / "hf_home"),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    script = str(REPO / "scripts/eval/benchmark.py")
    runs = {"hf": [sys.executable, script, "--hf-dir", str(hf)],
            "megatron_tp2": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             script, "--megatron-dir", str(megatron), "--tp", "2"]}
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "samples": samples,
              "max_new_tokens": max_new_tokens}
    for name, cmd in runs.items():
        common = ["--include-path", str(tasks), "--tasks", "tiny_vqa", "--force"]
        startup = _timed([*cmd, *common, "--limit", "1", "--output-dir", str(work / f"{name}_1")], env)
        total = _timed([*cmd, *common, "--output-dir", str(work / name)], env)
        per_sample = (total - startup) / (samples - 1)
        result[name] = {"startup_s": round(startup, 1), "total_s": round(total, 1),
                        "s_per_1k_samples": round(per_sample * 1000)}
        print(f"{name}: start-up {startup:.1f} s, {samples} samples {total:.1f} s, "
              f"{per_sample * 1000:.0f} s per 1k samples", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
