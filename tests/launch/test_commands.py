"""The commands run.py starts: real run.py, stand-in torchrun/singularity/apptainer recording argv and environment."""

from __future__ import annotations

import shlex

import click
import pytest

from megatron_ext.container import checkout_root
from megatron_ext.launch.network import free_port
from megatron_ext.train.cli import trainer_options
from tests.support.launcher import make_standins

SCRIPT = "megatron_ext.train.pretrain_llava"
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


@click.command()
@trainer_options
def _trainer(config):
    return config


def split_torchrun(argv: list[str]):
    """(torchrun options as a dict, the TrainConfig the trainer would parse from its arguments)."""
    cut = argv.index(SCRIPT)
    assert argv[cut - 1] == "-m"  # the trainer runs as a module, from a checkout or an installed package
    opts = dict(zip(argv[:cut - 1:2], argv[1:cut - 1:2]))
    return opts, _trainer.main(argv[cut + 1:], standalone_mode=False)


def launch(launcher, inputs, *args, gpus=0, env=None, check=True, memory_plan=False):
    """run.py with stand-ins. Dry runs and GPU launches compute a memory plan (importing megatron-core,
    seconds per call): these tests check the command, so the plan runs only where a test asks for it
    (tests/launch/test_memory_check.py checks the plan itself)."""
    plan_flags = () if memory_plan else ("--no-memory-check",)  # before args: they may end with `-- trainer options`
    result = launcher.run("--megatron-load-dir", inputs.checkpoint, "--data-path", inputs.data, *plan_flags, *args,
                          gpus=gpus, env=env)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def test_single_node_cpu_and_dry_run_prints_exactly_what_runs(launcher, inputs):
    port = free_port()
    args = ("-g", "2", "--tp", "2", "--micro-batch-size", "4", "--global-batch-size", "8", "-p", port, "--name", "exp")
    dry = launch(launcher, inputs, *args, "--dry-run")
    assert launcher.records() == []  # a dry run starts nothing
    launch(launcher, inputs, *args)
    started = launcher.launched()
    assert shlex.split(dry.stdout) == ["torchrun", *started["argv"]]

    opts, config = split_torchrun(started["argv"])
    assert opts == {"--nnodes": "1", "--nproc-per-node": "2", "--node-rank": "0", "--master-addr": "127.0.0.1",
                    "--master-port": str(port)}
    assert (config.tp, config.pp, config.micro_batch_size, config.global_batch_size) == (2, 1, 4, 8)
    assert config.train_iters == 125  # one epoch: 1000 training samples / global batch 8
    assert (config.image_token_id, config.pad_token_id) == (32000, 32001)  # from the checkpoint's tokenizer/
    assert config.megatron_load_dir == str(inputs.checkpoint) and config.data_path == str(inputs.data)
    assert config.name == "exp" and config.distributed_backend is None
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in started["env"] and "NCCL_SOCKET_IFNAME" not in started["env"]
    # torchrun leads a process group of its own, apart from run.py's (the ranks it starts join it).
    assert started["pgid"] == started["pid"] != started["parent_pgid"]


@pytest.mark.parametrize("stage,extra,gbs,lr,freeze_lm,iters", [
    (1, (), 256, 1e-3, True, 4),
    (2, (), 128, 2e-5, False, 8),
    (2, ("--freeze-lm",), 128, 2e-5, True, 8),
])
def test_stage_defaults(launcher, inputs, stage, extra, gbs, lr, freeze_lm, iters):
    launch(launcher, inputs, "--stage", stage, *extra)
    _, config = split_torchrun(launcher.launched()["argv"])
    assert (config.stage, config.global_batch_size, config.lr, config.freeze_lm, config.train_iters) == \
        (stage, gbs, lr, freeze_lm, iters)


