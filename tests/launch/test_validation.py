"""Every check run.py makes before launching: one line naming the flag, exit status 2, nothing started."""

from __future__ import annotations

import socket

import pytest

from tests.support.launcher import write_prepared_dataset, write_tokenizer

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def busy_port():
    with socket.socket() as sock:
        sock.bind(("", 0))
        sock.listen()
        yield sock.getsockname()[1]


# (flags, GPUs on the machine, text the one-line error must contain)
CASES = {
    "tp x pp": (["-g", "2", "--tp", "4"], 0, "--tp 4 x --pp 1 = 4 does not divide the number of processes (2)"),
    "pp": (["-g", "4", "--tp", "2", "--pp", "3"], 0, "--tp 2 x --pp 3 = 6 does not divide"),
    "global batch": (["-g", "4", "--tp", "2", "--micro-batch-size", "2", "--global-batch-size", "6"], 0,
                     "--global-batch-size 6 must be a multiple of --micro-batch-size 2 x data-parallel size 2 = 4"),
    "micro batch": (["--micro-batch-size", "0"], 0, "--micro-batch-size 0 must be >= 1"),
    "checkpoint missing": (["--megatron-load-dir", "MISSING"], 0, "--megatron-load-dir"),
    "not a checkpoint": (["--megatron-load-dir", "EMPTY"], 0, "is not a megatron_ext checkpoint"),
    "no checkpoint": (["--megatron-load-dir", "OMIT"], 0, "--megatron-load-dir is required"),
    "init needs tokenizer": (["--init"], 0, "--init needs --tokenizer-load-dir"),
    "tokenizer missing": (["--tokenizer-load-dir", "MISSING"], 0, "--tokenizer-load-dir"),
    "not a tokenizer": (["--tokenizer-load-dir", "EMPTY"], 0, "--tokenizer-load-dir"),
    "no image token": (["--tokenizer-load-dir", "NO_IMAGE"], 0, "has no <image> token"),
    "tokenizer of another model": (["--tokenizer-load-dir", "OTHER_IDS"], 0,
                                   "image token id 5 differs from the 32000 that checkpoint"),
    "data missing": (["--data-path", "MISSING"], 0, "--data-path"),
    "not a dataset": (["--data-path", "EMPTY"], 0, "is not a prepared energon dataset"),
    "no data path": (["--data-path", "OMIT"], 0, "--data-path is required"),
    "save dir is a file": (["--save", "--save-dir", "FILE"], 0, "--save-dir"),
    "save without dir": (["--save"], 0, "--save needs --save-dir"),
    "sif missing": (["--sif-path", "MISSING"], 0, "--sif-path"),
    "master port busy": (["-p", "BUSY"], 0, "-p/--master-port BUSY is in use"),
    "rdzv port busy": (["--rdzv-port", "BUSY"], 0, "--rdzv-port BUSY is in use"),
    "too many gpus": (["-g", "16"], 8, "-g/--gpus 16: only 8 GPUs are visible"),
    "gpu ids vs gpus": (["-g", "4", "--gpu-ids", "0,1"], 8, "-g/--gpus 4 does not match --gpu-ids 0,1"),
    "gpu id out of range": (["--gpu-ids", "0,9"], 8, "--gpu-ids 0,9: GPU 9 does not exist"),
    "gpu ids without gpus": (["--gpu-ids", "0"], 0, "--gpu-ids 0: no CUDA GPU"),
    "zero gpus": (["-g", "0"], 0, "-g/--gpus 0"),
    "loopback master": (["--node", "2", "-r", "1", "-m", "localhost", "--interface", "lo"], 0,
                        "-m/--master-addr localhost (127.0.0.1) is a loopback address, on a run of 2 nodes; give the "
                        "address at which the other nodes reach the rank-0 node"),
    "multi-node master": (["--node", "2", "-r", "1"], 0, "-m/--master-addr is required with --node 2"),
    "multi-node rank": (["--node", "2", "-m", "10.0.0.1"], 0, "-r/--rank is required with --node 2"),
    "rank range": (["--node", "2", "-r", "2", "-m", "10.0.0.1"], 0, "-r/--rank 2 must be in 0..1"),
    "interface": (["--interface", "nosuchif0"], 0, "--interface nosuchif0"),
    "nccl on cpu": (["--backend", "nccl"], 0, "--backend nccl needs CUDA GPUs"),
    "fp8 on cpu": (["--fp8"], 0, "--fp8 needs Transformer Engine with CUDA, which is not importable here"),
    "fp8 with sdpa": (["--sif-path", "SIF", "--fp8", "--", "--attention-backend", "sdpa"], 1,
                      "--fp8 needs Transformer Engine layers; it cannot run with --attention-backend sdpa"),
    "te backend without TE": (["--", "--attention-backend", "te"], 0, "--attention-backend te needs Transformer Engine"),
    "te backend on a GPU without TE": (["--", "--attention-backend", "te"], 1,
                                       "--attention-backend te needs Transformer Engine"),
    "sequence parallel without TE": (["-g", "2", "--tp", "2", "--", "--sequence-parallel"], 0,
                                     "--sequence-parallel needs Transformer Engine"),
    "context parallel without TE": (["-g", "2", "--cp", "2"], 0, "--cp 2 (context parallelism) needs Transformer Engine"),
    "tp x pp x cp": (["-g", "4", "--sif-path", "SIF", "--cp", "3"], 4,
                     "--tp 1 x --pp 1 x --cp 3 = 3 does not divide the number of processes (4)"),
    "seq length for fp8": (["--sif-path", "SIF", "--fp8", "--", "--seq-length", "2040"], 1,
                           "--seq-length 2040 must be a multiple of 16 for --fp8; use 2048"),
    "skip range": (["--skip-train-iteration-range", "110-100"], 0, "--skip-train-iteration-range '110-100'"),
    "unknown flag": (["--tpp", "2"], 0, "No such option '--tpp'"),
    "trainer option before --": (["--lora-rank", "8"], 0, "--lora-rank is the trainer's option: give it after -- "
                                 "(run.py [run.py's flags] -- --lora-rank ...)"),
    "passthrough typo": (["--", "--trian-iters", "5"], 0, "trainer options after --: No such option '--trian-iters'"),
    "passthrough value": (["--", "--lr", "fast"], 0, "'fast' is not a valid float"),
    "launcher flag after --": (["--", "--tp", "2"], 0, "--tp after --: give it as run.py's --tp"),
    "no training samples": (["--data-path", "NO_TRAIN"], 0, "has no training samples (splits: train 0, val 5, test 0); "
                            "rebuild it with `megatron-ext-data build`"),
    # Checked by the trainer's own plan, before anything starts.
    "seq length under the image": (["--", "--seq-length", "200"], 0,
                                   "--seq-length 200 leaves no room for text after 256 image embeddings"),
    "vision lr of a frozen tower": (["--", "--vision-lr", "2e-6"], 0, "--vision-lr needs --unfreeze-vit"),
    "no video frames": (["--", "--video-frames", "0"], 0, "--video-frames must be >= 1, got 0"),
    "pixel bounds of a LLaVA": (["--", "--max-pixels", "200704"], 0, "--max-pixels: only native-resolution models "
                                "(Qwen2.5-VL, Qwen3-VL) resize images within pixel bounds; a LLaVA's images take its "
                                "vision tower's fixed size, drop the flag"),
    "tower attention of a LLaVA": (["--", "--vision-attention", "varlen"], 0, "--vision-attention varlen: only "
                                   "native-resolution models (Qwen2.5-VL, Qwen3-VL) choose their tower's attention"),
    "no tiles": (["--", "--max-tiles-per-sequence", "0"], 0, "--max-tiles-per-sequence must be >= 1, got 0"),
    "answers without evaluations": (["--", "--eval-generate-samples", "4"], 0,
                                    "--eval-generate-samples needs --eval-interval"),
    "evaluation on start without evaluations": (["--", "--eval-on-start"], 0, "--eval-on-start needs --eval-interval"),
    "fused adam for sgd": (["--", "--fused-adam", "--optimizer", "sgd"], 0,
                           "--fused-adam fuses AdamW's update; it does nothing for --optimizer sgd: drop it"),
    "torchao's fp8 backend without --fp8": (["--fp8-backend", "torchao"], 0,
                                            "--fp8-backend torchao chooses what runs --fp8: add --fp8"),
    "torchao's fp8 in TE's layers": (["--sif-path", "SIF", "--fp8", "--fp8-backend", "torchao", "--", "--attention-backend",
                                      "te"], 1,
                                     "--fp8-backend torchao runs in megatron-core's local layers, not Transformer "
                                     "Engine's: use --attention-backend sdpa (or local), or --fp8-backend te"),
    "torchao's fp8 at tp 2": (["-g", "2", "--tp", "2", "--fp8", "--fp8-backend", "torchao"], 0,
                              "--fp8-backend torchao runs at --tp 1 so far (got --tp 2)"),
    "torchao's fp8 with fused weight gradients": (["--fp8", "--fp8-backend", "torchao", "--",
                                                   "--gradient-accumulation-fusion"], 0,
                                                  "drop --gradient-accumulation-fusion"),
    "torchao's fp8 with a frozen language model": (["--fp8", "--fp8-backend", "torchao", "--stage", "1"], 0,
                                                   "this run trains none (stage 1, --freeze-lm or --lora-rank): drop "
                                                   "--fp8"),
}


