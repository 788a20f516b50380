"""Our trainer trains the model transformers would (issue 35): the parity check (megatron_ext/train/
parity.py), fp32 on CPU, on LLaVA-1.5 Llama-GQA + CLIP (stage 2) in two layouts that between them
cover TP1 and TP2, DP2 with the distributed optimizer, unpacked micro batches of two and packed ones
of one, with gradient accumulation; on Qwen2 (tied embeddings, qkv bias) + SigLIP in stage 1 at TP2,
on Gemma 3 + SigLIP in stage 2 at PP2, and on OneVision (anyres images, a video) at TP2 packed. Defects planted in the transformers loop, and one in our
trainer, that it must catch. Each run is made once; each check replays its recorded batches."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from megatron_ext.train import hf_loop, parity
from tests.train.conftest import assert_held_state_is_planned

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
    # Two pipeline stages, four micro batches of one: Gemma's (1 + w) norms, sliding window, scaled embeddings.
    "gemma3-siglip-pp2": ("llava_gemma3_siglip", 2, {"pp": 2, "micro_batch_size": 1, "global_batch_size": 4}),
    # A tiled LLaVA on anyres images, two-image samples, a video and text only (tests/tiled_data.py),
    # at TP2 with packed sequences.
    "onevision-siglip-tp2-packed": ("llava_onevision_siglip", 2, {"tp": 2, "micro_batch_size": 1, "global_batch_size": 4,
                                                                 "seq_length": 2048, "packing_seq_length": 2048,
                                                                 "video_frames": 4}),
}
CLIP_PER_RANK = Path(__file__).with_name("clip_per_rank")  # its sitecustomize: each rank clips by its own norm


@pytest.fixture(scope="module")
def our_runs(request, tmp_path_factory, megatron_clip, train_data):
    """Our trainer's run of RUNS, made when a test first asks for it: (the run, its HF checkpoint)."""
    made = {}

    def run(name: str) -> tuple[parity.OurRun, Path]:
        if name not in made:
            fixture, processes, options = RUNS[name]
            hf_dir = request.getfixturevalue(fixture)
            converted = {"llava_clip": megatron_clip}.get(fixture) or (
                request.getfixturevalue("megatron_onevision") if fixture == "llava_onevision_siglip" else None)
            data = request.getfixturevalue("tiled_mix")[0] if fixture == "llava_onevision_siglip" else train_data
            made[name] = parity.run_ours(hf_dir, str(data), tmp_path_factory.mktemp(name), STEPS, processes,
                                         {**BASE, **options}, quiet=True, megatron_dir=converted), hf_dir
        return made[name]

    return run


@pytest.fixture(scope="module")
def ours(our_runs):
    return our_runs("tp1")[0]


def _report(ours, hf_dir) -> parity.Report:
    model, results = parity.run_hf(hf_dir, ours, progress=lambda line: None)
    return parity.compare(ours, results, model)


@pytest.mark.parametrize("name", RUNS)
def test_trains_like_transformers(our_runs, name):
    ours, hf_dir = our_runs(name)
    report = _report(ours, hf_dir)
    assert report.ok, report.table()
    assert [r.step for r in report.rows] == [1, 2]
    for r in report.rows:
        assert r.ours[0] == pytest.approx(r.hf[0], rel=1e-5) and r.ours[1] == pytest.approx(r.hf[1], rel=1e-5)
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


def test_bf16_compares_transformers_under_autocast_with_bf16_tolerances(ours, llava_clip):
    """The GPU's default dtype, on the CPU: transformers' loop runs its forward under bf16 autocast
    (fp32 weights), as the Trainer's bf16=True, and the check applies the bf16 tolerances. Our run
    here is fp32, so the sides differ by bf16 rounding alone: within them, but not equal."""
    bf16 = dataclasses.replace(ours, plan=dataclasses.replace(ours.plan, dtype="bfloat16"))
    model, results = parity.run_hf(llava_clip, bf16, progress=lambda line: None)
    report = parity.compare(bf16, results, model)
    assert report.ok and (report.dtype, report.rtol) == ("bfloat16", parity.BF16_RTOL), report.table()
    assert all(r.ours[0] != r.hf[0] for r in report.rows)
    assert max(r.rel[0] for r in report.rows) > parity.FP32_RTOL
    assert report.weight_atol > parity.weight_bound(BASE["lr"], STEPS)


