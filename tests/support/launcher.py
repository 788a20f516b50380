"""What the launcher tests run: stand-in executables, a checkpoint, a tokenizer and a prepared dataset.

The tests run the real scripts/train/run.py with PATH holding only stand-ins for torchrun,
singularity, apptainer and nvidia-smi. The stand-ins record their argv and environment as JSON
lines, so a test sees exactly what would have been started; nvidia-smi lists $STANDIN_GPUS GPUs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.support.helpers import REPO_ROOT, kill_tree

RUN_PY = REPO_ROOT / "scripts" / "train" / "run.py"
# What torchrun 2.13 wrote on the second node of a two-node run (tests/train/test_slurm_job.py) when the first
# node's agent closed its store while this one still waited in the exit barrier; addresses and paths shortened.
EXIT_BARRIER_RACE = (
    "[W1127 21:03:11.123456789 TCPStore.cpp:125] [c10d] recvValueWithTimeout failed on SocketImpl(fd=5, "
    "addr=[node1]:40312, remote=[node0]:29500): Failed to recv, got 0 bytes. Connection was likely closed. Did the "
    "remote server shutdown or crash?\n"
    "Exception raised from recvBytes at /pytorch/torch/csrc/distributed/c10d/Utils.hpp:682 (most recent call first):\n"
    "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f2c in lib/libc10.so)\n"
    "frame #1: <unknown function> + 0x5f0b (0x7f2d in lib/libtorch_cpu.so)\n"
    "<omitting python frames>\n"
    "frame #23: __libc_start_main + 0x85 (0x7f2e in /lib/x86_64-linux-gnu/libc.so.6)\n"
    "E1127 21:03:11.456000 4242 torch/distributed/elastic/agent/server/api.py:1008] Error waiting on exit barrier. "
    "Elapsed: 0.10 seconds\n"
    "E1127 21:03:11.456000 4242 torch/distributed/elastic/agent/server/api.py:1008] Traceback (most recent call last):\n"
    "E1127 21:03:11.456000 4242 torch/distributed/elastic/agent/server/api.py:1008]   File \"api.py\", line 994, in "
    "_exit_barrier\n"
    "E1127 21:03:11.456000 4242 torch/distributed/elastic/agent/server/api.py:1008] torch.distributed.DistStoreError: "
    "Failed to recv, got 0 bytes.\n"
)

STANDINS = ("torchrun", "singularity", "apptainer", "nvidia-smi")

STANDIN_SOURCE = f"""#!{sys.executable}
import json, os, signal, subprocess, sys, time
EXIT_BARRIER_RACE = {EXIT_BARRIER_RACE!r}
name = os.path.basename(sys.argv[0])
if name == "nvidia-smi":
    gpus = int(os.environ.get("STANDIN_GPUS", "0"))
    if not gpus:
        sys.exit("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    for i in range(gpus):
        print(f"GPU {{i}}: NVIDIA H100 80GB HBM3 (UUID: GPU-0000000{{i}})")
    sys.exit(0)
role = "child" if os.environ.get("STANDIN_ROLE") == "child" else name

def record(**entry):
    with open(os.environ["STANDIN_RECORD"], "a") as f:
        f.write(json.dumps({{"name": role, **entry}}) + "\\n")

if role != "child":
    record(argv=sys.argv[1:], env=dict(os.environ), pid=os.getpid(), pgid=os.getpgid(0), ppid=os.getppid(),
           parent_pgid=os.getpgid(os.getppid()))
if role == "torchrun" and os.environ.get("STANDIN_PORT_TAKEN"):
    # torchrun's report when its rendezvous port was taken before it could bind it, on its first start.
    with open(os.environ["STANDIN_RECORD"]) as f:
        if sum('"argv"' in line for line in f) == 1:
            port = sys.argv[sys.argv.index("--master-port") + 1]
            print("Traceback (most recent call last):\\n  ...\\ntorch.distributed.DistNetworkError: The server socket "
                  f"has failed to listen on any local network address. port: {{port}}, useIpv6: false, code: -98, "
                  "name: EADDRINUSE, message: address already in use", file=sys.stderr, flush=True)
            sys.exit(1)
print(f"{{role}} says hello on stdout", flush=True)
print(f"{{role}} says hello on stderr", file=sys.stderr, flush=True)
if os.environ.get("STANDIN_WAIT"):
    # torchrun handles what PET_SIGNALS_TO_HANDLE names (else its default); the child, a rank, saves (2 s) and
    # exits 0 on a stopping signal. With STANDIN_NO_RANK the child never says that it started.
    def stop(signum, frame):
        record(signal=signum)
        if role == "child":
            time.sleep(2)  # saving: a second signal would be recorded too
        sys.exit(0 if role == "child" else 128 + signum)
    handled = os.environ.get("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT") if role == "torchrun" else "SIGTERM,SIGINT,SIGUSR1"
    for name in handled.split(","):
        signal.signal(getattr(signal, name), stop)
    if role != "child":
        child = subprocess.Popen([sys.executable, __file__], env={{**os.environ, "STANDIN_ROLE": "child"}})
        record(ready=True, pgid=os.getpgid(0))
        sys.exit(child.wait())
    if not os.environ.get("STANDIN_NO_RANK"):
        with open(os.path.join(os.environ["MEGATRON_EXT_FAILURES"], "rank0.started"), "w") as f:
            f.write(f"{{os.getpid()}} {{open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19]}}")
    record(ready=True, pgid=os.getpgid(0))
    time.sleep(120)
if role == "torchrun" and os.environ.get("STANDIN_EXIT_RACE"):
    # Its ranks started, and it reports the exit-barrier race as a node other than the first does (torch 2.13);
    # with STANDIN_EXIT_RACE=after, one more line follows.
    open(os.path.join(os.environ["MEGATRON_EXT_FAILURES"], "rank0.started"), "w").close()
    sys.stderr.write(EXIT_BARRIER_RACE)
    sys.stderr.flush()
    if os.environ["STANDIN_EXIT_RACE"] == "after":
        print("torchrun says more after it", file=sys.stderr, flush=True)
code = int(os.environ.get("STANDIN_EXIT", "0"))
if code < 0:
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def make_standins(directory: Path, names=STANDINS) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = directory / name
        path.write_text(STANDIN_SOURCE)
        path.chmod(0o755)
    return directory


@dataclass
class Launcher:
    """Runs run.py with the stand-ins first (and alone) on PATH; `records()` reads what they saw."""

    bin_dir: Path
    record_file: Path
    cwd: Path

    def env(self, gpus: int = 0, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_VISIBLE_DEVICES"))}
        env.update(PATH=str(self.bin_dir), STANDIN_RECORD=str(self.record_file), STANDIN_GPUS=str(gpus))
        if not gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU run even on a machine that has GPUs
        env.update(extra)
        return env

    def popen(self, *args, gpus: int = 0, env: dict | None = None, **kwargs) -> subprocess.Popen:
        """run.py in a session of its own (stop it with `stop`)."""
        self.record_file.unlink(missing_ok=True)
        return subprocess.Popen([sys.executable, str(RUN_PY), *map(str, args)], cwd=self.cwd,
                                env=env or self.env(gpus), text=True, start_new_session=True, **kwargs)

    def stop(self, proc: subprocess.Popen) -> None:
        """Kill run.py's process group and the group every stand-in it started leads."""
        kill_tree(proc)
        for pgid in {r["pgid"] for r in self.records() if "pgid" in r}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)

    def run(self, *args, gpus: int = 0, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        proc = self.popen(*args, gpus=gpus, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            self.stop(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def records(self) -> list[dict]:
        if not self.record_file.exists():
            return []
        return [json.loads(line) for line in self.record_file.read_text().splitlines()]

    def launched(self) -> dict:
        """The one process run.py started, as its stand-in recorded it."""
        starts = [r for r in self.records() if "argv" in r]
        assert len(starts) == 1, starts
        return starts[0]


def write_tokenizer(directory: Path, added: dict[str, int], pad: str | None = "<pad>") -> Path:
    """A minimal tokenizer directory as transformers 5 writes it (tokenizer.json + tokenizer_config.json)."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4}
    tokenizer = {"version": "1.0", "added_tokens": [{"id": i, "content": c, "special": True} for c, i in added.items()],
                 "model": {"type": "BPE", "vocab": vocab, "merges": []}}
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = {"tokenizer_class": "TokenizersBackend", "bos_token": "<s>", "eos_token": "</s>"}
    if pad:
        config["pad_token"] = pad
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def write_prepared_dataset(directory: Path, shard_counts: dict[str, int], split_parts: dict[str, list[str]]) -> Path:
    """The metadata `energon prepare` writes (format checked against megatron-energon 7.4.1's output)."""
    meta = directory / ".nv-meta"
    meta.mkdir(parents=True, exist_ok=True)
    (meta / ".info.json").write_text(json.dumps({"energon_version": "7.4.1", "shard_counts": shard_counts}, indent=2))
    lines = ["split_parts:"]
    for split, shards in split_parts.items():
        lines.append(f"  {split}:" + ("" if shards else " []"))
        lines += [f"  - {shard}" for shard in shards]
    (meta / "split.yaml").write_text("\n".join(lines + ["exclude: []", ""]))
    (meta / "dataset.yaml").write_text("sample_type:\n  __module__: megatron.energon\n  __class__: VQASample\n"
                                       "field_map:\n  image: jpg\n  context: json[question]\n  answers: txt\n")
    return directory


@dataclass(frozen=True)
class Inputs:
    checkpoint: Path  # converted checkpoint root, with a tokenizer/ copy
    tokenizer: Path
    data: Path  # 1000 training samples
    blend: Path  # metadataset YAML over data and data2
    data2: Path
    root: Path


# A LLaVA-1.5-shaped config (CLIP ViT-L/14-224 geometry, small widths): the launcher checks the run
# against it with the trainer's own plan. Its sizes split up to 8 ways.
# Complete, as the converter stores it (families.complete_llava_config).
HF_CONFIG = {"model_type": "llava", "image_token_index": 32000, "pad_token_id": 32001, "vision_feature_layer": -2,
             "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu",
             "text_config": {"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 64, "intermediate_size": 128,
                             "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 32064,
                             "max_position_embeddings": 4096, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                             "pad_token_id": 32001},
             "vision_config": {"model_type": "clip_vision_model", "num_hidden_layers": 4, "hidden_size": 64,
                               "intermediate_size": 128, "num_attention_heads": 8, "image_size": 224,
                               "patch_size": 14, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}}
