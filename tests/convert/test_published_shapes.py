"""The checkpoints people download (tests/shapes): every published LLaVA, a LLaVA around every
published tower, and every published Qwen2.5-VL and Qwen3-VL, converts at every layout its head
counts allow up to TP8 / PP2, and is refused in one line at the others.

Two tiers, both from the published config.json as the Hub has it (sparse: transformers' defaults
left out):
- at the real widths, two layers: every rank's model of every layout, built on the meta device,
  passes the converter's own checks against the tensors transformers makes of the config (every
  Megatron tensor filled, with the shape its rank holds, every HF tensor used once);
- numerically, two layers with every head count, image and patch size, grid and setting as
  published but narrow heads and MLPs (and SigLIP so400m/14-384, the tower off its patch grid, also
  at its real widths), at TP2 x PP2, which every published model takes: HF -> Megatron -> HF is
  bit-exact, and the Megatron logits equal transformers' on an image (tiled on a grid for NeXT and
  OneVision). The other layouts differ from it only in how many heads and layers a rank holds, which
  the meta tier checks for every layout; test_roundtrip checks the numbers at TP {1,2} x PP {1,2}.

A Qwen-VL's tower is whole on every tensor rank: only its decoder's heads decide its layouts. In
its meta tier the decoder gets two layers per DeepStack feature (`at_two_layers`). Its numeric tier
(`narrowed_qwen_vl`: heads of 16 channels in the decoder and 8 in the tower, every tower block,
window, full-attention block, DeepStack index, vocabulary and tying as published, the mRoPE sections
scaled to the narrower heads) takes one model per distinct setting (Qwen2.5-VL 3B: tied, 2 KV
heads; 7B: 28 heads over 4 KV heads; Qwen3-VL 2B and 8B: their two towers and DeepStack indexes,
tied and not), in the same launch, on a prompt of one image (`tests.shapes.qwen_vl_sample`).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.shapes import (
    LAYOUTS,
    at_two_layers,
    build,
    build_qwen_vl,
    layouts_allowed,
    llava_shapes,
    narrowed,
    narrowed_qwen_vl,
    qwen_vl_sample,
    qwen_vl_shapes,
    tower_llava,
    tower_shapes,
)
from tests.support.helpers import hf_tensors, run_python, run_ranks

LLAVAS, TOWERS, QWEN_VL = llava_shapes(), tower_shapes(), qwen_vl_shapes()
CONFIGS = {**LLAVAS, **{name: tower_llava(config) for name, config in TOWERS.items()}}
EVERY_SHAPE = {**CONFIGS, **QWEN_VL}
# The numeric tier; a model whose config another already has (SigLIP 2 so400m/14-384 is SigLIP
# so400m/14-384) is built once.
WIDE_TOWER = "google--siglip-so400m-patch14-384"
NUMERIC = {}
for _name, _config in {**{n: narrowed(c) for n, c in CONFIGS.items()},
                       f"{WIDE_TOWER}@width": at_two_layers(CONFIGS[WIDE_TOWER])}.items():
    if _config not in NUMERIC.values():
        NUMERIC[_name] = _config
# One narrowed Qwen-VL per distinct setting (the module's docstring).
QWEN_NUMERIC = {name: narrowed_qwen_vl(QWEN_VL[name]) for name in (
    "Qwen--Qwen2.5-VL-3B-Instruct", "Qwen--Qwen2.5-VL-7B-Instruct", "Qwen--Qwen3-VL-2B-Instruct",
    "Qwen--Qwen3-VL-8B-Instruct")}
# Wider than tall: 9 x 5 merged tokens for Qwen2.5-VL (three windows across, two down), 8 x 5 for Qwen3-VL.
QWEN_IMAGE = (250, 150)


# The numeric layout: it splits both TP and PP, in one launch of four ranks.
NUMERIC_LAYOUT = (2, 2)


@pytest.fixture(scope="module")
def meta_checks(tmp_path_factory):
    work = tmp_path_factory.mktemp("shapes_meta")
    request = {"layouts": LAYOUTS, "configs": {name: at_two_layers(c) for name, c in EVERY_SHAPE.items()}}
    (work / "in.json").write_text(json.dumps(request))
    run_python("tests/convert/shapes_meta_worker.py", work / "in.json", work / "out.json", timeout=560)
    return json.loads((work / "out.json").read_text())


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(EVERY_SHAPE))
def test_every_rank_of_every_layout_the_heads_allow_converts_at_the_published_widths(meta_checks, name):
    allowed = layouts_allowed(EVERY_SHAPE[name])
    assert (1, 1) in allowed and (2, 1) in allowed  # every published model splits at least two ways
    for tp, pp in LAYOUTS:
        result = meta_checks[name][f"tp{tp}pp{pp}"]
        if (tp, pp) in allowed:
            assert result == {"problems": []}, (tp, pp, result)
        else:
            assert "\n" not in result["refused"] and result["refused"].startswith(f"--tp {tp} does not divide the "), result


@pytest.fixture(scope="module")
def numeric(request, tmp_path_factory):
    """OUT of shapes_worker.py over every model of NUMERIC and QWEN_NUMERIC, and the HF directories."""
    failed_before = request.session.testsfailed
    work = tmp_path_factory.mktemp("shapes_numeric")
    hf_dirs = {name: build(config, work / "built" / name) for name, config in NUMERIC.items()}
    hf_dirs.update({name: build_qwen_vl(config, work / "built" / name) for name, config in QWEN_NUMERIC.items()})
    job = {name: {"hf_dir": str(hf_dirs[name]), "layouts": [NUMERIC_LAYOUT], "export": [NUMERIC_LAYOUT]}
           for name in hf_dirs}
    (work / "in.json").write_text(json.dumps(job))
    out = work / "out"
    (out / "inputs").mkdir(parents=True)
    for name, config in QWEN_NUMERIC.items():
        torch.save(qwen_vl_sample(config, QWEN_IMAGE), out / "inputs" / f"{name}.pt")
    tp, pp = NUMERIC_LAYOUT
    run_ranks(tp * pp, "tests/convert/shapes_worker.py", out, work / "in.json", timeout=600)
    yield out, hf_dirs
    # About 6 GB at the published widths: kept, as the suite keeps a tmp_path, only when a test failed.
    if request.session.testsfailed == failed_before:
        shutil.rmtree(work)


@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", [*NUMERIC, *QWEN_NUMERIC])
def test_round_trip_is_bit_exact_and_logits_equal_transformers(numeric, name):
    from megatron_ext.convert.compare import hf_logits, logit_stats

    out, hf_dirs = numeric
    layout = "tp{}pp{}".format(*NUMERIC_LAYOUT)
    original = hf_tensors(hf_dirs[name])
    back = hf_tensors(out / "hf" / name / layout)
    assert sorted(back) == sorted(original)
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key

    # transformers computes a Qwen-VL's positions itself.
    inputs = {k: v for k, v in torch.load(out / "logits" / f"{name}-inputs.pt").items() if k != "position_ids"}
    reference = hf_logits(hf_dirs[name], inputs)
    assert reference.std() > 0.1  # logits that differ visibly, so the comparison can fail
    logits = torch.load(out / "logits" / f"{name}-{layout}.pt")
    stats = logit_stats(reference, logits)
    assert stats.max_abs <= 1e-4, stats
    # Over ~1,500 positions two tokens can tie within float noise: where the argmax differs, the
    # token chosen is as likely to transformers too.
    chosen = logits.argmax(-1, keepdim=True)
    assert (reference.max(-1, keepdim=True).values - reference.gather(-1, chosen)).max() <= 1e-4, stats
