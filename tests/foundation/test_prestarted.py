"""A job forked from the prestarted server (tests/support/prestarted.py) behaves as the same command in a
fresh interpreter: argv, environment, working directory, `__main__`, output, exit status, atexit
handlers and threads; and the server refuses what it cannot run that way."""

from __future__ import annotations

import signal
import sys
import textwrap

import pytest

from tests.support.helpers import child_env, kill_tree, run

SCRIPT = textwrap.dedent("""
    import atexit, json, os, sys, threading, time
    atexit.register(lambda: print("atexit ran", flush=True))
    def late():
        time.sleep(0.5)
        print("thread joined", flush=True)
    threading.Thread(target=late).start()
    print(json.dumps({"argv": sys.argv, "name": __name__, "cwd": os.getcwd(), "hook": os.environ.get("FAIL_SAVE"),
                      "rank": os.environ.get("RANK"), "path0": sys.path[0], "session": os.getsid(0) == os.getpid()}))
    print("to stderr", file=sys.stderr)
    if sys.argv[1] == "raise":
        raise ValueError("boom")
    sys.exit(int(sys.argv[1]))
""")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize("how", ["forked", "fresh"])
def test_a_forked_job_runs_as_a_fresh_interpreter_would(script, tmp_path, how):
    import json

    outcomes = {}
    for arg in ("3", "raise"):
        proc = run([sys.executable, script, arg], env=child_env(FAIL_SAVE="2"), cwd=tmp_path, timeout=60, check=False,
                   fresh=how == "fresh")
        first, *rest = proc.stdout.splitlines()
        outcomes[arg] = (proc.returncode, json.loads(first), rest, proc.stderr)
    status, seen, after, stderr = outcomes["3"]
    assert status == 3
    assert seen == {"argv": [str(script), "3"], "name": "__main__", "cwd": str(tmp_path), "hook": "2", "rank": None,
                    "path0": str(tmp_path), "session": True}
    assert after == ["thread joined", "atexit ran"] and stderr == "to stderr\n"
    status, _, after, stderr = outcomes["raise"]
    assert status == 1 and after == ["thread joined", "atexit ran"]
    assert stderr.startswith("to stderr\nTraceback (most recent call last):") and stderr.endswith("ValueError: boom\n")


def test_the_server_forks_only_what_a_fresh_interpreter_would_run_alike(script):
    from tests.support import prestarted

    server = prestarted.server()
    python = sys.executable
    assert server.serves([python, str(script), "0"], child_env(RANK="1", REHEARSAL_REPORT="r.json"))
    assert server.serves([python, "-m", "megatron_ext.train.pretrain_llava"], child_env())
    # lmms-eval's `datasets` is imported by the job, after the fork: its cache can be the test's own.
    assert server.serves([python, str(script)], child_env(HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE="/elsewhere"))
    assert not server.serves([python, str(script)], child_env(HF_HOME="/elsewhere"))  # huggingface_hub's, at import
    assert not server.serves([python, str(script)], child_env(PYTHONPATH="/elsewhere"))  # seen at import
    assert not server.serves([python, str(script)], child_env(gpu=True))
    assert not server.serves([python, "-c", "pass"], child_env())
    assert not server.serves(["torchrun", str(script)], child_env())


def test_a_killed_job_reports_its_signal(tmp_path):
    from tests.support import prestarted

    path = tmp_path / "sleeper.py"
    path.write_text("import time\ntime.sleep(60)\n")
    server = prestarted.server()
    with open(tmp_path / "out", "w") as out:
        job = server.start([sys.executable, str(path)], env=child_env(), cwd=tmp_path, stdout=out, stderr=out)
        assert job.poll() is None
        kill_tree(job)
    assert job.returncode == -signal.SIGKILL
