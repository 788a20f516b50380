"""Our trainer trains the model transformers would (issue 35): the parity check (megatron_ext/train/
parity.py), fp32 on CPU, on LLaVA-1.5 Llama-GQA + CLIP (stage 2) in two layouts that between them
cover TP1 and TP2, DP2 with the distributed optimizer, unpacked micro batches of two and packed ones
of one, with gradient accumulation; on Qwen2 (tied embeddings, qkv bias) + SigLIP in stage 1 at TP2,
on Gemma 3 + SigLIP in stage 2 at PP2 with SGD, on OneVision (anyres images, a video) at TP2 packed,
and LoRA at TP2 against a PEFT model. Every run's first-step gradients are compared parameter by
parameter. Defects planted in the transformers loop, and one in our trainer, that it must catch.
Each run is made once; each check replays its recorded batches."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from megatron_ext.verify import hf_loop, parity
from tests.support.training import assert_held_state_is_planned, plant_in_parity_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

STEPS = 2
BASE = {"stage": 2, "lr": 1e-3, "seq_length": 128, "weight_decay": 0.1}
RUNS = {  # name: (the HF checkpoint's fixture, processes, options over BASE)
    # Two unpacked micro batches of two samples per step.
    "tp1": ("llava_clip", 1, {"micro_batch_size": 2, "global_batch_size": 4}),
    # TP2 x DP2, optimizer state sharded over the replicas; each replica: two micro batches of one
    # packed sequence (THD attention, RoPE restarting at every sample).
    "tp2-dp2-dist-optim-packed": ("llava_clip", 4, {"tp": 2, "dist_optim": True, "micro_batch_size": 1,
                                                    "global_batch_size": 4, "seq_length": 256,
                                                    "packing_seq_length": 256}),
    # Stage 1: the projector alone trains, the language model split over two tensor ranks.
    "qwen2-siglip-stage1-tp2": ("llava_qwen2_siglip", 2, {"stage": 1, "tp": 2, "micro_batch_size": 2,
                                                          "global_batch_size": 4}),
    # Two pipeline stages, four micro batches of one: Gemma's (1 + w) norms, sliding window, scaled
    # embeddings; SGD with momentum (and its decay added to the gradient), whose weights pin tightly.
    "gemma3-siglip-pp2-sgd": ("llava_gemma3_siglip", 2, {"pp": 2, "micro_batch_size": 1, "global_batch_size": 4,
                                                         "optimizer": "sgd", "sgd_momentum": 0.9}),
    # A tiled LLaVA on anyres images, two-image samples, a video and text only (tests/support/tiled_data.py),
    # at TP2 with packed sequences.
    "onevision-siglip-tp2-packed": ("llava_onevision_siglip", 2, {"tp": 2, "micro_batch_size": 1, "global_batch_size": 4,
                                                                 "seq_length": 2048, "packing_seq_length": 2048,
                                                                 "video_frames": 4}),
}
# Adapters on every target (GQA qkv and gated fc1 split over two tensor ranks) and the projector, against
# PEFT's LoRA on transformers' model.
LORA = {"lora-tp2": ("llava_clip", 2, {"tp": 2, "micro_batch_size": 2, "global_batch_size": 4, "lora_rank": 4,
                                       "lora_alpha": 8.0, "lora_train_projector": True})}
CLIP_PER_RANK = Path(__file__).with_name("clip_per_rank")  # its sitecustomize: each rank clips by its own norm


@pytest.fixture(scope="module")
def our_runs(request, tmp_path_factory, megatron_clip, train_data):
    """Our trainer's run of RUNS (or LORA), made when a test first asks for it."""
    made = {}

    def run(name: str) -> parity.OurRun:
        if name not in made:
            fixture, processes, options = {**RUNS, **LORA}[name]
            hf_dir = request.getfixturevalue(fixture)
            converted = {"llava_clip": megatron_clip}.get(fixture) or (
                request.getfixturevalue("megatron_onevision") if fixture == "llava_onevision_siglip" else None)
            data = request.getfixturevalue("tiled_mix")[0] if fixture == "llava_onevision_siglip" else train_data
            made[name] = parity.run_ours(hf_dir, str(data), tmp_path_factory.mktemp(name), STEPS, processes,
                                         {**BASE, **options}, quiet=True, megatron_dir=converted)
        return made[name]

    return run


