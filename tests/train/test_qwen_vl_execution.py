"""Qwen2.5-VL and Qwen3-VL train (stage 2) with the execution switches LLaVAs have: --compile-layers.
The tiny models converted from transformers, on one synthetic conversation repeated in every micro
batch, on CPU ranks."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support import qwen2_5_vl, qwen3_vl
from tests.support.training import metrics, train, trainer_args

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

ITERS = 3
# SGD, as in test_qwen2_5_vl_training: Adam would grow float noise in near-zero gradients into the losses.
SGD = {"optimizer": "sgd", "sgd_momentum": 0.9, "lr": 1e-3}
SUPPORT = {"qwen2_5_vl": qwen2_5_vl, "qwen3_vl": qwen3_vl}


def _write_hf(support, out: Path) -> Path:
    support.write_tiny_model(out)
    qwen2_5_vl.tiny_tokenizer().save_pretrained(out)  # its media and turn tokens at the tiny models' ids
    config = json.loads((out / "config.json").read_text())
    # The task encoder takes a video's time scale from the tower's config, which Qwen3-VL's lacks (its
    # time is text); the conversation here holds an image only.
    config["vision_config"].setdefault("tokens_per_second", 2)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module", params=sorted(SUPPORT))
def tiny(request, tmp_path_factory):
    """A family's tiny model: HF checkpoint and its TP1 conversion."""
    from megatron_ext.convert.to_megatron import convert

    root = tmp_path_factory.mktemp(request.param)
    hf = _write_hf(SUPPORT[request.param], root / "hf")
    return SimpleNamespace(name=request.param, support=SUPPORT[request.param].__name__, hf=hf,
                           megatron=convert(hf, root / "tp1", 1, 1))


@pytest.fixture(scope="module")
def one_batch(tmp_path_factory):
    """One synthetic conversation with an image: every micro batch holds it twice."""
    from megatron_ext.data.build import build_energon_dataset
    from megatron_ext.demo.synthetic_data import SyntheticSpec, make_synthetic_dataset

    source = make_synthetic_dataset(tmp_path_factory.mktemp("qwen_src"), SyntheticSpec(num_samples=1, seed=3))
    out = tmp_path_factory.mktemp("qwen_data") / "energon"
    build_energon_dataset(source, out, split_ratio="1,0,0", samples_per_shard=1, num_workers=0)
    return out


def _train(save: Path, tiny, data: Path, nproc: int = 1, **options) -> tuple[dict, str]:
    result = train(nproc, *trainer_args(tiny.megatron, data, save, **{"train_iters": ITERS, "dtype": "float32",
                                                                         "log_interval": 1, **SGD, **options}),
                   timeout=800)
    return metrics(save), result.stdout + result.stderr


@pytest.fixture(scope="module")
def tp1_run(tmp_path_factory, tiny, one_batch):
    return _train(tmp_path_factory.mktemp(f"{tiny.name}_tp1") / "run", tiny, one_batch)[0]


def _assert_steps_equal(run: dict, reference: dict) -> None:
    assert run.keys() == reference.keys() == set(range(1, ITERS + 1))
    for i, expected in reference.items():
        assert run[i]["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=0), i
        assert run[i]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5, abs=0), i


def test_compiled_layers_train_like_eager_ones_and_break_no_graph(tmp_path, tiny, one_batch, tp1_run):
    """Qwen3-VL's DeepStack hooks run inside the compiled first layers."""
    compiled, output = _train(tmp_path / "compiled", tiny, one_batch, compile_layers=True)
    assert "--compile-layers: torch.compile left" not in output, output[-3000:]
    _assert_steps_equal(compiled, tp1_run)
