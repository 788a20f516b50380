"""How long `run.py --dry-run` takes for the original README's stage-2 example (target: under 0.5 s),
and with its memory plan for llava-1.5-7b's shape (target: under 10 s).

    python bench/launcher_dryrun.py [--repeats 15] [--out bench/results/launcher.md]

Inputs are built in a temporary directory, sized like a real run: a 1000-shard prepared dataset
(the README's 000000.tar ... 000999.tar), a converted-checkpoint directory, and either a small
tokenizer or one the size of Qwen2's tokenizer.json (152k vocabulary, 151k merges, ~7 MB), since
the launcher reads the tokenizer's JSON to find the image and pad token ids. `singularity` is a
stand-in on PATH (a dry run only looks it up). Each timing is the wall time of a fresh
`python scripts/train/run.py ... --dry-run` process, interpreter start included.

The memory-plan case is a converted checkpoint's directory without weights: its metadata holds
llava-1.5-7b-hf's config completed as the converter stores it (tests/shapes/), so run.py builds the
7B model on PyTorch's meta device for the plan (torch and megatron-core imported, no weights read).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from megatron_ext.checkpoint import layout
from megatron_ext.families import complete_llava_config

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # the test fixtures' writers build the inputs
from tests.support.launcher import HF_CONFIG, make_standins, write_prepared_dataset, write_tokenizer  # noqa: E402

RUN_PY = REPO_ROOT / "scripts" / "train" / "run.py"
SHAPE_7B = REPO_ROOT / "tests" / "shapes" / "llava" / "llava-hf--llava-1.5-7b-hf.json"
PLAN_REPEATS = 3  # each run builds a 7B model on meta: seconds, not milliseconds


def _large_tokenizer(directory: Path) -> Path:
    """A BPE tokenizer.json with Qwen2's vocabulary and merge counts (content is synthetic)."""
    # The ids the bench checkpoint's model was built with; only the file's size matters here.
    write_tokenizer(directory, {"<image>": 32000, "<pad>": 32001})
    data = json.loads((directory / "tokenizer.json").read_text())
    data["model"]["vocab"] = {f"tok{i:06d}": i for i in range(151643)}
    data["model"]["merges"] = [f"tok{i:06d} tok{i + 1:06d}" for i in range(151387)]
    (directory / "tokenizer.json").write_text(json.dumps(data))
    return directory


def _inputs(root: Path) -> dict[str, Path]:
    shards = {f"{i:06d}.tar": 1000 for i in range(1000)}
    names = sorted(shards)
    data = write_prepared_dataset(root / "energon", shards, {"train": names[:900], "val": names[900:], "test": []})
    checkpoint = root / "megatron"
    (checkpoint / layout.RELEASE).mkdir(parents=True)
    layout.write_metadata(checkpoint / layout.RELEASE, kind="converted", iteration=0, hf_config=HF_CONFIG, tp=4, pp=1,
                          dtype="bfloat16")
    layout.mark_latest(checkpoint, layout.RELEASE)
    sif = root / "demo.sif"
    sif.write_text("image")
    return {"data": data, "checkpoint": checkpoint, "sif": sif, "checkpoint-7b": _checkpoint_7b(root / "megatron-7b"),
            "small": write_tokenizer(root / "hf-small", {"<image>": 32000, "<pad>": 32001}),
            "large": _large_tokenizer(root / "hf-large")}


def _checkpoint_7b(checkpoint: Path) -> Path:
    hf_config = complete_llava_config(json.loads(SHAPE_7B.read_text()))
    (checkpoint / layout.RELEASE).mkdir(parents=True)
    layout.write_metadata(checkpoint / layout.RELEASE, kind="converted", iteration=0, hf_config=hf_config, tp=1, pp=1,
                          dtype="bfloat16")
    layout.mark_latest(checkpoint, layout.RELEASE)
    write_tokenizer(checkpoint / layout.TOKENIZER_DIR, {"<image>": hf_config["image_token_index"], "<pad>": 32001})
    return checkpoint


def _plan_7b_args(paths: dict[str, Path], save_dir: Path) -> list[str]:
    """Stage 2 on 8 GPUs at TP4, packed to 4096: the run docs/gpu.md plans."""
    return ["-g", "8", "--tp", "4", "--megatron-load-dir", str(paths["checkpoint-7b"]), "--save-dir", str(save_dir),
            "--stage", "2", "--data-path", str(paths["data"]), "--dry-run", "--", "--seq-length", "4096",
            "--packing-seq-length", "4096"]


