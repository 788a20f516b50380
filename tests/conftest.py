"""Shared fixtures: tiny random HF models and LLaVA checkpoints built locally once per session."""

from __future__ import annotations

import contextlib
import json
import multiprocessing.process
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# One intra-op thread per process: the CI machine has 2 cores and tests run torchrun children.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")

# PyPI's CUDA build of torch (the Python 3.12 venv) runs ldconfig when first imported: imported here,
# not by whichever in-process test comes first, whose guard would take it for the test's process.
import torch  # noqa: E402, F401

# Test children get the environment as it is now, before any test can change it (helpers.child_env).
import tests.support.helpers  # noqa: E402, F401

REPO_ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def _in_process_only(item):
    """A test not marked `multiprocess` (and the fixtures set up for it) starts no process and no
    torch.distributed process group: `pytest -m "not multiprocess"` is the quick, in-process subset."""
    if item.get_closest_marker("multiprocess"):
        yield
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{item.nodeid} starts a process (or a fixture it uses does): mark it multiprocess")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refuse)
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        patch.setattr(os, "fork", refuse)
        patch.setattr(os, "forkpty", refuse)
        yield
    distributed = sys.modules.get("torch.distributed")
    assert not (distributed and distributed.is_initialized()), \
        f"{item.nodeid} initialised torch.distributed: mark it multiprocess"


# Each test file's seconds in a recorded run (setup, call, teardown), written by
# `pytest --record-file-durations`. Files start longest first, so that the two workers (`-n 2 --dist
# loadfile`) end together instead of one running a long file alone at the end; a file not yet
# recorded starts last.
FILE_DURATIONS = Path(__file__).parent / "file_durations.json"


def pytest_addoption(parser):
    parser.addoption("--record-file-durations", action="store_true",
                     help=f"write each test file's seconds in this run to {FILE_DURATIONS.name}, the order files start in")


def pytest_configure(config):
    # pytest-xdist would start the files with the most tests first, whatever their length.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration


def pytest_sessionfinish(session):
    # Only the controller: with pytest-xdist, it receives every worker's reports.
    if session.config.getoption("--record-file-durations") and not hasattr(session.config, "workerinput"):
        recorded = {**json.loads(FILE_DURATIONS.read_text()), **_file_seconds}  # a partial run keeps the others'
        ordered = sorted(recorded.items(), key=lambda item: -item[1])
        FILE_DURATIONS.write_text(json.dumps({path: round(s, 1) for path, s in ordered}, indent=1) + "\n")


# The tests that reach into megatron-core (its private names, specs, checkpoints, optimizers, parallel
# layouts), marked `megatron_internals`: CI's second leg runs them with the other supported release,
# beside the in-process tests (`-m "not multiprocess or megatron_internals"`, .ci/run).
MEGATRON_INTERNALS = (
    "tests/foundation/",  # the CPU patches, the release seam, rank failures
    "tests/checkpoint/",  # saving, and checkpoints crossing releases
    "tests/convert/",  # the converters at TP{1,2} x PP{1,2}
    "tests/families/",  # each family's layer specs and conversions
    "tests/model/",  # attention backends, RoPE kernels, configs
    "tests/lora/",  # adapters at TP2 x PP2 and TP2 x DP2 with the distributed optimizer
    "tests/train/test_parallel_losses.py",  # TP2 x PP2, DP2 with the distributed optimizer
    "tests/train/test_compiled_layers.py",  # megatron-core's layers compiled, its linear function replaced
    "tests/train/test_fused_adam.py",  # torch's AdamW inside megatron-core's optimizer, its checkpoints
    "tests/train/test_resume.py",
    "tests/train/test_gpu_rehearsal.py",
    "tests/train/test_dpo.py",
    "tests/train/test_trl_tokenized_dpo.py",
    "tests/train/test_dpo_training.py",
    "tests/test_cli_errors.py",  # one-line errors, no third-party lines
)


