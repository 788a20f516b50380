"""Qwen2.5-VL and Qwen3-VL train (stages 1 and 2; Qwen2.5-VL with LoRA): each tiny model converted
from transformers, trained by the real trainer on one synthetic conversation with an image, repeated in
every micro batch, in float32 on CPU ranks. The projector lies inside the tower: Qwen2.5-VL's patch
merger; Qwen3-VL's merger and its DeepStack mergers (each maps merged ViT features into the decoder's
width, as the main merger does)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import pytest
import torch

from tests.support.helpers import hf_tensors
from tests.support.training import assert_held_state_is_planned, metrics, train, trainer_args

ITERS = 4
# The decoder's linear layers LoRA adapts (--lora-targets qkv,proj,fc1,fc2): weights, not q/k/v's biases.
ADAPTED_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                   "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class Tiny:
    support: str  # the tests.support module of its tiny model
    tower: str  # the prefix its checkpoints store the tower's tensors under
    projections: tuple[str, ...]  # ... and the projector's, inside the tower
    merger_tensors: int
    trained: int  # tensors stage 2 trains: the decoder's and the projector's
    decoder_layers: str  # the prefix of its decoder layers' tensors

    def adapted(self) -> set[str]:
        """The tiny decoder's (4 layers) weights LoRA adapts."""
        return {f"{self.decoder_layers}{i}.{linear}.weight" for i in range(4) for linear in ADAPTED_LINEARS}


FAMILIES = {
    "qwen2_5_vl": Tiny("tests.support.qwen2_5_vl", "visual.", ("visual.merger.",), 5, 56, "model.layers."),
    "qwen3_vl": Tiny("tests.support.qwen3_vl", "model.visual.",
                     ("model.visual.merger.", "model.visual.deepstack_merger_list."), 18, 65,
                     "model.language_model.layers."),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def qwen_hf(request, tmp_path_factory):
    """(the family's Tiny, its tiny model's directory)."""
    tiny = FAMILIES[request.param]
    return tiny, importlib.import_module(tiny.support).write_tiny_model(tmp_path_factory.mktemp(f"{request.param}_hf"))


@pytest.fixture(scope="module")
def qwen_megatron(tmp_path_factory, qwen_hf):
    from megatron_ext.convert.to_megatron import convert

    return convert(qwen_hf[1], tmp_path_factory.mktemp("qwen_vl_megatron") / "tp1", 1, 1)


@pytest.fixture(scope="module")
def one_batch(tmp_path_factory):
    """One synthetic conversation with an image: every micro batch holds it twice."""
    from megatron_ext.data.build import build_energon_dataset
    from megatron_ext.demo.synthetic_data import SyntheticSpec, make_synthetic_dataset

    source = make_synthetic_dataset(tmp_path_factory.mktemp("qwen_src"), SyntheticSpec(num_samples=1, seed=3))
    out = tmp_path_factory.mktemp("qwen_data") / "energon"
    build_energon_dataset(source, out, split_ratio="1,0,0", samples_per_shard=1, num_workers=0)
    return out


def _train(save, checkpoint, data, tp: int, **options):
    train(tp, *trainer_args(checkpoint, data, save, tp=tp, **{"train_iters": ITERS, "dtype": "float32", **options}),
          timeout=200)
    return metrics(save)


# SGD: Adam's first steps move every weight by about lr whatever its gradient's size, so float noise
# in a near-zero gradient (TP1 and TP2 sum in different orders) would grow into the next losses.
SGD = {"optimizer": "sgd", "sgd_momentum": 0.9, "lr": 1e-3}


# Above every synthetic image (at most 96 x 96): the run trains as without it, and the checkpoint
# carries it to the eval commands.
TRAINED_MAX_PIXELS = 200_000


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory, qwen_megatron, one_batch):
    save = tmp_path_factory.mktemp("qwen_tp2") / "run"
    return save, _train(save, qwen_megatron, one_batch, 2, max_pixels=TRAINED_MAX_PIXELS, **SGD)


