"""Running real scripts and multi-rank jobs from tests: always with a timeout, always in a session of
their own that is killed afterwards, so no trainer outlives its test. A `python SCRIPT` (or `-m`)
job is forked from a server that has imported torch, megatron-core, transformers and energon once
(tests/support/prestarted.py says when it is not); `fresh=True` starts a new interpreter."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


DISTRIBUTED_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# The environment as the session started (tests/conftest.py's settings included), before any test ran:
# code under test sets variables in this process (megatron-core its attention backend's NVTE_*, our
# logging HF_HUB_DISABLE_PROGRESS_BARS), which a child would otherwise inherit from whichever test ran first.
_SESSION_ENV = dict(os.environ)


def child_env(gpu: bool = False, **extra: str) -> dict[str, str]:
    """The session's environment minus torch.distributed's variables (a child starts its own world).
    CPU tests' children see no GPU, so they run the same on a machine that has one; `gpu=True` keeps
    them visible."""
    env = {k: v for k, v in _SESSION_ENV.items() if k not in DISTRIBUTED_VARS}
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


def _launch(cmd: list[str], env: dict, cwd, stdout, stderr, fresh: bool, stdin=None):
    """`cmd`'s process in a session of its own: forked from the prestarted server where that runs it
    as a fresh process would (tests/support/prestarted.py), else started. `fresh` (or input on
    `stdin`, a file): always started."""
    from tests.support import prestarted

    if not fresh and stdin is None:
        server = prestarted.server()
        if server.serves(cmd, env):
            return server.start(cmd, env=env, cwd=cwd, stdout=stdout, stderr=stderr)
    return subprocess.Popen(cmd, start_new_session=True, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr)


def _run_job(cmd: list[str], envs: list[dict], *, timeout: float, cwd: Path, fresh: bool,
             stdin: str | None = None) -> subprocess.CompletedProcess:
    """`cmd` once per environment of `envs`, together, their output merged. As under torchrun, the
    first process to fail stops the others and its status is the job's; a hang fails the test after
    `timeout` s; nothing the job started outlives it. `stdin`: the input of a single process."""
    import tempfile
    import time

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, contextlib.ExitStack() as stack:
        source = None
        if stdin is not None:
            source = stack.enter_context(tempfile.TemporaryFile("w+"))
            source.write(stdin)
            source.seek(0)
        procs = []
        for env in envs:
            proc = _launch(cmd, env, cwd, out, err, fresh, source)
            stack.callback(kill_tree, proc)
            procs.append(proc)
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
        stack.close()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, status, out.read(), err.read())


def _checked(result: subprocess.CompletedProcess, check: bool, where: str = "") -> subprocess.CompletedProcess:
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(result.args)}{where} exited {result.returncode}\n--- stdout\n"
                             f"{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-6000:]}")
    return result


def run(cmd: list[str], *, timeout: float, env: dict | None = None, check: bool = True,
        cwd: Path | None = None, fresh: bool = False, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`cmd` with output captured; a hang fails the test after `timeout` s, its process group killed.
    `fresh`: a new interpreter even where the prestarted server could run it (for tests of what a
    command prints as it starts); `stdin`: its input (then always a new interpreter)."""
    result = _run_job(list(map(str, cmd)), [env or child_env()], timeout=timeout, cwd=cwd or REPO_ROOT, fresh=fresh,
                      stdin=stdin)
    return _checked(result, check)


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
    return run(cmd, timeout=timeout, env=env, check=check, fresh=True)


def _target(target: str) -> list[str]:
    return target.split() if target.startswith("-m ") else [target]


def run_ranks(nproc: int, target: str, *args, timeout: float = 300, env: dict | None = None,
              check: bool = True, cwd: Path | None = None,
              python: str | Path = sys.executable) -> subprocess.CompletedProcess:
    """`target args...` (a .py path or `-m module`) on `nproc` ranks, as torchrun starts them (env://
    variables, a free port on this machine), without torchrun's own process. As under torchrun, the
    first rank to fail stops the others and the job fails. The ranks' output is merged; the exit
    status is the first failing rank's (torchrun's is 1). `python`: another venv's interpreter runs
    them (started, not forked)."""
    from megatron_ext.launch.network import take_free_port

    cmd = [str(python), *_target(target), *map(str, args)]
    # Claimed as run.py claims its port: the other pytest worker's job cannot pick it at the same moment.
    base, port = env or child_env(), str(take_free_port())
    envs = [{**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
             "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} for rank in range(nproc)]
    result = _run_job(cmd, envs, timeout=timeout, cwd=cwd or REPO_ROOT, fresh=False)
    return _checked(result, check, f" on {nproc} ranks")


def hf_tensors(hf_dir: Path) -> dict:
    """Every tensor of an HF checkpoint directory (all its safetensors files), by stored name."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors
