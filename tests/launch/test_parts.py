"""The launcher's pure pieces: SLURM node lists, argv splitting, token ids from tokenizer files."""

from __future__ import annotations

import json

import pytest

from megatron_ext.config.tokenizer_files import IMAGE_TOKEN, TokenizerFiles
from megatron_ext.errors import UserError
from megatron_ext.launch.flags import FLAGS, LaunchOptions, split_argv
from megatron_ext.launch.network import check_reachable
from megatron_ext.launch.slurm import hostnames, slurm_job
from tests.support.helpers import REPO_ROOT
from tests.support.launcher import write_tokenizer


@pytest.mark.parametrize("nodelist,expected", [
    ("node[01-04],gpu7", ["node01", "node02", "node03", "node04", "gpu7"]),
    ("solo", ["solo"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("a[1-2]-ib[3,5],b[7]", ["a1-ib3", "a1-ib5", "a2-ib3", "a2-ib5", "b7"]),
])
def test_slurm_nodelist(nodelist, expected):
    assert hostnames(nodelist) == expected


def test_slurm_nodelist_unparsable_without_scontrol(monkeypatch):
    monkeypatch.setenv("PATH", "")
    with pytest.raises(UserError, match="-m/--master-addr"):
        hostnames("node[1-2")


def test_a_node_whose_name_is_a_loopback_address_needs_interface_on_several_nodes():
    with pytest.raises(UserError) as refused:
        check_reachable("10.0.0.1", None, 2, node_name="localhost")
    assert str(refused.value) == ("this node's name localhost resolves to 127.0.0.1, a loopback address the other "
                                  "nodes cannot reach; name the network interface they share with --interface (e.g. eth0)")
    check_reachable("10.0.0.1", "eth0", 2, node_name="localhost")
    check_reachable("localhost", "eth0", 2, node_name="localhost")  # the master is this node


def test_slurm_job_from_environment():
    assert slurm_job({"SLURM_NNODES": "2"}) is None
    job = slurm_job({"SLURM_JOB_ID": "9", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "x[3-4]"})
    assert (job.job_id, job.nnodes, job.node_id, job.master_host, job.gpus_on_node) == ("9", 2, 1, "x3", None)
    with pytest.raises(UserError, match="SLURM_NNODES='two'"):
        slurm_job({"SLURM_JOB_ID": "9", "SLURM_NNODES": "two"})


@pytest.mark.parametrize("argv,launcher,trainer", [
    (["--skip-train-iteration-range", "1-2", "3-4", "--tp", "2"],
     ["--skip-train-iteration-range", "1-2", "--skip-train-iteration-range", "3-4", "--tp", "2"], []),
    (["--skip-train-iteration-range=1-2", "3-4"],
     ["--skip-train-iteration-range=1-2", "--skip-train-iteration-range", "3-4"], []),
    (["--skip-train-iteration-range", "1-2", "--", "--lr", "1", "x-y"],
     ["--skip-train-iteration-range", "1-2"], ["--lr", "1", "x-y"]),
    (["--name", "3-4", "-g", "2"], ["--name", "3-4", "-g", "2"], []),
])
def test_split_argv(argv, launcher, trainer):
    assert split_argv(argv) == (launcher, trainer)


@pytest.mark.parametrize("fixture", ["llava_clip", "llava_qwen2_siglip", "llava_internvit", "llava_gemma3_siglip"])
def test_token_ids_match_what_build_llava_wrote(request, fixture):
    path = request.getfixturevalue(fixture)
    config = json.loads((path / "config.json").read_text())
    tokenizer = TokenizerFiles(path)
    assert tokenizer.image_token_id() == config["image_token_index"]
    assert tokenizer.pad_token_id() == config["pad_token_id"]


def test_image_token_is_build_llavas():
    from megatron_ext.hf.build_llava import IMAGE_TOKEN as BUILT

    assert IMAGE_TOKEN == BUILT


def test_token_ids_from_transformers_4_files_and_unigram_vocab(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {"5": {"content": "<image>", "special": True}}}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"pad_token": {"content": "[PAD]"}}))
    (tmp_path / "tokenizer.json").write_text(json.dumps(
        {"added_tokens": [], "model": {"type": "Unigram", "vocab": [["<unk>", 0.0], ["[PAD]", 0.0], ["a", -1.0]]}}))
    tokenizer = TokenizerFiles(tmp_path)
    assert (tokenizer.image_token_id(), tokenizer.pad_token_id()) == (5, 1)


