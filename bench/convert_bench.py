"""HF -> Megatron (TP2) and back on a random ~1 GB LLaVA: wall time vs `cp`, peak memory vs size on disk.

    python bench/convert_bench.py [--tp 2] [--work-dir DIR] [--out bench/results/convert.md]

The model is built locally (no download): a random Llama-style text model (hidden 1536, 10 layers,
GQA 12/4 heads, FFN 4096, fp32) with a tiny CLIP tower, assembled by build_llava_jp's code.
Each conversion runs as the user runs it (the script in a fresh process); its process tree is
sampled every 20 ms and the peak of the summed RSS and PSS is reported (PSS splits pages shared
between processes, such as torch's libraries, so it does not count them once per process).
The same conversions of the tiny test model give the fixed cost (process start, imports).
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = REPO_ROOT / "scripts" / "convert"


def build_models(work: Path) -> dict[str, Path]:
    from megatron_ext.hf.build_llava import build_llava
    from megatron_ext.hf.tiny_models import TinyTextSpec, make_text_model, make_vision_model

    big_text = make_text_model(work / "text-1gb", TinyTextSpec(hidden_size=1536, num_layers=10, num_heads=12,
                                                               num_kv_heads=4, intermediate_size=4096, initializer_range=0.02))
    tiny_text = make_text_model(work / "text-tiny")
    clip = make_vision_model(work / "clip", "clip")
    return {"1gb": build_llava(work / "llava-1gb", str(big_text), str(clip)),
            "tiny": build_llava(work / "llava-tiny", str(tiny_text), str(clip))}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _roles(root: psutil.Process) -> dict[str, list[psutil.Process]]:
    """The converter process, its direct children (the rank workers) and everything below them
    (the torch_dist writer's forked writers, multiprocessing helpers)."""
    try:
        workers = root.children()
        helpers = [p for w in workers for p in w.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    return {"converter": [root], "workers": workers, "helpers": helpers}


def run_measured(cmd: list[str]) -> dict:
    """Wall time, and peak summed RSS / PSS of `cmd`'s process tree (with the PSS by role at that peak)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
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


def time_cp(src: Path, work: Path, repeats: int = 3) -> list[float]:
    """Wall times of `cp -r src` (the first copy only warms the page cache and is not counted)."""
    times = []
    for i in range(repeats + 1):
        dst = work / f"cp-{i}"
        start = time.perf_counter()
        subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
        times.append(time.perf_counter() - start)
        shutil.rmtree(dst)
    return times[1:]


def convert_both_ways(model: Path, work: Path, tp: int, tag: str) -> dict:
    megatron, back = work / f"megatron-{tag}", work / f"hf-{tag}"
    to_megatron = run_measured([sys.executable, str(SCRIPTS / "convert_hf_to_megatron.py"), "--tp", str(tp),
                                "--hf-dir", str(model), "--megatron-dir", str(megatron), "--force"])
    to_hf = run_measured([sys.executable, str(SCRIPTS / "convert_megatron_to_hf.py"), "--megatron-dir", str(megatron),
                          "--hf-dir", str(back), "--force"])
    return {"to_megatron": to_megatron, "to_hf": to_hf, "megatron_bytes": dir_bytes(megatron)}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def report(tp: int, size: int, cp_times: list[float], big: dict, tiny: dict) -> str:
    cp = statistics.median(cp_times)
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs (1-minute load average "
               f"{os.getloadavg()[0]:.1f} after the runs), {_gib(psutil.virtual_memory().total)} RAM, no GPU, "
               f"Python {platform.python_version()}")
    lines = [
        "# Converters: wall time and peak memory",
        "",
        f"Machine: {machine}. Conversions run on CPU (GPUs hidden), one thread per process.",
        "",
        f"Command: `python bench/convert_bench.py --tp {tp}`. Model: random LLaVA (Llama-style text, hidden 1536, "
        f"10 layers, fp32, tiny CLIP), {_gib(size)} on disk; `cp -r` of that directory: median {cp:.2f} s of "
        f"{len(cp_times)} ({min(cp_times):.2f}-{max(cp_times):.2f} s; page cache warm, as for the conversions). "
        "'minus fixed' subtracts the same command's time on the tiny test model (below).",
        "",
        "| direction | wall s | wall / cp | minus fixed, / cp | peak RSS (sum over processes) | RSS / size on disk "
        "| peak PSS | PSS / size on disk |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, label in (("to_megatron", f"HF -> Megatron TP{tp} ({tp} workers)"), ("to_hf", "Megatron -> HF (1 process)")):
        m = big[name]
        marginal = (m["wall"] - tiny[name]["wall"]) / cp
        lines.append(f"| {label} | {m['wall']:.1f} | {m['wall'] / cp:.1f} | {marginal:.1f} | {_gib(m['rss'])} | {m['rss'] / size:.2f} "
                     f"| {_gib(m['pss'])} | {m['pss'] / size:.2f} |")
    lines += [
        "",
        "Fixed cost, the same commands on the tiny test model (a few MB): HF -> Megatron "
        f"{tiny['to_megatron']['wall']:.1f} s, peak RSS {_gib(tiny['to_megatron']['rss'])} (PSS {_gib(tiny['to_megatron']['pss'])}); "
        f"Megatron -> HF {tiny['to_hf']['wall']:.1f} s, peak RSS {_gib(tiny['to_hf']['rss'])} (PSS {_gib(tiny['to_hf']['pss'])}). "
        "This is process start, importing torch / megatron-core / transformers in every process, and the "
        "torch_dist writer's helper processes.",
        "",
        "PSS at its peak, by process role (GiB): "
        + "; ".join(f"{label}: " + ", ".join(f"{role} {n / 2**30:.2f}" for role, n in big[name]["pss_by_role"].items())
                    for name, label in (("to_megatron", "HF -> Megatron"), ("to_hf", "Megatron -> HF"))) + ".",
        "",
        f"Megatron checkpoint written: {_gib(big['megatron_bytes'])}.",
    ]
    return "\n".join(lines) + "\n"


@click.command()
@click.option("--tp", type=int, default=2, show_default=True)
@click.option("--work-dir", type=click.Path(file_okay=False), help="Keep the models here (default: a temporary directory).")
@click.option("--out", type=click.Path(dir_okay=False), default=str(REPO_ROOT / "bench/results/convert.md"), show_default=True)
def main(tp, work_dir, out):
    with tempfile.TemporaryDirectory(prefix="convert-bench-") as tmp:
        work = Path(work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        models = build_models(work)
        size = dir_bytes(models["1gb"])
        cp_times = time_cp(models["1gb"], work)
        tiny = convert_both_ways(models["tiny"], work, tp, "tiny")
        big = convert_both_ways(models["1gb"], work, tp, "1gb")
        text = report(tp, size, cp_times, big, tiny)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    click.echo(text)


if __name__ == "__main__":
    main()