def _argv(args, values, inputs):
    """Good --megatron-load-dir and --data-path unless the case gives its own (OMIT: none), then the case's flags."""
    base = {"--megatron-load-dir": str(inputs.checkpoint), "--data-path": str(inputs.data)}
    cut = args.index("--") if "--" in args else len(args)
    rest = []
    i = 0
    while i < cut:
        if args[i] in base:
            base[args[i]] = args[i + 1]
            i += 2
        else:
            rest.append(args[i])
            i += 1
    flags = [arg for flag, value in base.items() if value != "OMIT" for arg in (flag, value)] + rest
    return [values.get(arg, arg) for arg in flags] + args[cut:]


@pytest.mark.parametrize("name", list(CASES))
def test_error_is_one_line_and_nothing_starts(launcher, inputs, tmp_path, busy_port, name):
    args, gpus, message = CASES[name]
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("x")
    values = {
        "MISSING": str(tmp_path / "missing"),
        "EMPTY": str(tmp_path / "empty"),
        "FILE": str(tmp_path / "afile"),
        "NO_IMAGE": str(write_tokenizer(tmp_path / "no_image", {"<pad>": 7})),
        "OTHER_IDS": str(write_tokenizer(tmp_path / "other_ids", {"<image>": 5, "<pad>": 6})),
        "NO_TRAIN": str(write_prepared_dataset(tmp_path / "no_train", {"a.tar": 5}, {"train": [], "val": ["a.tar"]})),
        "BUSY": str(busy_port),
        "SIF": str(tmp_path / "afile"),
    }
    result = launcher.run(*_argv(args, values, inputs), gpus=gpus)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message.replace("BUSY", str(busy_port)) in lines[0]
    assert launcher.records() == []
