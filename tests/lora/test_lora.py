"""LoRA training (--lora-rank): only the adapters (and the projector when asked) change, the base
model stays bit-identical, the loss falls, and TP2 and PP2 train exactly like one process. The
trainer's LoRA runs at TP2 x PP2 and TP2 x DP2 with the distributed optimizer save, resume exactly,
export (merged and PEFT) and load in another layout."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from tests.support.helpers import run_ranks, run_script
from tests.support.training import assert_held_state_is_planned, metrics, train, trainer_args

WORKER = str(Path(__file__).with_name("lora_worker.py"))
LORA = {"lora_rank": 4, "lora_alpha": 8.0, "lora_train_projector": True}
LONG_RUN = 24

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


def _run(tmp_path, megatron_clip, train_data, nproc, iters, **options) -> list[dict]:
    run_ranks(nproc, WORKER, megatron_clip, train_data, tmp_path, json.dumps({**LORA, **options}), iters, timeout=300)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, megatron_clip, train_data) -> dict:
    return _run(tmp_path_factory.mktemp("lora_tp1"), megatron_clip, train_data, 1, LONG_RUN)[0]


def _is_trained(name: str) -> bool:
    return name.endswith((".lora_a.weight", ".lora_b.weight")) or name.startswith("vision_projection.")


def test_only_adapters_and_projector_change(one_process):
    adapters = [n for n in one_process["trainable"] if ".lora_" in n]
    # 2 layers x 4 targets x (A, B)
    assert len(adapters) == 16
    assert all(_is_trained(n) for n in one_process["trainable"])
    assert any(n.startswith("vision_projection.") for n in one_process["trainable"])
    # Every trained tensor moved; every base tensor is bit-identical.
    assert one_process["changed"] == one_process["trainable"]
    assert one_process["optimized"] == one_process["trainable_numel"]


def test_loss_falls(one_process):
    losses = [s["loss"] for s in one_process["steps"]]
    # Step i sees batch i % 3: compare each batch's first and last visit.
    for batch in range(3):
        assert losses[LONG_RUN - 3 + batch] < 0.9 * losses[batch]


def test_tp2_x_pp2_trains_like_one_process(tmp_path, megatron_clip, train_data, one_process):
    # One run of both splits (TP and PP): their launches cost more than their steps.
    ranks = _run(tmp_path, megatron_clip, train_data, 4, 3, tp=2, pp=2)
    for got, expected in zip(ranks[0]["steps"], one_process["steps"][:3]):
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-5)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5, abs=1e-5)
    for rank in ranks:
        assert rank["trainable"] and all(_is_trained(n) for n in rank["trainable"])
        assert rank["changed"] == rank["trainable"]
    # Each stage (ranks 0-1, then 2-3) holds the TP halves of its own layer's adapters; the projector
    # lives on the first.
    assert [len([n for n in r["trainable"] if ".lora_" in n]) for r in ranks] == [8, 8, 8, 8]
    assert not any(re.match("vision_projection", n) for r in ranks[2:] for n in r["trainable"])


def _train_records(save_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (save_dir / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]


def _numel(entry) -> int:
    return math.prod(getattr(entry, "global_shape", ()))


# Where adapters are split (TP: column B, row A; gated fc1, GQA qkv), on two pipeline stages, and
# with their optimizer state sharded over data-parallel ranks as well. Both layouts split at TP2, so
# a TP2-only run would check nothing more.
LAYOUTS = {"tp2_pp2": (4, {"tp": 2, "pp": 2}), "tp2_dp2_dist_optim": (4, {"tp": 2, "dist_optim": True})}
RUN = dict(train_iters=4, save_interval=2, save_optim=True, lora_rank=4, lora_alpha=8.0, lora_train_projector=True)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def lora_run(request, tmp_path_factory, megatron_clip, train_data) -> Path:
    """The trainer's LoRA run of 4 iterations in one layout, saved at 2 and 4, then resumed from 2
    (metrics.jsonl holds both passes over iterations 3 and 4)."""
    from megatron_ext.checkpoint import layout

    nproc, layout_args = LAYOUTS[request.param]
    save = tmp_path_factory.mktemp(f"lora_{request.param}") / "run"
    args = trainer_args(megatron_clip, train_data, save, **RUN, **layout_args)
    train(nproc, *args, timeout=300)
    shutil.rmtree(save / layout.snapshot_name(4))
    layout.mark_latest(save, 2)
    train(nproc, *args, timeout=300)
    return save


def test_each_rank_held_the_state_its_memory_plan_counts(lora_run):
    """Issue 36 with LoRA at four ranks: each rank's parameters, gradient buffers and optimizer state (the
    adapters' and the projector's) at TP2 x PP2, and at TP2 x DP2 sharded by the distributed optimizer,
    in the first run and in the resumed one."""
    assert_held_state_is_planned(lora_run)


def test_adapter_checkpoint_is_small_names_its_base_and_resumes_exactly(megatron_clip, lora_run):
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    from megatron_ext.checkpoint import layout
    from megatron_ext.lora.checkpoint import fingerprint

    save = lora_run
    base = layout.find_snapshot(megatron_clip)
    snapshot = layout.find_snapshot(save)
    assert snapshot.lora_base == {"path": str(base.path), "fingerprint": fingerprint(base.path)}
    assert snapshot.trainer_options["lora_rank"] == 4
    # megatron-core 0.19 also stores the checkpoint's common (non-tensor) state, as one object.
    stored = {k: v for k, v in load_sharded_metadata(str(snapshot.path)).items() if not k.startswith("common_state/")}
    model_keys = [k for k in stored if not k.startswith("optimizer.")]
    assert model_keys and all(".lora_" in k or k.startswith("vision_projection.") for k in model_keys)
    assert all(".lora_" in k or "vision_projection." in k for k in stored if k.startswith("optimizer."))
    base_stored = load_sharded_metadata(str(base.path))
    base_numel = sum(_numel(t) for t in base_stored.values())
    assert sum(_numel(stored[k]) for k in model_keys) < 0.1 * base_numel  # 6%: rank 4 and the projector
    # Whatever the layout, the adapters of all 4 targets are stored whole: (layers, rank, in) and
    # (layers, out, rank) beside their weight's (layers, out, in).
    adapted = {k[: -len(".lora_a.weight")] for k in model_keys if k.endswith(".lora_a.weight")}
    assert len(adapted) == 4
    for name in adapted:
        layers, out_features, in_features = base_stored[name + ".weight"].global_shape
        assert stored[name + ".lora_a.weight"].global_shape == (layers, 4, in_features)
        assert stored[name + ".lora_b.weight"].global_shape == (layers, out_features, 4)

    # Resumed from iteration 2, the run repeats iterations 3 and 4 exactly.
    records = _train_records(save)
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 3, 4]
    for first, resumed in zip(records[2:4], records[4:]):
        assert (resumed["loss"], resumed["grad_norm"], resumed["samples_digest"]) == \
            (first["loss"], first["grad_norm"], first["samples_digest"])


@pytest.fixture(scope="module")
def exported(tmp_path_factory, lora_run) -> tuple[Path, Path]:
    """The run's adapters merged into an HF LLaVA, and as a PEFT adapter (read at TP1, whatever the layout)."""
    out = tmp_path_factory.mktemp("lora_export")
    merged, adapter = out / "merged", out / "adapter"
    run_script("convert/convert_megatron_to_hf.py", "--megatron-dir", lora_run, "--hf-dir", merged, "--lora-merge",
               "--lora-adapter-dir", adapter)
    return merged, adapter