@pytest.fixture(scope="module")
def ours(our_runs):
    return our_runs("tp1")


def _report(ours) -> parity.Report:
    return parity.compare(ours, parity.run_hf(ours, progress=lambda line: None))


def _assert_steps_and_grads_match(report: parity.Report, hf_trained: int) -> None:
    assert report.ok, report.table()
    assert [r.step for r in report.rows] == [1, 2]
    for r in report.rows:
        assert r.ours[0] == pytest.approx(r.hf[0], rel=1e-5) and r.ours[1] == pytest.approx(r.hf[1], rel=1e-5)
    # Every parameter transformers trains had its first-step gradient compared, each within 1e-5 of its norm.
    assert report.compared_grads == hf_trained
    assert report.grads and max(report.grads.values()) <= 1e-5
    assert set(report.grads) == {module for module, (_, trained) in report.modules.items() if trained}


def _trained_count(ours) -> int:
    """The parameters transformers' model trains in this run (its frozen parts as the stage freezes them)."""
    from megatron_ext import families

    cfg = ours.plan.config
    model = families.load_model(ours.source, "--hf-dir")
    return sum(not hf_loop.frozen(name, cfg.stage, cfg.unfreeze_vit) for name, _ in model.named_parameters())


@pytest.mark.parametrize("name", RUNS)
def test_trains_like_transformers(our_runs, name):
    ours = our_runs(name)
    report = _report(ours)
    _assert_steps_and_grads_match(report, _trained_count(ours))
    # The vision tower is frozen in both stages, the language model in stage 1: bit-identical; what
    # trained moved, by float noise only.
    assert report.modules["vision_tower"] == (0.0, False)
    stage1 = RUNS[name][2].get("stage") == 1
    assert report.modules["multi_modal_projector"][1]
    assert all(trained != stage1 for module, (_, trained) in report.modules.items()
               if module.startswith("language_model") or module == "embed_tokens")
    if stage1:
        assert all(diff == 0.0 for module, (diff, _) in report.modules.items() if module != "multi_modal_projector")
    assert all(diff <= report.weight_atol for diff, trained in report.modules.values() if trained)
    adam = parity.weight_bound(BASE["lr"], STEPS)
    if RUNS[name][2].get("optimizer") == "sgd":
        # SGD's step is lr x gradient: the weights pin to float noise, hundreds of times below Adam's bound.
        assert 0 < report.weight_atol < 0.01 * adam
    else:
        assert report.weight_atol == adam


def test_lora_trains_like_peft(our_runs):
    """Our adapters (fused qkv and fc1 split over two tensor ranks) and the projector against a PEFT model
    that starts from our initial adapters (exported to PEFT, each fused layer's A tied across its
    modules): losses, gradient norms, every adapter's first-step gradient and final weights; the base
    bit-identical on both sides."""
    ours = our_runs("lora-tp2")
    hf = parity.run_hf(ours, progress=lambda line: None)
    report = parity.compare(ours, hf)
    # 2 layers x (A of qkv, q/k/v's B, A of fc1, gate/up's B, proj's A and B, fc2's A and B) + the projector's 4
    _assert_steps_and_grads_match(report, 2 * (1 + 3 + 1 + 2 + 2 + 2) + 4)
    adapters = [m for m in report.modules if m.endswith("(LoRA)")]
    assert len(adapters) == 2 and all(report.modules[m][1] and report.modules[m][0] > 0 for m in adapters)
    # The base (frozen layers, embeddings, tower) is bit-identical; the adapters and projector moved by float noise.
    assert all(diff == 0.0 for m, (diff, trained) in report.modules.items() if not trained)
    assert {m for m, (_, trained) in report.modules.items() if trained} == {*adapters, "multi_modal_projector"}
    assert report.weight_atol == parity.weight_bound(BASE["lr"], STEPS)
    # The adapters trained: B left zero, so the model is no longer the base.
    assert all(p.abs().max() > 0 for n, p in hf.model.named_parameters() if "lora_B" in n)