def _stage2_args(paths: dict[str, Path], tokenizer: Path, save_dir: Path) -> list[str]:
    """The README's stage-2 example, plus the --data-path it left implicit."""
    return ["-g", "8", "--tp", "4", "--pp", "1", "--node", "1", "--name", "llavajp13b-tp4-pp1-dp2-stage2",
            "--megatron-load-dir", str(paths["checkpoint"]), "--save-dir", str(save_dir),
            "--tokenizer-load-dir", str(tokenizer), "--sif-path", str(paths["sif"]), "--stage", "2",
            "--save-interval", "2000", "--wandb", "--data-path", str(paths["data"]), "--dry-run"]


def _time_interleaved(cases: dict[str, list[str]], env: dict, repeats: int) -> dict[str, list[float]]:
    """Wall times of each case, run in interleaved rounds so load from other processes hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, argv in cases.items():
            start = time.perf_counter()
            subprocess.run(argv, env=env, check=True, capture_output=True, timeout=60)
            times[name].append(time.perf_counter() - start)
    return times


def _in_process(paths: dict[str, Path], repeats: int) -> list[str]:
    """Medians of the two input-dependent steps, measured inside this process (imports already done)."""
    from megatron_ext.config.tokenizer_files import TokenizerFiles
    from megatron_ext.data.prepared import split_counts

    steps = {"count samples: split_counts(1000-shard dataset)": lambda: split_counts(paths["data"]),
             "read token ids: Qwen2-size tokenizer.json": lambda: TokenizerFiles(paths["large"]).image_token_id(),
             "read token ids: small tokenizer": lambda: TokenizerFiles(paths["small"]).image_token_id()}
    rows = []
    for name, step in steps.items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        rows.append(_row(name, times))
    return rows


def _row(name: str, times: list[float]) -> str:
    return (f"| {name} | {statistics.median(times) * 1000:.0f} | {min(times) * 1000:.0f} | "
            f"{max(times) * 1000:.0f} |")


@click.command()
@click.option("--repeats", default=15, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=REPO_ROOT / "bench/results/launcher.md",
              show_default=True)
def main(repeats: int, out: Path):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = _inputs(root)
        bin_dir = make_standins(root / "bin", ("singularity",))
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        cases = {"python -c pass (interpreter start)": [sys.executable, "-c", "pass"]}
        for label, tokenizer in (("small tokenizer", paths["small"]), ("Qwen2-size tokenizer.json (7 MB)", paths["large"])):
            cases[f"run.py --dry-run, README stage 2, 1000 shards, {label}"] = \
                [sys.executable, str(RUN_PY), *_stage2_args(paths, tokenizer, root / "save")]
        # Without the memory plan run.py imports no torch: the launcher's own cost.
        cases["run.py --dry-run --no-memory-check, README stage 2, 1000 shards, small tokenizer"] = \
            [sys.executable, str(RUN_PY), *_stage2_args(paths, paths["small"], root / "save"), "--no-memory-check"]
        load_before = os.getloadavg()[0]
        rows = [_row(name, times) for name, times in _time_interleaved(cases, env, repeats).items()]
        plan_case = {"run.py --dry-run with its memory plan, llava-1.5-7b's shape, -g 8 --tp 4, packed to 4096":
                     [sys.executable, str(RUN_PY), *_plan_7b_args(paths, root / "save-7b")]}
        rows += [_row(name, times) for name, times in _time_interleaved(plan_case, env, PLAN_REPEATS).items()]
        steps = _in_process(paths, repeats)
        command = subprocess.run([sys.executable, str(RUN_PY), *_stage2_args(paths, paths["small"], root / "save")],
                                 env=env, capture_output=True, text=True, check=True).stdout.strip()

    load_after = os.getloadavg()[0]
    report = "\n".join([
        "# Launcher: `run.py --dry-run` wall time",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs (1-minute load average "
        f"{load_before:.1f} before, {load_after:.1f} after), no GPU, Python {platform.python_version()}. "
        f"Each run is a fresh process; {repeats} interleaved rounds.",
        "",
        "Command: `python bench/launcher_dryrun.py` (inputs described in its docstring). Targets: < 500 ms "
        f"without the memory plan; with the memory plan of a 7B model, < 10 s ({PLAN_REPEATS} rounds). The plan "
        "imports torch and megatron-core and builds each kind of rank's model on the meta device: seconds.",
        "",
        "| case | median ms | min ms | max ms |",
        "|---|---:|---:|---:|",
        *rows,
        "",
        "Where the input-dependent time goes (inside one process, imports done):",
        "",
        "| step | median ms | min ms | max ms |",
        "|---|---:|---:|---:|",
        *steps,
        "",
        "No nvidia-smi on this machine, so the GPU probe costs one failed exec; on a GPU node "
        "`nvidia-smi -L` adds its own start-up time.",
        "",
        "Printed command (paths shortened to the temporary directory):",
        "",
        "```",
        command.replace(tmp, "$TMP"),
        "```",
        "",
    ])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
