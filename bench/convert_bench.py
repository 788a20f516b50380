"""HF -> Megatron (TP2, or any TP x PP) and back on a random bf16 LLaVA: wall time against a plain
safetensors load + save of the same tensors, peak memory against the size on disk.

    python bench/convert_bench.py [--tp 2] [--pp 1] [--text-layers 18] [--repeat 2] [--work-dir DIR] [--out FILE]
    python bench/convert_bench.py --shape tests/shapes/llava/llava-hf--llava-1.5-7b-hf.json --tp 4 --pp 2 [--text-layers N]

The model is built locally (no download): a random Llama-style text model (hidden 2048, 18 layers,
GQA 16/4 heads, FFN 5632, bfloat16) with a tiny CLIP tower, assembled by build_llava_jp's code;
`--text-layers` scales it (84 MiB a layer) to see how the fixed cost weighs at other sizes.
With `--shape` it is instead a Hub-style checkpoint of a published config.json at its full size
(llava-1.5-7b: 7.06 B parameters, 13.2 GiB), random weights in 5 GB shards with their index, written
by tests/support/random_checkpoint.py; `--text-layers` then replaces the published count.
Big models need disk and time: the model, the Megatron checkpoint and the converted-back copy are on
disk at once (3x the model; each conversion's outputs are deleted once measured), and llava-1.5-7b
at TP4 x PP2 with `--repeat 1` took 14-16 minutes on the 2-core machine.
The baseline loads every safetensors file of the model whole and saves it again, in a fresh
process (python, torch, safetensors), run twice (before and after the conversions): the faster
counts, as the machine is shared; each conversion of the benchmark model runs `--repeat` times, and
its fastest run counts likewise.
Each conversion runs as the user runs it (the script in a fresh process). Every command's process
tree is sampled every 20 ms and the peak of the summed RSS and PSS is reported (PSS splits pages
shared between processes, such as torch's libraries, so it does not count them once per process).
The same conversions of a tiny test model at the same layout give the fixed cost (process start, imports).
"""

from __future__ import annotations

import math
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
sys.path.insert(0, str(REPO_ROOT))  # tests/support writes the full-size random checkpoint
# Llama-style, ~0.8 B parameters: 1.5 GiB in bfloat16.
BIG_TEXT = dict(hidden_size=2048, num_layers=18, num_heads=16, num_kv_heads=4, intermediate_size=5632)


def _build_llava(out: Path, work: Path, text_spec, vision_spec) -> Path:
    """A random bf16 LLaVA of these tiny-model specs (a CLIP tower), once per work directory (kept if already there)."""
    from megatron_ext.demo.tiny_models import make_text_model, make_vision_model
    from megatron_ext.hf.build_llava import build_llava

    if not out.is_dir():
        text = make_text_model(work / "text", text_spec)
        clip = make_vision_model(work / "clip", "clip", vision_spec)
        build_llava(out, str(text), str(clip), dtype="bfloat16", force=True)
        for scratch in (text, clip):
            shutil.rmtree(scratch)
    return out


def build_big(work: Path, text_layers: int) -> Path:
    from megatron_ext.demo.tiny_models import TinyTextSpec, TinyVisionSpec

    return _build_llava(work / f"llava-big-{text_layers}layers", work,
                        TinyTextSpec(**{**BIG_TEXT, "num_layers": text_layers}, initializer_range=0.02), TinyVisionSpec())


def build_tiny(work: Path, tp: int, pp: int) -> Path:
    """The tiny test model, with heads that TP splits and text layers that PP splits."""
    from megatron_ext.demo.tiny_models import TinyTextSpec, TinyVisionSpec

    text = TinyTextSpec(num_heads=max(TinyTextSpec.num_heads, tp), num_kv_heads=max(TinyTextSpec.num_kv_heads, tp),
                        num_layers=max(TinyTextSpec.num_layers, pp))
    return _build_llava(work / f"llava-tiny-tp{tp}pp{pp}", work, text,
                        TinyVisionSpec(num_heads=max(TinyVisionSpec.num_heads, tp)))


def generate(work: Path, shape: Path, text_layers: int | None) -> tuple[Path, float | None]:
    """The Hub-style checkpoint of the published config `shape` with random weights, and the seconds
    writing it took (None: kept from an earlier run in the work directory)."""
    import json

    from megatron_ext.errors import UserError
    from tests.support.random_checkpoint import write_random_checkpoint

    try:
        config = json.loads(shape.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"--shape {shape} is not valid JSON ({exc})") from exc
    out = work / (f"{shape.stem}-{text_layers}layers" if text_layers else shape.stem)
    if out.is_dir():
        return out, None
    start = time.perf_counter()
    write_random_checkpoint(config, out, layers=text_layers)
    return out, time.perf_counter() - start


def parameters(model: Path) -> int:
    from safetensors import safe_open

    count = 0
    for file in model.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            count += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return count


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
    # stderr goes to a file: a pipe read only at the end would block the command once full (8 ranks' warnings).
    errors = tempfile.TemporaryFile("w+")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=errors, env=env, text=True)
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
    with errors:
        if proc.returncode != 0:
            errors.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{errors.read()[-3000:]}")
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


