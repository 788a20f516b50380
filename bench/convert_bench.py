"""HF -> Megatron (TP2) and back on a random 1.5 GiB bf16 LLaVA: wall time against a plain
safetensors load + save of the same tensors, peak memory against the size on disk.

    python bench/convert_bench.py [--tp 2] [--text-layers 18] [--repeat 2] [--work-dir DIR] [--out bench/results/convert.md]

The model is built locally (no download): a random Llama-style text model (hidden 2048, 18 layers,
GQA 16/4 heads, FFN 5632, bfloat16) with a tiny CLIP tower, assembled by build_llava_jp's code;
`--text-layers` scales it (84 MiB a layer) to see how the fixed cost weighs at other sizes.
The baseline loads every safetensors file of the model whole and saves it again, in a fresh
process (python, torch, safetensors), run twice (before and after the conversions): the faster
counts, as the machine is shared; each conversion of the benchmark model runs `--repeat` times, and
its fastest run counts likewise.
Each conversion runs as the user runs it (the script in a fresh process). Every command's process
tree is sampled every 20 ms and the peak of the summed RSS and PSS is reported (PSS splits pages
shared between processes, such as torch's libraries, so it does not count them once per process).
The same conversions of the tiny test model give the fixed cost (process start, imports).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = REPO_ROOT / "scripts" / "convert"
# Llama-style, ~0.8 B parameters: 1.5 GiB in bfloat16.
BIG_TEXT = dict(hidden_size=2048, num_layers=18, num_heads=16, num_kv_heads=4, intermediate_size=5632)


def build_models(work: Path, text_layers: int) -> dict[str, Path]:
    """The benchmark model and the tiny one, built once per work directory and size (kept if already there)."""
    from megatron_ext.hf.build_llava import build_llava
    from megatron_ext.hf.tiny_models import TinyTextSpec, make_text_model, make_vision_model

    models = {"big": work / f"llava-big-{text_layers}layers", "tiny": work / "llava-tiny"}
    if all(path.is_dir() for path in models.values()):
        return models
    big_text = make_text_model(work / "text-big", TinyTextSpec(**{**BIG_TEXT, "num_layers": text_layers},
                                                               initializer_range=0.02))
    tiny_text = make_text_model(work / "text-tiny")
    clip = make_vision_model(work / "clip", "clip")
    build_llava(models["big"], str(big_text), str(clip), dtype="bfloat16", force=True)
    if not models["tiny"].is_dir():
        build_llava(models["tiny"], str(tiny_text), str(clip), dtype="bfloat16", force=True)
    for scratch in (big_text, tiny_text, clip):
        shutil.rmtree(scratch)
    return models


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _roles(root: psutil.Process) -> dict[str, list[psutil.Process]]:
    """The command's process, its children and everything below them. For HF -> Megatron the
    children are multiprocessing's fork server (and resource tracker) and the rank workers are the
    fork server's children."""
    try:
        children = root.children()
        below = [p for child in children for p in child.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    return {"command": [root], "children": children, "below them": below}


def run_measured(cmd: list[str]) -> dict:
    """Wall time, and peak summed RSS / PSS of `cmd`'s process tree (with the PSS by role at that peak)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    # What the previous command wrote is flushed first: otherwise the kernel writes it back during
    # this one (measured: the baseline took 3.0 s after a quiet spell, 5.5 s after a 4 GiB write).
    os.sync()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
    root = psutil.Process(proc.pid)
    peak = {"rss": 0, "pss": 0, "pss_by_role": {}}
    while proc.poll() is None:
        rss, by_role = 0, {}
        for role, processes in _roles(root).items():
            for p in processes:
                try:
                    info = p.memory_full_info()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                rss += info.rss
                by_role[role] = by_role.get(role, 0) + info.pss
        peak["rss"] = max(peak["rss"], rss)
        if sum(by_role.values()) > peak["pss"]:
            peak["pss"], peak["pss_by_role"] = sum(by_role.values()), by_role
        time.sleep(0.02)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr.read()[-3000:]}")
    return {"wall": wall, **peak}


# What any tool that rewrites the checkpoint has to do at least: read every tensor, write it again.
_RESAVE = """
import sys
from pathlib import Path
from safetensors.torch import load_file, save_file
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
for file in sorted(src.glob("*.safetensors")):
    save_file(load_file(file), dst / file.name, metadata={"format": "pt"})
"""


def time_resave(src: Path, work: Path) -> dict:
    """One run of the baseline, measured like the conversions (the page cache is warm for both)."""
    dst = work / "resave"
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir()
    run = run_measured([sys.executable, "-c", _RESAVE, str(src), str(dst)])
    shutil.rmtree(dst)
    return run


def convert_both_ways(model: Path, work: Path, tp: int, tag: str) -> dict:
    megatron, back = work / f"megatron-{tag}", work / f"hf-{tag}"
    to_megatron = run_measured([sys.executable, str(SCRIPTS / "convert_hf_to_megatron.py"), "--tp", str(tp),
                                "--hf-dir", str(model), "--megatron-dir", str(megatron), "--force"])
    to_hf = run_measured([sys.executable, str(SCRIPTS / "convert_megatron_to_hf.py"), "--megatron-dir", str(megatron),
                          "--hf-dir", str(back), "--force"])
    return {"to_megatron": to_megatron, "to_hf": to_hf, "megatron_bytes": dir_bytes(megatron)}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def report(tp: int, text_layers: int, size: int, resaves: list[dict], bigs: list[dict], tiny: dict,
           load_before: float) -> str:
    base = min(run["wall"] for run in resaves)
    walls = ", ".join(f"{run['wall']:.1f} s" for run in resaves)
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs (1-minute load average "
               f"{load_before:.1f} before the runs, {os.getloadavg()[0]:.1f} after), "
               f"{_gib(psutil.virtual_memory().total)} RAM, no GPU, Python {platform.python_version()}")
    lines = [
        "# Converters: wall time and peak memory",
        "",
        f"Machine: {machine}. Conversions run on CPU (GPUs hidden), one intra-op thread per process.",
        "",
        f"Command: `python bench/convert_bench.py --tp {tp} --text-layers {text_layers} --repeat {len(bigs)}`. Model: random LLaVA "
        f"(Llama-style text, hidden {BIG_TEXT['hidden_size']}, {text_layers} layers, bfloat16, tiny CLIP), {_gib(size)} on disk. "
        f"Baseline: a fresh process loading every safetensors file of it whole and saving it again, run before "
        f"and after the conversions: {walls}; the faster ({base:.1f} s) counts; its peak PSS {_gib(min(run['pss'] for run in resaves))}. "
        f"Each conversion ran {len(bigs)} times: the fastest counts, as for the baseline; memory is the largest "
        "peak of the runs. Page cache warm for all.",
        "",
        "| direction | wall s, each run | wall / baseline (target <= 3) | peak PSS, all processes | PSS / size on disk (target <= 1.25) "
        "| peak RSS (sum over processes) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, label in (("to_megatron", f"HF -> Megatron TP{tp} ({tp} workers)"), ("to_hf", "Megatron -> HF (1 process)")):
        runs = [big[name] for big in bigs]
        wall, pss, rss = min(m["wall"] for m in runs), max(m["pss"] for m in runs), max(m["rss"] for m in runs)
        each = ", ".join(f"{m['wall']:.1f}" for m in runs)
        lines.append(f"| {label} | {each} | {wall / base:.2f} | {_gib(pss)} "
                     f"| {pss / size:.2f} | {_gib(rss)} |")
    lines += [
        "",
        "Fixed cost, the same commands on the tiny test model (a few MB): HF -> Megatron "
        f"{tiny['to_megatron']['wall']:.1f} s, peak PSS {_gib(tiny['to_megatron']['pss'])}; "
        f"Megatron -> HF {tiny['to_hf']['wall']:.1f} s, peak PSS {_gib(tiny['to_hf']['pss'])}. "
        "This is process start and imports: torch and transformers in the command's process (and its helper "
        "process), torch and megatron-core once more in the fork server the HF -> Megatron workers are forked from.",
        "",
        "PSS at its peak in the first run, by process role (GiB): "
        + "; ".join(f"{label}: " + ", ".join(f"{role} {n / 2**30:.2f}" for role, n in bigs[0][name]["pss_by_role"].items())
                    for name, label in (("to_megatron", "HF -> Megatron"), ("to_hf", "Megatron -> HF"))) + ".",
        "",
        f"Megatron checkpoint written: {_gib(bigs[0]['megatron_bytes'])}.",
    ]
    return "\n".join(lines) + "\n"


@click.command()
@click.option("--tp", type=int, default=2, show_default=True)
@click.option("--text-layers", type=int, default=BIG_TEXT["num_layers"], show_default=True,
              help="Layers of the benchmark model's text model (its size).")
@click.option("--repeat", type=click.IntRange(min=1), default=2, show_default=True,
              help="Runs of each conversion of the benchmark model; the fastest counts.")
@click.option("--work-dir", type=click.Path(file_okay=False), help="Keep the models here (default: a temporary directory).")
@click.option("--out", type=click.Path(dir_okay=False), default=str(REPO_ROOT / "bench/results/convert.md"), show_default=True)
def main(tp, text_layers, repeat, work_dir, out):
    with tempfile.TemporaryDirectory(prefix="convert-bench-") as tmp:
        work = Path(work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        models = build_models(work, text_layers)
        size = dir_bytes(models["big"])
        load_before = os.getloadavg()[0]
        # The two baseline runs bracket the conversions, so that a busy spell of the machine's
        # other jobs is less likely to fall on both.
        resaves = [time_resave(models["big"], work)]
        tiny = convert_both_ways(models["tiny"], work, tp, "tiny")
        bigs = [convert_both_ways(models["big"], work, tp, "big") for _ in range(repeat)]
        resaves.append(time_resave(models["big"], work))
        text = report(tp, text_layers, size, resaves, bigs, tiny, load_before)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    click.echo(text)


if __name__ == "__main__":
    main()
