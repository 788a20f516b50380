"""Wheels for a GPU machine that cannot reach a package index: what megatron-ext needs there beyond the
packages it already has, fetched here for its Python.

    .venv312/bin/python bench/gpu_wheels.py --present present.txt --dest .whl

Run it with an environment of the target's Python version in which megatron-ext is installed (the
versions it resolved are the ones fetched). `--present`: a file naming the target's packages (pip
names, separated by commas, spaces or lines). Every distribution megatron-ext requires, directly or
not, that is not present is downloaded as a manylinux / pure wheel for this Python; one published only
as source is built into a wheel here (pure Python ones only travel). Install them there with
`pip install --no-index --no-deps --target DIR DEST/*.whl`. Prints each wheel and the total size.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import subprocess
import sys
from pathlib import Path

import click
from packaging.requirements import Requirement

# Imported by no benchmark or GPU test: the evaluation metrics (scripts/eval), wandb, and energon's S3
# access (s3fs, which brings botocore; local shards need none). 143 MiB of the 197 that megatron-ext's
# needs beyond the lent H200's image came to (2026-11-30), where 64 MiB travel in a call.
SKIPPED = ("pycocoevalcap", "rouge-score", "wandb", "s3fs")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def required(root: str, skipped: set[str], extras: tuple[str, ...] = ()) -> dict[str, str]:
    """{canonical name: installed version} of `root` and everything it requires here, transitively
    (requirements whose markers hold in this environment; `root`'s `extras` too, no others), except
    `skipped` and what only they require."""
    found, queue = {}, [(root, ("",) + extras)]
    while queue:
        name, wanted = queue.pop()
        name = canonical(name)
        if name in found or name in skipped:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a requirement this environment skipped (its marker) or a stdlib backport
        found[name] = dist.version
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or any(requirement.marker.evaluate({"extra": e}) for e in wanted):
                queue.append((requirement.name, ("",)))
    return found


def download(name: str, version: str, dest: Path) -> None:
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    fetch = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
             python, "--implementation", "cp", *[f"--platform={p}" for p in PLATFORMS], "-d", str(dest),
             f"{name}=={version}"]
    if subprocess.run(fetch, capture_output=True).returncode != 0:
        # Published as source only: a wheel built here (it travels if it is pure Python).
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), f"{name}=={version}"],
                       check=True)


@click.command()
@click.option("--present", "present_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="The target's installed packages, by name.")
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path), default=Path(".whl"), show_default=True)
@click.option("--root", default="megatron-ext", show_default=True, help="The distribution whose needs are fetched.")
@click.option("--skip", multiple=True, default=SKIPPED, show_default=True,
              help="Requirements the GPU runs never import, left behind with what only they need.")
@click.option("--extra", "extras", multiple=True, metavar="NAME",
              help="Also the root's optional dependencies NAME (e.g. liger: bench/gpu_bench.py --hf with "
                   "Liger-Kernel); install them here first.")
@click.option("--pin", multiple=True, metavar="NAME==VERSION",
              help="Fetch this version instead of the installed one (e.g. megatron-core==0.16.1, the release the "
                   "first leases ran).")
def main(present_file: Path, dest: Path, root: str, skip: tuple[str, ...], extras: tuple[str, ...],
         pin: tuple[str, ...]):
    present = {canonical(name) for name in re.split(r"[,\s]+", present_file.read_text().strip().rstrip(".")) if name}
    needed = required(root, {canonical(name) for name in skip}, extras)
    for given in pin:
        name, _, version = given.partition("==")
        if canonical(name) not in needed or not version:
            raise click.BadParameter(f"{given!r}: give NAME==VERSION of a package {root} needs", param_hint="--pin")
        needed[canonical(name)] = version
    missing = {name: version for name, version in needed.items() if name not in present and name != root}
    dest.mkdir(parents=True, exist_ok=True)
    for name, version in sorted(missing.items()):
        download(name, version, dest)
    wheels = sorted(dest.glob("*.whl"))
    for wheel in wheels:
        click.echo(f"{wheel.stat().st_size / 2 ** 20:7.1f} MiB  {wheel.name}")
    click.echo(f"{sum(w.stat().st_size for w in wheels) / 2 ** 20:7.1f} MiB in {len(wheels)} wheels ({dest})")


if __name__ == "__main__":
    main()