def test_lora_dropout_is_refused(tmp_path):
    """Each side draws its own dropout masks: no step could match."""
    from megatron_ext.errors import UserError

    with pytest.raises(UserError, match="--lora-dropout"):
        parity.trainer_config(tmp_path, "data", tmp_path / "ours", STEPS, {"lora_rank": 4, "lora_dropout": 0.1})


def test_bf16_compares_transformers_under_autocast_with_bf16_tolerances(ours):
    """The GPU's default dtype, on the CPU: transformers' loop runs its forward under bf16 autocast
    (fp32 weights), as the Trainer's bf16=True, and the check applies the bf16 tolerances. Our run
    here is fp32, so the sides differ by bf16 rounding alone: within them, but not equal."""
    bf16 = dataclasses.replace(ours, plan=dataclasses.replace(ours.plan, dtype="bfloat16"))
    report = parity.compare(bf16, parity.run_hf(bf16, progress=lambda line: None))
    assert report.ok and (report.dtype, report.rtol) == ("bfloat16", parity.BF16_RTOL), report.table()
    assert all(r.ours[0] != r.hf[0] for r in report.rows)
    assert max(r.rel[0] for r in report.rows) > parity.FP32_RTOL
    assert report.weight_atol > parity.weight_bound(BASE["lr"], STEPS)


def test_the_parallel_layout_ran_packed_micro_batches_of_one_on_two_replicas(our_runs):
    micro_batches = parity.global_batch(our_runs("tp2-dp2-dist-optim-packed"), 1)
    assert len(micro_batches) == 4  # 2 replicas x 2 accumulated micro batches
    assert all(b["input_ids"].shape[0] == 1 and b["segment_ids"].max() > 1 for b in micro_batches)


@pytest.mark.parametrize("name", {**RUNS, **LORA})
def test_each_rank_held_the_state_its_memory_plan_counts(our_runs, name):
    """Issue 36: the plan's parameters, gradient buffers and optimizer state equal the bytes each rank
    of the run held: at TP1, TP2 x DP2 with the distributed optimizer's padded buffers, stage 1 at
    TP2, PP2 with SGD's one momentum buffer, LoRA at TP2."""
    ours = our_runs(name)
    assert_held_state_is_planned(ours.hf_out.parent / "ours", ours.plan)


def _problems(ours) -> str:
    report = _report(ours)
    assert not report.ok
    return "\n".join(report.problems)


def test_catches_per_micro_batch_mean(ours, monkeypatch):
    """Each micro batch's mean, averaged over micro batches, weighs tokens of short micro batches more."""
    monkeypatch.setattr(hf_loop, "global_normalizer",
                        lambda batches: [sum(s.trained_tokens for s in b) * len(batches) for b in batches])
    assert "step 1: loss differs" in _problems(ours)


def test_catches_image_tokens_in_the_loss(ours, monkeypatch):
    """Predicting image tokens (labels at image positions) changes the loss and its token count."""
    plain = hf_loop.hf_samples

    def with_image_labels(micro_batch, image_token_index, *args, **kwargs):
        samples = plain(micro_batch, image_token_index, *args, **kwargs)
        for s in samples:
            s.labels[s.input_ids == image_token_index] = image_token_index
        return samples

    monkeypatch.setattr(hf_loop, "hf_samples", with_image_labels)
    assert "step 1: loss differs" in _problems(ours)