def test_the_parallel_layout_ran_packed_micro_batches_of_one_on_two_replicas(our_runs):
    micro_batches = parity.global_batch(our_runs("tp2-dp2-dist-optim-packed")[0], 1)
    assert len(micro_batches) == 4  # 2 replicas x 2 accumulated micro batches
    assert all(b["input_ids"].shape[0] == 1 and b["segment_ids"].max() > 1 for b in micro_batches)


@pytest.mark.parametrize("name", RUNS)
def test_each_rank_held_the_state_its_memory_plan_counts(our_runs, name):
    """Issue 36: the plan's parameters, gradient buffers and optimizer state equal the bytes each rank
    of the run held: at TP1, TP2 x DP2 with the distributed optimizer's padded buffers, stage 1 at
    TP2, PP2."""
    ours, _ = our_runs(name)
    assert_held_state_is_planned(ours.hf_out.parent / "ours", ours.plan)


def _problems(ours, hf_dir) -> str:
    report = _report(ours, hf_dir)
    assert not report.ok
    return "\n".join(report.problems)


def test_catches_per_micro_batch_mean(ours, llava_clip, monkeypatch):
    """Each micro batch's mean, averaged over micro batches, weighs tokens of short micro batches more."""
    monkeypatch.setattr(hf_loop, "global_normalizer",
                        lambda batches: [sum(s.trained_tokens for s in b) * len(batches) for b in batches])
    assert "step 1: loss differs" in _problems(ours, llava_clip)


def test_catches_image_tokens_in_the_loss(ours, llava_clip, monkeypatch):
    """Predicting image tokens (labels at image positions) changes the loss and its token count."""
    plain = hf_loop.hf_samples

    def with_image_labels(micro_batch, image_token_index, *args, **kwargs):
        samples = plain(micro_batch, image_token_index, *args, **kwargs)
        for s in samples:
            s.labels[s.input_ids == image_token_index] = image_token_index
        return samples

    monkeypatch.setattr(hf_loop, "hf_samples", with_image_labels)
    assert "step 1: loss differs" in _problems(ours, llava_clip)


def test_catches_schedule_off_by_one(ours, llava_clip, monkeypatch):
    plain = hf_loop.hf_scheduler

    def one_step_ahead(*args):
        scheduler = plain(*args)
        with pytest.warns(UserWarning, match="before `optimizer.step"):
            scheduler.step()
        return scheduler

    monkeypatch.setattr(hf_loop, "hf_scheduler", one_step_ahead)
    problems = _problems(ours, llava_clip)
    assert "step 1: learning rate" in problems and "step 2: loss differs" in problems


def test_catches_weight_decay_on_norms(ours, llava_clip, monkeypatch):
    """Norms decayed at step 1 (by lr x weight decay = 1e-4) change step 2's gradients."""
    monkeypatch.setattr(hf_loop, "decayed_names", lambda model: {n for n, _ in model.named_parameters()})
    problems = _problems(ours, llava_clip)
    assert "step 1:" not in problems and "step 2: grad norm differs" in problems


def test_catches_clipping_per_rank(tmp_path, llava_clip, megatron_clip, train_data, monkeypatch):
    """Our trainer at TP2, each rank clipping by the norm of its own half of the split weights: the
    norm it reports and clips by is not the global one. One step shows it."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(CLIP_PER_RANK), os.environ.get("PYTHONPATH")) if p))
    ours = parity.run_ours(llava_clip, str(train_data), tmp_path, 1, 2,
                           {**BASE, "tp": 2, "micro_batch_size": 2, "global_batch_size": 2}, quiet=True,
                           megatron_dir=megatron_clip)
    problems = _problems(ours, llava_clip)
    assert "step 1: grad norm differs" in problems and "step 1: loss differs" not in problems
