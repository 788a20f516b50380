"""Our trainer trains the model transformers would (issue 35): the parity check (megatron_ext/train/
parity.py) on LLaVA-1.5 Llama-GQA + CLIP, stage 2, fp32 on CPU, and defects planted in the
transformers loop that it must catch. Our run is made once; each check replays its recorded batches."""

from __future__ import annotations

import pytest

from megatron_ext.train import hf_loop, parity

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

STEPS = 2
OPTIONS = {"stage": 2, "lr": 1e-3, "micro_batch_size": 2, "global_batch_size": 4, "seq_length": 128,
           "weight_decay": 0.1}


@pytest.fixture(scope="module")
def ours(tmp_path_factory, llava_clip, train_data):
    """Two steps of our trainer at TP1: two micro batches of two samples per step."""
    return parity.run_ours(llava_clip, str(train_data), tmp_path_factory.mktemp("parity"), STEPS, 1, OPTIONS, quiet=True)


def _report(ours, hf_dir) -> parity.Report:
    model, results = parity.run_hf(hf_dir, ours, progress=lambda line: None)
    return parity.compare(ours, results, model, hf_dir)


def test_trains_like_transformers(ours, llava_clip):
    report = _report(ours, llava_clip)
    assert report.ok, report.table()
    assert [r.step for r in report.rows] == [1, 2]
    for r in report.rows:
        assert r.ours[0] == pytest.approx(r.hf[0], rel=1e-5) and r.ours[1] == pytest.approx(r.hf[1], rel=1e-5)
    # The vision tower is frozen in stage 2: bit-identical; what trained moved, by float noise only.
    assert report.modules["vision_tower"] == (0.0, False)
    assert report.modules["multi_modal_projector"][1] and report.modules["lm_head"][1]
    assert all(diff <= report.weight_atol for diff, trained in report.modules.values() if trained)


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

    def with_image_labels(micro_batch, image_token_index, img_seq_len):
        samples = plain(micro_batch, image_token_index, img_seq_len)
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