def test_catches_schedule_off_by_one(ours, monkeypatch):
    plain = hf_loop.hf_scheduler

    def one_step_ahead(*args):
        scheduler = plain(*args)
        with pytest.warns(UserWarning, match="before `optimizer.step"):
            scheduler.step()
        return scheduler

    monkeypatch.setattr(hf_loop, "hf_scheduler", one_step_ahead)
    problems = _problems(ours)
    assert "step 1: learning rate" in problems and "step 2: loss differs" in problems


def test_catches_weight_decay_on_norms(ours, monkeypatch):
    """Norms decayed at step 1 (by lr x weight decay = 1e-4) change step 2's gradients."""
    monkeypatch.setattr(hf_loop, "decayed_names", lambda model: {n for n, _ in model.named_parameters()})
    problems = _problems(ours)
    assert "step 1:" not in problems and "step 2: grad norm differs" in problems


def test_catches_clipping_per_rank(tmp_path, llava_clip, megatron_clip, train_data, monkeypatch):
    """Our trainer at TP2, each rank clipping by the norm of its own half of the split weights: the
    norm it reports and clips by is not the global one. One step shows it."""
    plant_in_parity_ranks(monkeypatch, CLIP_PER_RANK)
    ours = parity.run_ours(llava_clip, str(train_data), tmp_path, 1, 2,
                           {**BASE, "tp": 2, "micro_batch_size": 2, "global_batch_size": 2}, quiet=True,
                           megatron_dir=megatron_clip)
    problems = _problems(ours)
    assert "step 1: grad norm differs" in problems and "step 1: loss differs" not in problems


def test_catches_lora_scaling_off(our_runs, monkeypatch):
    """PEFT's adapters scaled by 2 alpha / r: B is zero at step 1, so the loss there is the same, but B's
    gradient doubles (step 1's gradient check) and step 2's loss moves."""
    from peft.tuners.lora import LoraLayer

    plain = hf_loop.with_adapters

    def doubled(model, adapters):
        model = plain(model, adapters)
        for module in model.modules():
            if isinstance(module, LoraLayer):
                module.scaling["default"] *= 2
        return model

    monkeypatch.setattr(hf_loop, "with_adapters", doubled)
    problems = _problems(our_runs("lora-tp2"))
    assert "step 1: loss differs" not in problems
    assert re.search(r"layers\.\d+\.self_attn\.q_proj\.lora_B\.weight: first-step gradient differs", problems)


def test_catches_one_parameter_gradient_off(ours, monkeypatch):
    """The projector's first bias with a gradient 1e-3 too large: the loss and the global gradient norm
    stay within 1e-5 at step 1, the per-parameter gradients name it."""
    plain = hf_loop.HfLoop.__init__

    def perturbed(self, *args, **kwargs):
        plain(self, *args, **kwargs)
        self.model.get_parameter("model.multi_modal_projector.linear_1.bias").register_hook(lambda g: g * (1 + 1e-3))

    monkeypatch.setattr(hf_loop.HfLoop, "__init__", perturbed)
    problems = _problems(ours)
    assert "step 1: loss differs" not in problems and "step 1: grad norm differs" not in problems
    assert "multi_modal_projector.linear_1.bias: first-step gradient differs" in problems


def test_catches_sgd_without_momentum(our_runs, monkeypatch):
    """transformers' SGD without momentum: every loss and gradient norm is the same (momentum first
    changes step 2's update, after the last one measured), and step 2 moves weights by lr x 0.9 x step
    1's gradient less: within Adam's bound, far outside SGD's."""
    plain = hf_loop.hf_optimizer
    monkeypatch.setattr(hf_loop, "hf_optimizer", lambda groups, hyper: plain(groups, dataclasses.replace(hyper, momentum=0.0)))
    ours = our_runs("gemma3-siglip-pp2-sgd")
    report = _report(ours)
    problems = "\n".join(report.problems)
    assert "step" not in problems and "gradient" not in problems
    assert "language_model.layers.0: weights differ" in problems
    assert max(diff for diff, _ in report.modules.values()) < parity.weight_bound(BASE["lr"], STEPS)