def test_passthrough_options_and_original_skip_range_syntax(launcher, inputs):
    launch(launcher, inputs, "--skip-train-iteration-range", "100-110", "300-400", "--tp", "1",
           "--skip-train-iteration-range=500-510", "--num-workers", "0",
           "--", "--lr", "3e-4", "--seq-length=512", "--train-iters", "7", "--unfreeze-vit", "--keep-last", "0")
    _, config = split_torchrun(launcher.launched()["argv"])
    assert config.skip_train_iteration_range == ["100-110", "300-400", "500-510"]
    assert (config.lr, config.seq_length, config.train_iters, config.unfreeze_vit, config.keep_last) == (3e-4, 512, 7, True, 0)
    assert config.num_workers == 0

    launch(launcher, inputs, "--", "--epochs", "2.5")
    _, config = split_torchrun(launcher.launched()["argv"])
    assert (config.epochs, config.train_iters) == (2.5, None)  # the trainer turns epochs into iterations


# Where this machine's name resolves to a loopback address, run.py asks multi-node runs for --interface.
INTERFACE = ("--interface", "lo")


def test_multi_node_static_rendezvous(launcher, inputs):
    launch(launcher, inputs, "-g", "2", "--node", "2", "-r", "1", "-m", "10.1.2.3", "-p", "29600", *INTERFACE)
    opts, _ = split_torchrun(launcher.launched()["argv"])
    assert opts == {"--nnodes": "2", "--nproc-per-node": "2", "--node-rank": "1", "--master-addr": "10.1.2.3",
                    "--master-port": "29600", "--rdzv-conf": "timeout=15"}  # a node that never joins ends the others


@pytest.mark.parametrize("nodes,master", [(2, "10.1.2.3"), (1, None)])
def test_c10d_rendezvous(launcher, inputs, nodes, master):
    port = free_port()
    launch(launcher, inputs, "-g", "2", "--node", nodes, "--rdzv-port", port, "--name", "exp",
           *(("-m", master) if master else ()), *INTERFACE)
    opts, _ = split_torchrun(launcher.launched()["argv"])
    assert opts == {"--nnodes": str(nodes), "--nproc-per-node": "2", "--rdzv-backend": "c10d",
                    "--rdzv-endpoint": f"{master or '127.0.0.1'}:{port}", "--rdzv-id": "exp",
                    **({"--rdzv-conf": "join_timeout=15"} if nodes > 1 else {})}


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08],cpu1",
         "SLURM_GPUS_ON_NODE": "4"}