def test_missing_pad_token(tmp_path):
    with pytest.raises(UserError, match="--pad-token-id"):
        TokenizerFiles(write_tokenizer(tmp_path, {"<image>": 9}, pad=None)).pad_token_id()


def test_docs_list_every_flag():
    docs = (REPO_ROOT / "docs" / "launcher.md").read_text()
    missing = [flag.name for flag in FLAGS if f"`{flag.name}`" not in docs and f"`{flag.short}, {flag.name}`" not in docs]
    assert not missing


def test_token_ids_when_the_vocabulary_comes_first(tmp_path):
    """The fast path decodes only `added_tokens`; a file in another key order still gives the right ids."""
    text = ('{"model": {"type": "BPE", "vocab": {"added_tokens": 0, "<pad>": 1}, "merges": ["a b"]}, '
            '"added_tokens": [{"id": 7, "content": "<image>"}]}')
    (tmp_path / "tokenizer.json").write_text(text)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<pad>"}))
    tokenizer = TokenizerFiles(tmp_path)
    assert (tokenizer.image_token_id(), tokenizer.pad_token_id()) == (7, 1)


def test_launch_options_hold_one_field_per_flag_the_launcher_consumes_and_the_trainers_values_apart():
    own = {flag.dest for flag in FLAGS if not flag.to}
    assert set(LaunchOptions.__dataclass_fields__) == own | {"trainer"}
    values = {**{name: None for name in own}, "tp": 2, "skip_train_iteration_range": ("1-2", "5-6")}
    options = LaunchOptions.of(values)
    assert dict(options.trainer) == {"tp": 2, "skip_train_iteration_range": ["1-2", "5-6"]}


def test_the_launchers_help_names_its_plan_and_report_commands():
    import click

    from megatron_ext.commands.train import launch

    shown = launch.get_help(click.Context(launch, info_name="megatron-ext-train"))
    assert "plan [--layouts 4x2,8x1] FLAGS..." in shown and "report SAVE_DIR [--png]" in shown


@pytest.mark.parametrize("kernel_range", ["32768\t60999", "1024 60999", "1024 65535"])
def test_free_ports_lie_outside_the_range_the_kernel_gives_outgoing_connections(tmp_path, monkeypatch, kernel_range):
    from megatron_ext.launch import network

    (tmp_path / "range").write_text(kernel_range + "\n")
    monkeypatch.setattr(network, "EPHEMERAL_RANGE", tmp_path / "range")
    low, high = map(int, kernel_range.split())
    ports = {network.free_port() for _ in range(30)}
    outside = not (low == 1024 and high == 65535)
    assert all(1024 <= port < 65536 and network.port_free(port) for port in ports)
    assert not outside or not any(low <= port <= high for port in ports)
    assert len(ports) > 10  # drawn at random: two jobs starting together rarely try the same one


def test_a_free_port_is_never_one_another_run_py_has_claimed(tmp_path, monkeypatch):
    import fcntl
    import os

    from megatron_ext.launch import network

    (tmp_path / "range").write_text("1024 65533\n")  # leaves 65534 and 65535
    monkeypatch.setattr(network, "EPHEMERAL_RANGE", tmp_path / "range")
    monkeypatch.setattr(network, "CLAIMS_DIR", tmp_path / "claims")
    (tmp_path / "claims").mkdir()
    if not network.port_free(65534) or not network.port_free(65535):
        pytest.skip("ports 65534/65535 are in use on this machine")
    holder = os.open(tmp_path / "claims" / "65534.lock", os.O_RDONLY | os.O_CREAT)  # as another run.py holds it
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        assert {network.free_port() for _ in range(20)} == {65535}
    finally:
        os.close(holder)
    assert network.free_port() in (65534, 65535) and not network.claimed(65534)
