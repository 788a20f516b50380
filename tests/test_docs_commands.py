"""Every command of README.md and docs/*.md runs as written, so none can fail unseen (issue 47).

Each document's shell blocks run in order in a directory of their own laid out as its reader's would
be (tests/support/docs_workdir.py): placeholders (`<save-dir>`) are filled from FILL, the docs'
cluster paths (/data/...) lie in that directory, and the files and models they name are tiny ones.
- Training on GPUs, in a container or on several nodes (scripts/train/run.py) runs as `--dry-run`:
  every check, the plan and the exact command, nothing trained; a SLURM job script's run.py line
  runs so in the environment SLURM gives the job (#SBATCH --nodes).
- `torchrun --nproc-per-node N script` runs its N ranks as torchrun starts them; console scripts
  (megatron-ext-train) run their module. Everything else runs for real.
- A synopsis runs without its optional parts (`[--flag VALUE]`, `a|b` inside them); a command
  shortened with `...` gets the options it stands for (ELIDED).
- What cannot run here is named in EXCLUDED with the reason; a command that is neither run nor
  excluded cannot exist: every command not excluded runs.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.helpers import REPO_ROOT, child_env, run, run_ranks

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
_SHELL = {"shell", "bash", "sh"}
# A file the docs show whole: a block whose first line is `# its/path.ext`.
_SHOWN_FILE = re.compile(r"# ([\w./-]+\.(?:yaml|yml|py|json))\n")
_PROMPT = re.compile(r"^(?:\w+)?\$ ")  # `$ `, `node0$ `
_HEREDOC = re.compile(r"<<\s*'?(\w+)'?\s*$")
_OPTIONAL = re.compile(r"\s\[-[^\]]*\]")  # `[--flag VALUE]`, `[--a 1 | --b 2]`
_PLACEHOLDER = re.compile(r"<[^<>\n]*>")
LAUNCHER = "scripts/train/run.py"

# Values of the placeholders, as paths in the working directory; "FLAG <placeholder>" where a
# placeholder means different things after different flags.
FILL = {
    "<huggingface model tag or directory>": "models/text",
    "--save-dir <directory-to-save-model>": "built/llava-hf",
    "--megatron-dir <directory-to-save-model>": "built/megatron",
    "--hf-dir <directory-to-save-model>": "built/exported-hf",
    "--hf-dir <directory-to-load-model>": "models/llava-hf",
    "--megatron-dir <directory-to-load-model>": "models/megatron",
    "<directory-to-load-tokenizer-model>": "models/llava-hf",
    "<tp num>": "1", "<pp num>": "1",
    "<singularity.sif>": "llava.sif",
    "<image-folder>": "images", "<images>": "images",
    "<save-dir>": "work",
    "<megatron-model>": "models/megatron", "<megatron_model_dir>": "models/megatron",
    "<stage-1 checkpoint>": "models/megatron", "<stage2-save-dir>": "models/megatron",
    "<stage-1 or converted checkpoint>": "models/megatron", "<llava-next megatron>": "models/megatron",
    "<onevision megatron>": "models/megatron",
    "<hf_model_dir>": "models/llava-hf", "<hf_dir>": "models/llava-hf",
    "--megatron-dir <save_dir>": "models/megatron", "--save-dir <save_dir>": "runs/new",
    "<run_name>": "docs-run",
    "<prepared-dataset-path>": "data/energon", "<dataset>": "data/energon", "<energon dataset>": "data/energon",
    "<pairs>": "pairs", "<rlaif-v-pairs>": "rlaif-v-pairs", "<your-shards>": "my-shards",
    "<stage1-dir>": "runs/stage1", "<dpo-dir>": "runs/dpo", "<stage2>": "runs/stage2-new", "<ov>": "runs/ov",
    # Saved by a stage that ran as a dry run: the next stage starts from the converted checkpoint.
    "--save-dir <stage1>": "runs/stage1", "--megatron-load-dir <stage1>": "models/megatron",
    "--save-dir <si>": "runs/si", "--megatron-load-dir <si>": "models/megatron",
    "--save-dir <adapter-run>": "runs/lora-new", "--megatron-dir <adapter-run>": "runs/lora",
    "<merged>": "merged-hf", "<adapter>": "adapter",
    "<eval_dir>": "eval",
}
# What `...` stands for in a shortened run.py command: the options shown elsewhere, as far as missing.
ELIDED = {"--megatron-load-dir": "models/megatron", "--data-path": "data/energon"}
SLURM_SCRIPT = "the rest of a SLURM job script"
# The environment a SLURM job's step sees on its first node.
SLURM_JOB = {"SLURM_JOB_ID": "4242", "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "8"}
# Console scripts, run as their modules (the prestarted test server then runs them).
CONSOLE = {"megatron-ext-train": "megatron_ext.commands.train", "energon": "megatron.energon.cli.main"}
# Hub models the docs name, and their tiny stand-ins; a synopsis keeps an optional part naming one (the
# default it shows would otherwise be downloaded).
HUB = {"openai/clip-vit-large-patch14-336": "models/vision"}

# Commands that cannot run here, matched from their start (comments left out), with the reason.
EXCLUDED = {
    r"pip install ": "installs packages from the network (CI's setup runs pip the same way)",
    r"bash scripts/setup_env.sh ": "sets up the environment these tests run in; tests/test_readme.py checks that CI "
                                   "runs this line, which runs the demo (tests/demo/test_demo.py) and this suite",
    r"\.venv/bin/python scripts/demo/run_demo\.py --family qwen2_5_vl$": "the Qwen2.5-VL demo, which "
                                                                     "tests/demo/test_demo.py runs",
    r"singularity build ": "builds a container image: needs singularity and the network",
    r"python bench/gpu_bench.py( --sweep)?$": "needs a CUDA GPU (its `--preset tiny` runs)",
    r"python scripts/eval/benchmark.py .*--tasks [\w,]*textvqa_val":
        "lmms-eval's own tasks download their data from the Hub; the --include-path command runs on local task data",
    SLURM_SCRIPT: "a SLURM job script's own lines (trap, wait, scontrol requeue) need sbatch; its run.py line runs",
    r"(megatron-ext-convert \S+|python scripts/train/run\.py) .*--(hf|megatron|megatron-load)-dir <qwen":
        "a Qwen2.5-VL or Qwen3-VL checkpoint, which the docs' workdir does not build; tests/train/test_qwen_vl_training.py "
        "converts, trains and exports the tiny ones through the same functions",
    r"(torchrun .*)?(python )?scripts/(eval|convert)/\w+\.py .*--(hf|megatron)-dir <qwen":
        "a Qwen-VL checkpoint, which the docs' workdir does not build; tests/eval/test_qwen_vl.py runs these scripts "
        "on the tiny Qwen2.5-VL and Qwen3-VL",
}


@dataclass(frozen=True)
class Command:
    doc: str
    text: str  # as documented: continuations joined, the prompt left out
    stdin: str | None = None  # a here-document's text
    slurm_nodes: int | None = None  # a line of a SLURM job script of that many nodes

    @property
    def exclusion(self) -> str | None:
        if self.slurm_nodes and not self.text.startswith("srun "):
            return SLURM_SCRIPT
        text = re.sub(r"\s+#.*", "", self.text)
        return next((key for key in EXCLUDED if re.match(key, text)), None)


def _block_commands(doc: str, block: str) -> list[Command]:
    nodes = re.search(r"#SBATCH --nodes=(\d+)", block)
    lines = block.replace("\\\n", " ").splitlines()
    commands, at = [], 0
    while at < len(lines):
        # A trailing `&` runs the command in the background (a job script waits for it): the command is the same.
        line, at = _PROMPT.sub("", lines[at].strip()).removesuffix("&").strip(), at + 1
        if not line or line.startswith("#"):
            continue
        stdin = None
        if heredoc := _HEREDOC.search(line):
            end = lines.index(heredoc.group(1), at)
            stdin, at, line = "\n".join(lines[at:end]) + "\n", end + 1, line[:heredoc.start()].strip()
        commands.append(Command(doc, line, stdin, int(nodes.group(1)) if nodes else None))
    return commands


def documented() -> tuple[list[Command], dict[str, dict[str, str]]]:
    """Every command of the docs' shell blocks, and the files each document shows whole (path -> text)."""
    commands, files = [], {}
    for doc in DOCS:
        files[doc.name] = {}
        for language, block in _FENCE.findall(doc.read_text()):
            if language in _SHELL:
                commands += _block_commands(doc.name, block)
            elif shown := _SHOWN_FILE.match(block):
                files[doc.name][shown.group(1)] = block
    return commands, files


