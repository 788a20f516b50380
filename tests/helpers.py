"""Running real scripts and torchrun jobs from tests: always with a timeout, always in a process
group of their own that is killed afterwards, so no trainer outlives its test."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


_DISTRIBUTED_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(gpu: bool = False, **extra: str) -> dict[str, str]:
    """This environment minus torch.distributed's variables (a child starts its own world). CPU tests'
    children see no GPU, so they run the same on a machine that has one; `gpu=True` keeps them visible."""
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_VARS}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`, its process group and every process it started: torchrun starts each rank in
    a session of its own, so the group alone would leave the ranks running (as a node failure would not)."""
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    proc.wait()
    psutil.wait_procs(family, timeout=30)


@contextlib.contextmanager
def started(cmd: list[str], **popen):
    """`cmd` started in a new process group, killed with everything it started when the block ends."""
    popen.setdefault("env", child_env())
    popen.setdefault("cwd", REPO_ROOT)
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    try:
        yield proc
    finally:
        kill_tree(proc)


def run(cmd: list[str], *, timeout: float, env: dict | None = None, check: bool = True,
        cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`cmd` with output captured; a hang fails the test after `timeout` s, its process group killed."""
    with started(cmd, env=env or child_env(), cwd=cwd or REPO_ROOT, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, text=True) as proc:
        out, err = proc.communicate(timeout=timeout)
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-6000:]}")
    return result


def run_python(path: str | Path, *args, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """`python path args...` (a path relative to the repository root, or absolute)."""
    return run([sys.executable, str(REPO_ROOT / path), *map(str, args)], timeout=timeout, **kwargs)


def run_script(script: str, *args, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """`python scripts/<script> args...`."""
    return run_python(Path("scripts") / script, *args, timeout=timeout, **kwargs)


def run_torchrun(nproc: int, target: str, *args, timeout: float = 300, env: dict | None = None,
                 check: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N target args...` (target: a .py path or `-m module`);
    --standalone has torchrun bind a free port itself. For tests of what torchrun itself does; other
    jobs run under `run_ranks`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *_target(target), *map(str, args)]
    return run(cmd, timeout=timeout, env=env, check=check)


def _target(target: str) -> list[str]:
    return target.split() if target.startswith("-m ") else [target]


def run_ranks(nproc: int, target: str, *args, timeout: float = 300, env: dict | None = None,
              check: bool = True) -> subprocess.CompletedProcess:
    """`target args...` (a .py path or `-m module`) on `nproc` ranks, as torchrun starts them (env://
    variables, a free port on this machine), without torchrun's own process, which spends seconds of a
    test's CPU importing torch at every launch. As under torchrun, the first rank to fail stops the
    others and the job fails; a hang fails the test after `timeout` s. The ranks' output is merged.
    The exit status is the first failing rank's (torchrun's is 1)."""
    import tempfile
    import time

    from megatron_ext.launch.network import take_free_port

    cmd = [sys.executable, *_target(target), *map(str, args)]
    # Claimed as run.py claims its port: the other pytest worker's job cannot pick it at the same moment.
    base, port = env or child_env(), str(take_free_port())
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, contextlib.ExitStack() as ranks:
        procs = [ranks.enter_context(started(cmd, cwd=REPO_ROOT, stdout=out, stderr=err, env={
            **base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}))
            for rank in range(nproc)]
        deadline, status = time.monotonic() + timeout, None
        while status is None:
            codes = [proc.poll() for proc in procs]
            status = next((code for code in codes if code), 0 if all(c == 0 for c in codes) else None)
            if status is None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(cmd, timeout)
            time.sleep(0.05)
        for proc in procs:  # a failure: give the others a moment to exit on their own, then stop them
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5 if status else None)
        ranks.close()
        out.seek(0)
        err.seek(0)
        result = subprocess.CompletedProcess(cmd, status, out.read(), err.read())
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} on {nproc} ranks exited {result.returncode}\n--- stdout\n"
                             f"{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-6000:]}")
    return result


def hf_tensors(hf_dir: Path) -> dict:
    """Every tensor of an HF checkpoint directory (all its safetensors files), by stored name."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors
