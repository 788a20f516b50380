"""The checkpoints people download (tests/shapes): every published LLaVA, and a LLaVA around every
published tower, converts at every layout its head counts allow up to TP8 / PP2, and is refused in
one line at the others.

Two tiers, both from the published config.json as the Hub has it (sparse: transformers' defaults
left out):
- at the real widths, two layers: every rank's model of every layout, built on the meta device,
  passes the converter's own checks against the tensors transformers makes of the config (every
  Megatron tensor filled, with the shape its rank holds, every HF tensor used once);
- numerically, two layers with every head count, image and patch size, grid and setting as
  published but narrow heads and MLPs (and SigLIP so400m/14-384, the tower off its patch grid, also
  at its real widths), at TP1, the largest TP and (for the LLaVAs) TP2 x PP2: every layout stores the
  same tensors bit for bit, HF -> Megatron -> HF at the largest layout is bit-exact, and the Megatron
  logits at each layout equal transformers' on an image (tiled on a grid for NeXT and OneVision).
  The other layouts differ from these only in how many heads a rank holds, which the meta tier checks.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import hf_tensors, run_python, run_torchrun
from tests.shapes import (
    LAYOUTS,
    at_two_layers,
    build,
    layouts_allowed,
    llava_shapes,
    narrowed,
    tower_llava,
    tower_shapes,
)

LLAVAS, TOWERS = llava_shapes(), tower_shapes()
CONFIGS = {**LLAVAS, **{name: tower_llava(config) for name, config in TOWERS.items()}}
WORLD = 4  # the most ranks of a numeric layout (the meta tier checks every layout up to TP8 x PP2)
# One model keeps a numeric TP8 check: an 8-rank world is the dearest on CI's two cores.
EIGHT_RANKS = "llava-hf--llava-1.5-7b-hf"
# The numeric tier; a model whose config another already has (SigLIP 2 so400m/14-384 is SigLIP
# so400m/14-384) is built once.
WIDE_TOWER = "google--siglip-so400m-patch14-384"
NUMERIC = {}
for _name, _config in {**{n: narrowed(c) for n, c in CONFIGS.items()},
                       f"{WIDE_TOWER}@width": at_two_layers(CONFIGS[WIDE_TOWER])}.items():
    if _config not in NUMERIC.values():
        NUMERIC[_name] = _config


def _numeric_layouts(name: str) -> list[tuple[int, int]]:
    """TP1, the largest TP of at most WORLD ranks (8 for EIGHT_RANKS), and TP2 x PP2 for the LLaVAs, where
    their heads allow."""
    base = name.removesuffix("@width")
    world = 8 if name == EIGHT_RANKS else WORLD
    allowed = [layout for layout in layouts_allowed(CONFIGS[base]) if layout[0] * layout[1] <= world]
    wanted = {(1, 1), max((tp, 1) for tp, pp in allowed)}
    if base in LLAVAS:
        wanted.add((2, 2))
    return sorted(wanted & set(allowed), key=lambda layout: (layout[1], layout[0]))


def _exported(name: str) -> tuple[int, int]:
    """The layout exported back to HF: the one of the most ranks (the others store the same tensors)."""
    return max(_numeric_layouts(name), key=lambda layout: (layout[0] * layout[1], layout[0]))


@pytest.fixture(scope="module")
def meta_checks(tmp_path_factory):
    work = tmp_path_factory.mktemp("shapes_meta")
    request = {"layouts": LAYOUTS, "configs": {name: at_two_layers(c) for name, c in CONFIGS.items()}}
    (work / "in.json").write_text(json.dumps(request))
    run_python("tests/convert/shapes_meta_worker.py", work / "in.json", work / "out.json", timeout=400)
    return json.loads((work / "out.json").read_text())


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_rank_of_every_layout_the_heads_allow_converts_at_the_published_widths(meta_checks, name):
    allowed = layouts_allowed(CONFIGS[name])
    assert (1, 1) in allowed and (2, 1) in allowed  # every published model splits at least two ways
    for tp, pp in LAYOUTS:
        result = meta_checks[name][f"tp{tp}pp{pp}"]
        if (tp, pp) in allowed:
            assert result == {"problems": []}, (tp, pp, result)
        else:
            assert "\n" not in result["refused"] and result["refused"].startswith(f"--tp {tp} does not divide the "), result


@pytest.fixture(scope="module")
def numeric(tmp_path_factory):
    """OUT of shapes_worker.py over every model of NUMERIC, and the HF directories."""
    work = tmp_path_factory.mktemp("shapes_numeric")
    hf_dirs = {name: build(config, work / "built" / name) for name, config in NUMERIC.items()}
    request = {name: {"hf_dir": str(hf_dirs[name]), "layouts": _numeric_layouts(name),
                      "export": [_exported(name)]}
               for name in NUMERIC}
    (work / "in.json").write_text(json.dumps(request))
    out = work / "out"
    # One launch per number of ranks: a layout of fewer ranks than processes would repeat its work.
    for world in sorted({tp * pp for name in NUMERIC for tp, pp in _numeric_layouts(name)}):
        run_torchrun(world, "tests/convert/shapes_worker.py", out, work / "in.json", timeout=600)
    return out, hf_dirs


@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", list(NUMERIC))
def test_round_trip_is_bit_exact_and_logits_equal_transformers_at_every_layout(numeric, name):
    from megatron_ext.checkpoint.layout import find_snapshot
    from megatron_ext.convert.compare import hf_logits, logit_stats
    from megatron_ext.convert.dist_read import by_layer, read_tensors, stored_tensors

    out, hf_dirs = numeric
    original = hf_tensors(hf_dirs[name])
    tp, pp = _exported(name)
    back = hf_tensors(out / "hf" / name / f"tp{tp}pp{pp}")
    assert sorted(back) == sorted(original)
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key

    def stored(tp, pp):
        path = find_snapshot(out / "megatron" / name / f"tp{tp}pp{pp}").path
        return {k: t for group in by_layer(stored_tensors(path, ("",))) for k, t in read_tensors(path, group).items()}

    at_tp1 = stored(1, 1)
    reference = hf_logits(hf_dirs[name], torch.load(out / "logits" / f"{name}-inputs.pt"))
    assert reference.std() > 0.1  # logits that differ visibly, so the comparison can fail
    for tp, pp in _numeric_layouts(name):
        tensors = stored(tp, pp)
        assert sorted(tensors) == sorted(at_tp1) and all(torch.equal(tensors[k], t) for k, t in at_tp1.items()), (tp, pp)
        logits = torch.load(out / "logits" / f"{name}-tp{tp}pp{pp}.pt")
        stats = logit_stats(reference, logits)
        assert stats.max_abs <= 1e-4, (tp, pp, stats)
        # Over ~1,500 positions two tokens can tie within float noise: where the argmax differs, the
        # token chosen is as likely to transformers too.
        chosen = logits.argmax(-1, keepdim=True)
        assert (reference.max(-1, keepdim=True).values - reference.gather(-1, chosen)).max() <= 1e-4, (tp, pp, stats)