COMMANDS, SHOWN_FILES = documented()


def _filled(text: str) -> str:
    """The command with its placeholders filled, its synopsis' optional parts left out and the options
    an unquoted `...` stands for put in."""
    text = _OPTIONAL.sub(lambda part: next((part.group().replace("[", "").replace("]", "") for name in HUB
                                             if name in part.group()), ""), text)
    for name, stand_in in HUB.items():
        text = text.replace(name, stand_in)
    elided = " ".join(f"{flag} {value}" for flag, value in ELIDED.items() if flag not in text.split())
    text = re.sub(r"(?<= )\.\.\.(?= |$)", elided, text)

    def value(match: re.Match) -> str:
        return FILL[_fill_key(text, match)]

    return _PLACEHOLDER.sub(value, text)


def _fill_key(text: str, placeholder: re.Match) -> str:
    """FILL's key for a placeholder of `text`: "FLAG <placeholder>" where there is one, else the placeholder."""
    before = text[:placeholder.start()].split()
    for key in (f"{before[-1] if before else ''} {placeholder.group()}", placeholder.group()):
        if key in FILL:
            return key
    raise AssertionError(f"placeholder {placeholder.group()} has no value: add it to FILL")


def _words(part: str, work: Path) -> tuple[list[str], dict[str, str]]:
    """A command's words as run here, and the environment variables set before it."""
    from tests.support.docs_workdir import cluster_paths

    words = shlex.split(cluster_paths(part, work), comments=True)
    env = {}
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if words[0] in CONSOLE:
        words = ["python", "-m", CONSOLE[words[0]], *words[1:]]
    if LAUNCHER in words:
        words.insert(words.index("--") if "--" in words else len(words), "--dry-run")
    return words, env