def _mark_megatron_internals(items) -> None:
    missing = [path for path in MEGATRON_INTERNALS if not (REPO_ROOT / path).exists()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py MEGATRON_INTERNALS names {', '.join(missing)}, which do not exist")
    for item in items:
        if item.nodeid.startswith(MEGATRON_INTERNALS):
            item.add_marker(pytest.mark.megatron_internals)


def pytest_collection_modifyitems(items):
    durations = json.loads(FILE_DURATIONS.read_text())
    _mark_megatron_internals(items)
    items.sort(key=lambda item: -durations.get(item.nodeid.split("::")[0], 0.0))


def pytest_terminal_summary(terminalreporter):
    """What a test recorded as its `summary` property (`record_property("summary", line)`), printed at
    the end of the run, also from pytest-xdist's workers (a passing test's own output is not shown)."""
    for report in terminalreporter.getreports("passed") + terminalreporter.getreports("failed"):
        for name, line in report.user_properties:
            if name == "summary" and report.when == "call":
                terminalreporter.write_line(f"{report.nodeid}: {line}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _in_process_only(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _in_process_only(item):
        yield


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> dict[str, Path]:
    """DIR/text (GQA Llama + tokenizer with chat template), DIR/vision-clip, DIR/vision-siglip."""
    from megatron_ext.demo.tiny_models import make_all

    return make_all(tmp_path_factory.mktemp("tiny_hf"))


@pytest.fixture(scope="session")
def tiny_qwen2_tied(tmp_path_factory) -> Path:
    """A Qwen2-style text model (q/k/v bias) with tied embeddings."""
    from megatron_ext.demo.tiny_models import TinyTextSpec, make_text_model

    return make_text_model(tmp_path_factory.mktemp("tiny_qwen2") / "text", TinyTextSpec(arch="qwen2", tie_word_embeddings=True))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    """A Qwen3 text model: q/k RMSNorm per head, head_dim 32 (hidden 64 / 4 heads would be 16)."""
    from megatron_ext.demo.tiny_models import TinyTextSpec, make_text_model

    return make_text_model(tmp_path_factory.mktemp("tiny_qwen3") / "text", TinyTextSpec(arch="qwen3"))


def _build(tmp_path_factory, name, text, vision, padding=False) -> Path:
    from megatron_ext.hf.build_llava import build_llava

    return build_llava(tmp_path_factory.mktemp(name) / "hf", str(text), str(vision), vocab_size_padding=padding)


@pytest.fixture(scope="session")
def llava_clip(tmp_path_factory, tiny_hf) -> Path:
    """LLaVA: GQA Llama + CLIP (feature layer -2, CLS dropped). Vocab 718 (Megatron pads to 768)."""
    return _build(tmp_path_factory, "llava_clip", tiny_hf["text"], tiny_hf["vision-clip"])


@pytest.fixture(scope="session")
def llava_qwen2_siglip(tmp_path_factory, tiny_qwen2_tied, tiny_hf) -> Path:
    """LLaVA: Qwen2-style (qkv bias, tied embeddings) + SigLIP (all patches, no post-norm)."""
    return _build(tmp_path_factory, "llava_qwen2_siglip", tiny_qwen2_tied, tiny_hf["vision-siglip"])


@pytest.fixture(scope="session")
def tiny_qwen2_chatml(tmp_path_factory) -> Path:
    """A Qwen2-style text model with a tokenizer as Qwen2's: byte-level BPE, ChatML's special tokens
    (<|im_start|>, <|im_end|>), no BOS, ChatML as its chat template."""
    from megatron_ext.demo.tiny_models import TinyTextSpec, make_text_model

    return make_text_model(tmp_path_factory.mktemp("tiny_qwen2_chatml") / "text", TinyTextSpec(arch="qwen2", tokenizer="chatml"))


@pytest.fixture(scope="session")
def llava_qwen2_chatml(tmp_path_factory, tiny_qwen2_chatml, tiny_hf) -> Path:
    """LLaVA: the ChatML Qwen2 + CLIP; its tokenizer adds <image>."""
    return _build(tmp_path_factory, "llava_qwen2_chatml", tiny_qwen2_chatml, tiny_hf["vision-clip"])


@pytest.fixture(scope="session")
def llava_qwen3_siglip(tmp_path_factory, tiny_qwen3, tiny_hf) -> Path:
    """LLaVA: Qwen3 (q/k norms, head_dim != hidden/heads) + SigLIP."""
    return _build(tmp_path_factory, "llava_qwen3_siglip", tiny_qwen3, tiny_hf["vision-siglip"])


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> Path:
    """A Gemma 3 text model: (1 + w) norms (random w), post-norms, a 5-key window on layer 1 only,
    per-layer RoPE bases, an attention scale other than 1 / sqrt(head_dim)."""
    from megatron_ext.demo.tiny_models import TinyTextSpec, make_text_model

    return make_text_model(tmp_path_factory.mktemp("tiny_gemma3") / "text", TinyTextSpec(arch="gemma3_text"))


@pytest.fixture(scope="session")
def llava_gemma3_siglip(tmp_path_factory, tiny_gemma3, tiny_hf) -> Path:
    """LLaVA: Gemma 3 text + SigLIP."""
    return _build(tmp_path_factory, "llava_gemma3_siglip", tiny_gemma3, tiny_hf["vision-siglip"])


@pytest.fixture(scope="session")
def llava_mistral_clip(tmp_path_factory, tiny_hf) -> Path:
    """LLaVA: Mistral (a 6-key sliding window on every layer, shorter than the test prompts) + CLIP."""
    from megatron_ext.demo.tiny_models import TinyTextSpec, make_text_model

    text = make_text_model(tmp_path_factory.mktemp("tiny_mistral") / "text", TinyTextSpec(arch="mistral"))
    return _build(tmp_path_factory, "llava_mistral_clip", text, tiny_hf["vision-clip"])


@pytest.fixture(scope="session")
def llava_phi3_clip(tmp_path_factory, tiny_hf) -> Path:
    """LLaVA: Phi-3 (fused qkv_proj and gate_up_proj, GQA, a 6-key sliding window on every layer) + CLIP."""
    from megatron_ext.demo.tiny_models import TinyTextSpec, make_text_model

    text = make_text_model(tmp_path_factory.mktemp("tiny_phi3") / "text", TinyTextSpec(arch="phi3"))
    return _build(tmp_path_factory, "llava_phi3_clip", text, tiny_hf["vision-clip"])


@pytest.fixture(scope="session")
def llava_internvit(tmp_path_factory, tiny_hf) -> Path:
    """LLaVA: GQA Llama + InternViT (layer scale, class token dropped, last layer)."""
    return _build(tmp_path_factory, "llava_internvit", tiny_hf["text"], tiny_hf["vision-internvl"])


@pytest.fixture(scope="session")
def llava_next_clip(tmp_path_factory, tiny_hf) -> Path:
    """LLaVA-NeXT: GQA Llama + CLIP (56-pixel tiles of 4x4 patches, class token dropped), the
    published grids of 56 (1x2, 2x1, 2x2, 3x1, 1x3 tiles)."""
    from megatron_ext.hf.build_llava import build_llava

    return build_llava(tmp_path_factory.mktemp("llava_next_clip") / "hf", str(tiny_hf["text"]),
                       str(tiny_hf["vision-clip"]), arch="llava-next")


@pytest.fixture(scope="session")
def llava_onevision_siglip(tmp_path_factory, tiny_qwen2_tied, tiny_hf) -> Path:
    """LLaVA-OneVision: Qwen2-style (tied embeddings) + SigLIP (56-pixel tiles), grids of 1..6 x
    1..6 tiles, anyres_max_2: grids with more than about 2 tiles of features are downsampled."""
    from megatron_ext.hf.build_llava import build_llava

    return build_llava(tmp_path_factory.mktemp("llava_onevision_siglip") / "hf", str(tiny_qwen2_tied),
                       str(tiny_hf["vision-siglip"]), arch="llava-onevision", anyres_max=2)


@pytest.fixture(scope="session")
def onevision_own_video_settings(tmp_path_factory, llava_onevision_siglip) -> Path:
    """llava_onevision_siglip whose video processor resizes and normalizes frames unlike its image
    processor does the tiles (bilinear, other mean and std)."""
    hf_dir = tmp_path_factory.mktemp("onevision_own_video_settings") / "hf"
    shutil.copytree(llava_onevision_siglip, hf_dir)
    path = hf_dir / "processor_config.json"
    config = json.loads(path.read_text())
    config["video_processor"].update(resample=2, image_mean=[0.25, 0.5, 0.75], image_std=[0.2, 0.3, 0.4])
    path.write_text(json.dumps(config, indent=2))
    return hf_dir


@pytest.fixture(scope="session")
def megatron_onevision(tmp_path_factory, llava_onevision_siglip) -> Path:
    """The llava_onevision_siglip fixture converted to a Megatron checkpoint (TP1 x PP1)."""
    from megatron_ext.convert.to_megatron import convert

    return convert(llava_onevision_siglip, tmp_path_factory.mktemp("megatron_onevision") / "ckpt", tp=1, pp=1)


@pytest.fixture(scope="session")
def tiled_mix(tmp_path_factory):
    """(prepared dataset, its build report) of tests/support/tiled_data.py's OneVision mix."""
    from megatron_ext.data.build import build_energon_dataset
    from tests.support.tiled_data import write_mix_json

    mix = write_mix_json(tmp_path_factory.mktemp("tiled_src"))
    out = tmp_path_factory.mktemp("tiled_data") / "energon"
    report = build_energon_dataset(mix, out, split_ratio="1,0,0", samples_per_shard=8, num_workers=0)
    return out, report


@pytest.fixture(scope="session")
def llava_padded(tmp_path_factory, tiny_hf) -> Path:
    """LLaVA built with --vocab-size-padding (vocab 768, a multiple of 128)."""
    return _build(tmp_path_factory, "llava_padded", tiny_hf["text"], tiny_hf["vision-clip"], padding=True)


@pytest.fixture(scope="session")
def megatron_qwen2_chatml(tmp_path_factory, llava_qwen2_chatml) -> Path:
    """The llava_qwen2_chatml fixture converted to a Megatron checkpoint (TP1 x PP1)."""
    from megatron_ext.convert.to_megatron import convert

    return convert(llava_qwen2_chatml, tmp_path_factory.mktemp("megatron_qwen2_chatml") / "ckpt", tp=1, pp=1)


@pytest.fixture(scope="session")
def megatron_clip(tmp_path_factory, llava_clip) -> Path:
    """The llava_clip fixture converted to a Megatron checkpoint (TP1 x PP1)."""
    from megatron_ext.convert.to_megatron import convert

    return convert(llava_clip, tmp_path_factory.mktemp("megatron_clip") / "ckpt", tp=1, pp=1)


@pytest.fixture(scope="session")
def preference_data(tmp_path_factory) -> Path:
    """96 synthetic preference pairs (the true answer chosen, a hallucination or a wrong fact rejected) as
    prepared shards of 8: train 80, val 16."""
    from megatron_ext.data.build import build_energon_dataset
    from megatron_ext.demo.synthetic_data import SyntheticSpec, make_synthetic_dataset

    source = make_synthetic_dataset(tmp_path_factory.mktemp("preference_src"),
                                    SyntheticSpec(num_samples=96, seed=3, task="preference"))
    out = tmp_path_factory.mktemp("preference_data") / "energon"
    build_energon_dataset(source, out, split_ratio="10,2,0", samples_per_shard=8, num_workers=0, task="preference")
    return out


@pytest.fixture(scope="session")
def train_data(tmp_path_factory) -> Path:
    """96 synthetic samples (30% multi-turn) as prepared shards of 8: train 80, val 16."""
    from megatron_ext.data.build import build_energon_dataset
    from megatron_ext.demo.synthetic_data import SyntheticSpec, make_synthetic_dataset

    source = make_synthetic_dataset(tmp_path_factory.mktemp("train_src"), SyntheticSpec(num_samples=96, seed=3))
    out = tmp_path_factory.mktemp("train_data") / "energon"
    build_energon_dataset(source, out, split_ratio="10,2,0", samples_per_shard=8, num_workers=0)
    return out
