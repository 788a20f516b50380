"""Running a command inside a Singularity/Apptainer image (`--sif-path`).

The launcher and the converters build their container command here, so both bind the same
directories and pick the runtime the same way.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from megatron_ext.errors import UserError

RUNTIMES = ("singularity", "apptainer")


def installed_runtime() -> str | None:
    """`singularity`, or `apptainer` where that is the installed name; None when neither is."""
    return next((name for name in RUNTIMES if shutil.which(name)), None)


def container_runtime() -> str:
    runtime = installed_runtime()
    if runtime is None:
        raise UserError("--sif-path needs singularity or apptainer on PATH; neither was found")
    return runtime


def check_sif(sif: str | Path, flag: str = "--sif-path") -> Path:
    sif = Path(sif).expanduser().resolve()
    if not sif.is_file():
        raise UserError(f"{flag} {sif} does not exist; build it with: singularity build --nv --fakeroot {sif} environments/recipe_latest.def")
    return sif


def bind_args(paths) -> list[str]:
    """`--bind p:p` for every existing directory in `paths` (files bind their parent), deduplicated."""
    seen: list[str] = []
    for path in paths:
        if path is None:
            continue
        path = Path(path).expanduser().resolve()
        target = path if path.is_dir() else path.parent
        if target.exists() and str(target) not in seen:
            seen.append(str(target))
    args = []
    for target in seen:
        args += ["--bind", f"{target}:{target}"]
    return args


def checkout_root() -> Path | None:
    """The source checkout this package runs from, None for an installed copy (site-packages)."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() else None


def container_command(sif: str | Path, command: list[str], binds=(), env: dict[str, str] | None = None,
                      runtime: str | None = None) -> list[str]:
    """`<runtime> exec --nv [--bind ...] [--env ...] SIF command...`.

    The working directory is bound. Run from a checkout, the checkout is bound too and goes first
    on PYTHONPATH, so the code you are editing runs, not the copy installed when the image was
    built; run from an installed package, the image's own copy runs (binding the host's
    site-packages would put the host's libraries in front of the image's).
    """
    runtime = runtime or container_runtime()
    checkout = checkout_root()
    env = {**({"PYTHONPATH": str(checkout)} if checkout else {}), **(env or {})}
    env_args = [arg for key, value in env.items() for arg in ("--env", f"{key}={value}")]
    return [runtime, "exec", "--nv", *bind_args([Path.cwd(), checkout, *binds]), *env_args, str(sif), *command]


def container_env(env: dict[str, str], runtime: str) -> dict[str, str]:
    """`env` as `<RUNTIME>ENV_NAME=value` host variables: set inside the image ahead of the image's own
    environment, and, unlike `--env NAME=value`, kept whole when a value has commas (CUDA_VISIBLE_DEVICES=0,1)."""
    return {f"{runtime.upper()}ENV_{key}": value for key, value in env.items()}


def strip_option(argv: list[str], option: str) -> list[str]:
    """argv without `option VALUE` / `option=VALUE` (to re-run a CLI inside the image)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


def rerun_in_container(sif: str | Path, program: list[str], args: list[str], binds=()) -> None:
    """Run `python PROGRAM ARGS` (a script path, or -m MODULE ...) inside the image, ARGS without
    `--sif-path`, and exit with its status."""
    sif = check_sif(sif)
    command = container_command(sif, ["python", *program, *strip_option(args, "--sif-path")], binds)
    print("+ " + " ".join(command), file=sys.stderr, flush=True)
    sys.exit(subprocess.call(command))