def test_exports_equal_the_megatron_model_with_adapters(llava_clip, lora_run, exported):
    """The PEFT adapter on the HF base (loaded by peft), the merged HF model and the Megatron base
    with its adapters (loaded in one process) give the same logits."""
    import torch
    from peft import PeftModel
    from transformers import LlavaForConditionalGeneration

    from megatron_ext import hf_loading
    from megatron_ext.convert.compare import compare, hf_logits, process_inputs, synthetic_image

    merged, adapter = exported
    assert compare(merged, lora_run).max_abs <= 1e-4

    processor = hf_loading.load_processor(str(merged), "--hf-dir")
    batch = process_inputs(processor, [synthetic_image()])
    base = LlavaForConditionalGeneration.from_pretrained(llava_clip, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(**batch).logits
        peft_logits = PeftModel.from_pretrained(base, adapter).eval()(**batch).logits
    merged_logits = hf_logits(merged, batch)
    assert (peft_logits - merged_logits).abs().max() <= 1e-4
    assert (peft_logits - base_logits).abs().max() > 1e-3  # the adapters changed the model


@pytest.mark.parametrize("lora_run", ["tp2_pp2"], indirect=True)
def test_generate_with_the_adapter_checkpoint_answers_as_the_merged_model(tmp_path, lora_run, exported):
    """generate.py runs the adapter checkpoint (on its base) as the merged HF model answers."""
    from megatron_ext.convert.compare import synthetic_image

    image = tmp_path / "image.png"
    synthetic_image().save(image)
    answers = [run_script("eval/generate.py", flag, path, "--image", image, "--prompt", "Describe this image.",
                          "--max-new-tokens", 8, timeout=120).stdout.strip()
               for flag, path in (("--megatron-dir", lora_run), ("--hf-dir", exported[0]))]
    assert answers[0] and answers[0] == answers[1]


@pytest.mark.parametrize("lora_run", ["tp2_pp2"], indirect=True)
@pytest.mark.parametrize("load_optim", [True, False], ids=["with_optimizer", "without_optimizer"])
def test_a_tp2_pp2_adapter_checkpoint_resumes_at_tp1(tmp_path, megatron_clip, train_data, lora_run, load_optim):
    """TP2 x PP2's snapshot at iteration 2 continued in one process: the split and the replicated adapters
    of both stages (and their optimizer state) resharded on load, the same run to float noise; without the optimizer
    state the weights still continue (iteration 3) and Adam starts afresh (iteration 4 differs)."""
    from megatron_ext.checkpoint import layout

    moved = tmp_path / "moved"
    shutil.copytree(lora_run, moved, ignore=shutil.ignore_patterns("iter_0000004", "metrics.jsonl", "tensorboard"))
    layout.mark_latest(moved, 2)
    fresh_adam = () if load_optim else ("--no-load-optim",)
    train(1, *trainer_args(megatron_clip, train_data, moved, **RUN), *fresh_adam, timeout=240)
    expected, got = metrics(lora_run), metrics(moved)
    assert sorted(got) == [3, 4]
    continued = (3, 4) if load_optim else (3,)
    for iteration in continued:
        assert got[iteration]["samples_digest"] == expected[iteration]["samples_digest"]
        assert got[iteration]["loss"] == pytest.approx(expected[iteration]["loss"], rel=1e-5)
        assert got[iteration]["grad_norm"] == pytest.approx(expected[iteration]["grad_norm"], rel=1e-4)
    if not load_optim:
        assert got[4]["loss"] != pytest.approx(expected[4]["loss"], rel=1e-5)