def convert_both_ways(model: Path, work: Path, tp: int, pp: int, tag: str) -> dict:
    """Both conversions, measured; their outputs are deleted afterwards (a big model's would fill the disk)."""
    megatron, back = work / f"megatron-{tag}", work / f"hf-{tag}"
    to_megatron = run_measured([sys.executable, str(SCRIPTS / "convert_hf_to_megatron.py"), "--tp", str(tp),
                                "--pp", str(pp), "--hf-dir", str(model), "--megatron-dir", str(megatron), "--force"])
    to_hf = run_measured([sys.executable, str(SCRIPTS / "convert_megatron_to_hf.py"), "--megatron-dir", str(megatron),
                          "--hf-dir", str(back), "--force"])
    megatron_bytes = dir_bytes(megatron)
    for output in (megatron, back):
        shutil.rmtree(output)
    return {"to_megatron": to_megatron, "to_hf": to_hf, "megatron_bytes": megatron_bytes}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def report(command: str, model: str, layout: str, size: int, resaves: list[dict], bigs: list[dict], tiny: dict,
           load_before: float) -> str:
    base = min(run["wall"] for run in resaves)
    walls = ", ".join(f"{run['wall']:.1f} s" for run in resaves)
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs (1-minute load average "
               f"{load_before:.1f} before the runs, {os.getloadavg()[0]:.1f} after), "
               f"{_gib(psutil.virtual_memory().total)} RAM, no GPU, Python {platform.python_version()}")
    lines = [
        "# Converters: wall time and peak memory",
        "",
        f"Machine: {machine}. Conversions run on CPU (GPUs hidden), one intra-op thread per process. "
        f"Date: {time.strftime('%Y-%m-%d')}.",
        "",
        f"Command: `{command}`. Model: {model}, {_gib(size)} on disk. "
        f"Baseline: a fresh process loading every safetensors file of it whole and saving it again, run before "
        f"and after the conversions: {walls}; the faster ({base:.1f} s) counts; its peak PSS {_gib(min(run['pss'] for run in resaves))}. "
        f"Each conversion ran {len(bigs)} times: the fastest counts, as for the baseline; memory is the largest "
        "peak of the runs. Page cache warm for all.",
        "",
        "| direction | wall s, each run | wall / baseline (target <= 3) | peak PSS, all processes | PSS / size on disk (target <= 1.25) "
        "| peak RSS (sum over processes) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, label in (("to_megatron", f"HF -> Megatron {layout}"), ("to_hf", "Megatron -> HF (1 process)")):
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
@click.option("--tp", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--shape", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A published LLaVA config.json (tests/shapes/llava/): benchmark a Hub-style checkpoint of it with "
                   "random weights at its full size instead of the built model.")
@click.option("--text-layers", type=click.IntRange(min=1),
              help=f"Text layers of the benchmark model (its size); default {BIG_TEXT['num_layers']}, with --shape the "
                   "published count.")
@click.option("--repeat", type=click.IntRange(min=1), default=2, show_default=True,
              help="Runs of each conversion of the benchmark model; the fastest counts.")
@click.option("--work-dir", type=click.Path(file_okay=False), help="Keep the models here (default: a temporary directory).")
@click.option("--out", type=click.Path(dir_okay=False),
              help="The report (default: bench/results/convert.md, with --shape convert-SHAPE[-Nlayers]-tpTppP.md).")
def main(tp, pp, shape, text_layers, repeat, work_dir, out):
    if not shape:
        text_layers = text_layers or BIG_TEXT["num_layers"]
    command = " ".join(["python bench/convert_bench.py", *(["--shape", str(shape)] if shape else []), "--tp", str(tp),
                        *(["--pp", str(pp)] if pp > 1 else []), *(["--text-layers", str(text_layers)] if text_layers else []),
                        "--repeat", str(repeat)])
    with tempfile.TemporaryDirectory(prefix="convert-bench-") as tmp:
        work = Path(work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if shape:
            big, model = published_model(work, shape, text_layers)
        else:
            big = build_big(work, text_layers)
            model = (f"random LLaVA (Llama-style text, hidden {BIG_TEXT['hidden_size']}, {text_layers} layers, "
                     "bfloat16, tiny CLIP)")
        tiny = build_tiny(work, tp, pp)
        size = dir_bytes(big)
        load_before = os.getloadavg()[0]
        # The two baseline runs bracket the conversions, so that a busy spell of the machine's
        # other jobs is less likely to fall on both.
        resaves = [time_resave(big, work)]
        tiny_runs = convert_both_ways(tiny, work, tp, pp, "tiny")
        bigs = [convert_both_ways(big, work, tp, pp, "big") for _ in range(repeat)]
        resaves.append(time_resave(big, work))
        layout = f"TP{tp}" + (f" x PP{pp}" if pp > 1 else "") + f" ({tp * pp} workers)"
        text = report(command, model, layout, size, resaves, bigs, tiny_runs, load_before)
    out = Path(out or REPO_ROOT / "bench/results" / (f"convert-{big.name}-tp{tp}pp{pp}.md" if shape else "convert.md"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    click.echo(text)


def published_model(work: Path, shape: Path, text_layers: int | None) -> tuple[Path, str]:
    """The checkpoint of --shape and its description."""
    model, seconds = generate(work, shape, text_layers)
    layers = f"{text_layers} text layers instead of the published count" if text_layers else "every layer as published"
    written = f", written in {seconds:.0f} s" if seconds is not None else ""
    files = len(list(model.glob("*.safetensors")))
    where = f"{files} safetensors shards of at most 5 GB and their index" if files > 1 else "one model.safetensors"
    return model, (f"a Hub-style checkpoint of `{shape.name}` ({layers}), {parameters(model) / 1e9:.2f} B parameters, "
                   f"random bfloat16 weights in {where} (`tests/support/random_checkpoint.py`{written})")


if __name__ == "__main__":
    from megatron_ext.errors import run_command

    run_command(main)