@pytest.mark.parametrize("flags,expected", [
    ((), {"--nnodes": "2", "--nproc-per-node": "4", "--node-rank": "1", "--master-addr": "gpu07", "--master-port": "29500",
          "--rdzv-conf": "timeout=15"}),
    # flags given on the command line win over SLURM's values
    (("-g", "2", "-m", "10.9.9.9", "-p", "29700", "--slurm-job-id", "77"),
     {"--nnodes": "2", "--nproc-per-node": "2", "--node-rank": "1", "--master-addr": "10.9.9.9", "--master-port": "29700",
      "--rdzv-conf": "timeout=15"}),
    (("--rdzv-port", "29400"), {"--nnodes": "2", "--nproc-per-node": "4", "--rdzv-backend": "c10d",
                                "--rdzv-endpoint": "gpu07:29400", "--rdzv-id": "4242", "--rdzv-conf": "join_timeout=15"}),
])
def test_slurm_environment(launcher, inputs, flags, expected):
    env = launcher.env(gpus=8, **SLURM)
    result = launch(launcher, inputs, "--slurm-output-name", "logs/exp", *flags, *INTERFACE, env=env)
    started = launcher.launched()
    opts, _ = split_torchrun(started["argv"])
    assert opts == expected
    assert started["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    log = launcher.cwd / "logs" / f"exp-{'77' if '--slurm-job-id' in flags else '4242'}-node1.log"
    text = log.read_text()
    assert "torchrun says hello on stdout" in text and "torchrun says hello on stderr" in text
    assert "torchrun says hello on stdout" in result.stdout  # streamed too


def test_gpus_all_and_gpu_ids(launcher, inputs):
    launch(launcher, inputs)  # no CUDA: one CPU process
    assert split_torchrun(launcher.launched()["argv"])[0]["--nproc-per-node"] == "1"

    launch(launcher, inputs, "--tp", "8", gpus=8, memory_plan=True)  # a GPU launch computes its plan
    started = launcher.launched()
    assert split_torchrun(started["argv"])[0]["--nproc-per-node"] == "8"
    assert "CUDA_VISIBLE_DEVICES" not in started["env"]

    launch(launcher, inputs, "--gpu-ids", "1,3", gpus=8)
    started = launcher.launched()
    assert split_torchrun(started["argv"])[0]["--nproc-per-node"] == "2"
    assert started["env"]["CUDA_VISIBLE_DEVICES"] == "1,3"


def test_interface_fp8_deterministic_and_debug(launcher, inputs, tmp_path):
    # A machine with GPUs where Transformer Engine is installed (an empty stand-in package: run.py only looks for it).
    # (No memory plan: it imports megatron-core, which reads the stand-in's missing package version.)
    (tmp_path / "site" / "transformer_engine").mkdir(parents=True)
    (tmp_path / "site" / "transformer_engine" / "__init__.py").write_text("")
    launch(launcher, inputs, "--interface", "lo", "--fp8", "--deterministic", "--debug", "-g", "2", gpus=2,
           env=launcher.env(gpus=2, PYTHONPATH=str(tmp_path / "site")))
    started = launcher.launched()
    env = started["env"]
    assert (env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"]) == ("lo", "lo")
    assert (env["CUBLAS_WORKSPACE_CONFIG"], env["NCCL_ALGO"], env["NVTE_ALLOW_NONDETERMINISTIC_ALGO"]) == (":4096:8", "Tree", "0")
    assert (env["TORCH_DISTRIBUTED_DEBUG"], env["NCCL_DEBUG"]) == ("INFO", "INFO")
    _, config = split_torchrun(started["argv"])
    assert config.fp8 and config.deterministic and config.debug


def _binds(argv: list[str]) -> list[str]:
    return [argv[i + 1].split(":")[0] for i, arg in enumerate(argv) if arg == "--bind"]


def test_sif_path_singularity(launcher, inputs, tmp_path):
    sif = tmp_path / "demo.sif"
    sif.write_text("image")
    save_dir = inputs.root / "saves" / "run1"  # not there yet: its existing parent is bound
    launch(launcher, inputs, "--sif-path", sif, "--gpu-ids", "2,3", "--tp", "2", "--save", "--save-dir", save_dir,
           "--tokenizer-load-dir", inputs.tokenizer, gpus=4)
    started = launcher.launched()
    assert started["name"] == "singularity"
    argv = started["argv"]
    assert argv[:2] == ["exec", "--nv"]
    assert set(_binds(argv)) >= {str(tmp_path), str(checkout_root()), str(inputs.checkpoint), str(inputs.data),
                                 str(inputs.tokenizer), str(inputs.root)}
    inner = argv[argv.index(str(sif)) + 1:]
    assert inner[0] == "torchrun" and f"PYTHONPATH={checkout_root()}" in argv
    opts, config = split_torchrun(inner[1:])
    assert opts["--nproc-per-node"] == "2"
    assert config.save_dir == str(save_dir) and config.tokenizer_load_dir == str(inputs.tokenizer)
    env = started["env"]
    assert env["SINGULARITYENV_CUDA_VISIBLE_DEVICES"] == "2,3"  # not --env: apptainer splits its values at commas
    assert env["SINGULARITYENV_CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def test_sif_path_apptainer_binds_blend_members(launcher, inputs, tmp_path):
    launcher.bin_dir = make_standins(tmp_path / "bin", ("torchrun", "apptainer", "nvidia-smi"))
    sif = tmp_path / "demo.sif"
    sif.write_text("image")
    result = launcher.run("--megatron-load-dir", inputs.checkpoint, "--data-path", inputs.blend, "--sif-path", sif,
                          "--deterministic", "--global-batch-size", "100")
    assert result.returncode == 0, result.stderr
    started = launcher.launched()
    assert started["name"] == "apptainer"
    assert set(_binds(started["argv"])) >= {str(inputs.blend.parent), str(inputs.data), str(inputs.data2)}
    assert started["env"]["APPTAINERENV_NCCL_ALGO"] == "Tree"
    _, config = split_torchrun(started["argv"][started["argv"].index(str(sif)) + 2:])
    assert config.train_iters == 13  # (1000 + 300) samples of the blend / 100