def _run_part(command: Command, part: str, cwd: Path, work: Path):
    words, env = _words(part, work)
    if words[0] == "srun":
        words = words[words.index("python"):]  # srun's own options left out
        env.update(SLURM_JOB, SLURM_NNODES=str(command.slurm_nodes),
                   SLURM_JOB_NODELIST=f"node[1-{command.slurm_nodes}]")
    env = child_env(**env)
    if words[0] == "torchrun":
        nproc = int(words[words.index("--nproc-per-node") + 1])
        script = next(i for i, w in enumerate(words) if w.endswith(".py"))
        return run_ranks(nproc, words[script], *words[script + 1:], cwd=cwd, env=env, timeout=300, check=False)
    assert words[0] == "python", f"{command.text}: a program this test does not know how to run"
    return run([sys.executable, *words[1:]], cwd=cwd, env=env, timeout=300, check=False, stdin=command.stdin)


def _run(command: Command, work: Path) -> str | None:
    """Runs `command` in `work`; what went wrong, or None."""
    cwd = work
    for part in _filled(command.text).split("&&"):
        if part.split()[0] == "cd":
            cwd = cwd / part.split()[1]
            continue
        result = _run_part(command, part.strip(), cwd, work)
        if result.returncode != 0:
            return (f"{command.doc}: {command.text}\n  exit {result.returncode}\n--- stdout\n{result.stdout[-2000:]}"
                    f"\n--- stderr\n{result.stderr[-3000:]}")
    return None


_LOOKS_RUN = re.compile(r"^\s*(\$ |python |torchrun |bash |pip |srun |sbatch |megatron-ext-|energon |singularity ).*", re.M)


def test_a_block_of_commands_is_marked_as_shell_so_that_it_runs():
    """A block of commands tagged otherwise (or not at all) would be neither run nor excluded."""
    unmarked = [f"{doc.name}: {match.group().strip()}" for doc in DOCS for language, block in _FENCE.findall(doc.read_text())
                if language not in _SHELL and (match := _LOOKS_RUN.search(block))]
    assert not unmarked, f"tag these blocks ```shell: {unmarked}"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from tests.support.docs_workdir import artifacts

    return artifacts(tmp_path_factory.mktemp("docs_artifacts"))


def test_every_command_is_run_or_excluded_with_a_reason_and_no_exclusion_or_value_is_stale():
    excluded = {command.exclusion for command in COMMANDS} - {None}
    assert excluded == set(EXCLUDED), f"exclusions no command uses: {set(EXCLUDED) - excluded}"
    run_here = [_OPTIONAL.sub("", c.text) for c in COMMANDS if c.exclusion is None]
    used = {_fill_key(text, match) for text in run_here for match in _PLACEHOLDER.finditer(text)}
    assert used == set(FILL), f"placeholder values no command uses: {set(FILL) - used}"
    assert {c.doc for c in COMMANDS if c.exclusion is None} >= {"README.md", "data.md", "eval.md", "launcher.md"}


@pytest.mark.multiprocess
@pytest.mark.timeout(1500)
def test_every_documented_command_runs_as_written(tmp_path, made, record_property):
    from tests.support.docs_workdir import workdir

    failures, ran, dry = [], 0, 0
    for doc in [doc.name for doc in DOCS]:
        commands = [c for c in COMMANDS if c.doc == doc and c.exclusion is None]
        if not commands:
            continue
        work = workdir(tmp_path / f"reader-of-{doc.removesuffix('.md')}", made, SHOWN_FILES[doc])
        for command in commands:
            failure = _run(command, work)
            ran += 1
            dry += LAUNCHER in command.text
            if failure:
                failures.append(failure)
    record_property("summary", f"{ran} documented commands run ({dry} of them as run.py --dry-run), "
                               f"{len(COMMANDS) - ran} excluded: {len(failures)} failed")
    assert not failures, "\n\n".join(failures)