def _hf_changed(before, after) -> set[str]:
    a, b = hf_tensors(before), hf_tensors(after)
    assert a.keys() == b.keys()
    return {name for name in a if not torch.equal(a[name], b[name])}


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_stage_2_trains_the_decoder_and_the_mergers_and_not_the_rest_of_the_tower(tmp_path, qwen_hf, tp2_run):
    from megatron_ext.convert.to_hf import convert

    (tiny, hf_dir), (save, steps) = qwen_hf, tp2_run
    losses = [steps[i]["loss"] for i in range(1, ITERS + 1)]
    assert all(a > b for a, b in zip(losses, losses[1:])), losses
    assert all(steps[i]["loss_tokens"] == steps[1]["loss_tokens"] for i in steps)  # the same batch every step
    export = convert(save, tmp_path / "hf")
    changed = _hf_changed(hf_dir, export)
    tower = {name for name in hf_tensors(hf_dir) if name.startswith(tiny.tower)}
    mergers = {name for name in tower if name.startswith(tiny.projections)}
    assert changed == set(hf_tensors(hf_dir)) - tower | mergers
    assert len(mergers) == tiny.merger_tensors and len(changed) == tiny.trained
    # Generation, chat and evaluation of the checkpoint resize within the bounds it was trained with.
    from megatron_ext.eval.checkpoints import open_checkpoint

    assert open_checkpoint(str(save), None).encoder.task_encoder.vision.max_pixels == TRAINED_MAX_PIXELS
    # So does transformers' processor of its HF export.
    from transformers import Qwen2VLImageProcessorPil

    assert Qwen2VLImageProcessorPil.from_pretrained(export).size["longest_edge"] == TRAINED_MAX_PIXELS


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_vision_lr_sets_the_towers_rate_and_not_the_mergers(tmp_path, qwen_hf, qwen_megatron, one_batch):
    from megatron_ext.convert.to_hf import convert

    tiny, hf_dir = qwen_hf
    save = tmp_path / "run"
    _train(save, qwen_megatron, one_batch, 2, unfreeze_vit=True, vision_lr=0.0, train_iters=1)
    export = convert(save, tmp_path / "hf")
    changed = _hf_changed(hf_dir, export)
    moved = {name for name in changed if name.startswith(tiny.tower)}
    assert moved == {name for name in hf_tensors(hf_dir) if name.startswith(tiny.projections)}
    assert len(moved) == tiny.merger_tensors and len(changed) == tiny.trained


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_stage_1_trains_the_mergers_and_nothing_else(tmp_path, qwen_hf, qwen_megatron, one_batch):
    from megatron_ext.convert.to_hf import convert

    tiny, hf_dir = qwen_hf
    save = tmp_path / "run"
    steps = _train(save, qwen_megatron, one_batch, 1, stage=1, train_iters=2, **SGD)
    assert steps[2]["loss"] < steps[1]["loss"]
    assert _hf_changed(hf_dir, convert(save, tmp_path / "hf")) == {
        name for name in hf_tensors(hf_dir) if name.startswith(tiny.projections)}


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_lora_at_tp2_trains_the_decoders_linears_and_the_mergers_and_exports_them_merged(tmp_path, qwen_hf, qwen_megatron,
                                                                                       one_batch, record_property):
    """A LoRA run at TP2 (adapters split over the ranks), exported with its adapters merged: exactly the
    adapted weights and the mergers change, and transformers' logits of the export equal the trained
    Megatron model's (its base with the adapters unmerged, loaded as generation loads it), as do
    those of the PEFT adapter export on the original model."""
    from peft import PeftModel

    from megatron_ext import families
    from megatron_ext.convert.lora_export import write_peft_adapter
    from megatron_ext.convert.to_hf import convert
    from tests.support.helpers import run_ranks

    tiny, hf_dir = qwen_hf
    support = importlib.import_module(tiny.support)
    mergers = {name for name in hf_tensors(hf_dir) if name.startswith(tiny.projections)}
    save = tmp_path / "run"
    steps = _train(save, qwen_megatron, one_batch, 2, train_iters=2, lora_rank=4, lora_alpha=8.0,
                   lora_train_projector=True, lr=5e-3)
    assert steps[2]["loss"] < steps[1]["loss"]
    merged = convert(save, tmp_path / "hf", lora_merge=True)
    assert _hf_changed(hf_dir, merged) == tiny.adapted() | mergers
    run_ranks(1, "tests/train/qwen_snapshot_logits.py", save, tmp_path, tiny.support, timeout=200)
    # The mergers travel whole as modules to save.
    peft = PeftModel.from_pretrained(families.load_model(hf_dir, "--hf-dir", dtype=torch.float32),
                                     write_peft_adapter(save, tmp_path / "adapter")).eval()
    for name, sample in support.samples().items():
        ours, base = torch.load(tmp_path / f"{name}.pt"), support.hf_logits(hf_dir, sample)
        with torch.no_grad():
            adapted = peft(**{k: v for k, v in sample.items() if k != "position_ids"}).logits
        apart, moved = (ours - support.hf_logits(merged, sample)).abs().max(), (ours - base).abs().max()
        record_property(name, f"max |dlogit| vs the merged export {apart:.2g}, vs PEFT {(ours - adapted).abs().max():.2g}, "
                              f"vs the base {moved:.2g}; losses {steps[1]['loss']:.6g} -> {steps[2]['loss']:.6g}")
        # The export rounds each merged weight W + scaling * B @ A to float32 once: float noise through
        # the layers, as TP2's different sums give (logits here reach 11).
        assert apart <= 3e-4 and (ours - adapted).abs().max() <= 1e-5, name
        assert moved > 1e-2, name  # the adapters changed the model


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_tp1_trains_as_tp2_does(tmp_path, qwen_megatron, one_batch, tp2_run):
    _, tp2 = tp2_run
    tp1 = _train(tmp_path / "tp1", qwen_megatron, one_batch, 1, **SGD)
    for i in range(1, ITERS + 1):
        assert tp1[i]["loss"] == pytest.approx(tp2[i]["loss"], rel=1e-5, abs=0)
        assert tp1[i]["grad_norm"] == pytest.approx(tp2[i]["grad_norm"], rel=1e-5, abs=0)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_the_towers_varlen_attention_trains_as_transformers_sdpa_does(tmp_path, qwen_megatron, one_batch):
    """--vision-attention varlen (one attention call per tower block: the masked SDPA one on the CPU)
    against the default, with the tower trained too (its backward through either). The micro batch
    holds one picture twice, so attention leaking between images shows in Qwen2.5-VL's windows only;
    tests/model/test_tower_attention.py has different images."""
    runs = {attention: _train(tmp_path / attention, qwen_megatron, one_batch, 1, vision_attention=attention,
                              unfreeze_vit=True, **SGD) for attention in ("sdpa", "varlen")}
    for i in range(1, ITERS + 1):
        assert runs["varlen"][i]["loss"] == pytest.approx(runs["sdpa"][i]["loss"], rel=1e-5, abs=0)
        assert runs["varlen"][i]["grad_norm"] == pytest.approx(runs["sdpa"][i]["grad_norm"], rel=1e-5, abs=0)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_resumed_tp2_run_continues_as_if_never_stopped(tmp_path, qwen_megatron, one_batch):
    # Adam: megatron-core 0.16 loads no SGD state (its optimizer has no init_state_fn for SGD).
    whole = _train(tmp_path / "whole", qwen_megatron, one_batch, 2, save_optim=True)
    resumed = tmp_path / "resumed"
    _train(resumed, qwen_megatron, one_batch, 2, save_optim=True, exit_interval=2)
    assert sorted(metrics(resumed)) == [1, 2]
    after = _train(resumed, qwen_megatron, one_batch, 2, save_optim=True)
    for i in (3, 4):
        assert (after[i]["loss"], after[i]["grad_norm"]) == (whole[i]["loss"], whole[i]["grad_norm"])


@pytest.mark.multiprocess
def test_a_run_is_planned_with_the_pad_token_given_and_its_memory_plan_holds_what_the_tp2_run_held(
        tmp_path, qwen_megatron, one_batch, tp2_run):
    """The plan's parameter, gradient and optimizer bytes per rank (the decoder split over TP, the
    tower whole on each rank) are what the TP2 run recorded holding after its first update."""
    from megatron_ext.config.options import TrainConfig
    from megatron_ext.config.run_plan import make_plan
    from megatron_ext.memory.check import check_memory

    config = TrainConfig(megatron_load_dir=str(qwen_megatron), data_path=str(one_batch), save_dir=str(tmp_path), tp=2,
                         pad_token_id=506, train_iters=1)
    plan = make_plan(config, 2, on_gpu=False, te=False)
    assert (plan.config.image_token_id, plan.config.pad_token_id, plan.arch.pad_token_id) == (500, 506, None)
    lines = check_memory(plan, 80 * 2**30)
    assert lines[0].startswith("memory plan per GPU: tp 2 x pp 1 x dp 1, float32") and "tp ranks 0-1" in lines[1]
    assert_held_state_is_planned(tp2_run[0])
