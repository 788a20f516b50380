"""A command forked by `launch.forked.call` (each demo step on a CPU machine) runs as the same command
in a fresh interpreter would: argv, environment, `__main__`, its output in the file given, its exit
status, atexit handlers and threads; a signal's end is reported as subprocess reports it."""

from __future__ import annotations

import json
import sys

import pytest

from tests.foundation.test_prestarted import SCRIPT
from tests.support.helpers import child_env, run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

# A caller that has imported torch (which each fork would otherwise import again), no more.
CALLER = """
import json, os, sys, torch
from megatron_ext.launch import forked
script, log = sys.argv[1:]
statuses = []
with open(log, "w") as out:
    for arg in ("3", "raise", "signal"):
        statuses.append(forked.call([script, arg], {**os.environ, "FAIL_SAVE": "2"}, out))
print(json.dumps(statuses))
"""


def test_a_forked_command_runs_as_a_fresh_interpreter_would_and_writes_into_the_given_file(tmp_path):
    script, log = tmp_path / "job.py", tmp_path / "steps.log"
    script.write_text(SCRIPT.replace('if sys.argv[1] == "raise":',
                                     'if sys.argv[1] == "signal":\n    os.kill(os.getpid(), 15)\nif sys.argv[1] == "raise":'))
    proc = run([sys.executable, "-c", CALLER, script, log], env=child_env(), cwd=tmp_path, timeout=90, fresh=True)
    assert json.loads(proc.stdout) == [3, 1, -15]
    lines = log.read_text().splitlines()
    seen = json.loads(lines[0])
    assert seen == {"argv": [str(script), "3"], "name": "__main__", "cwd": str(tmp_path), "hook": "2", "rank": None,
                    "path0": str(tmp_path), "session": False}
    # 3: its output and its end; raise: a traceback and its end all the same; signal: nothing after the kill.
    assert lines[1:4] == ["to stderr", "thread joined", "atexit ran"]
    assert lines[5] == "to stderr" and lines[6] == "Traceback (most recent call last):"
    assert lines[lines.index("ValueError: boom") + 1:][:2] == ["thread joined", "atexit ran"]
    assert lines[-2:] == [json.dumps({**seen, "argv": [str(script), "signal"]}), "to stderr"]
