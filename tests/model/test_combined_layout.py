"""The host-computed layout of the combined sequence gives megatron-core's preprocessing exactly:
embeddings, labels, loss mask and the gradients flowing back to text and image embeddings."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.multimodal.llava_model import LLaVAModel

from megatron_ext.model.combined_layout import LaidOutLLaVAModel, combined_layout

IMAGE = 99
HIDDEN = 6


def _model(cls, img_seq_len: int, max_length: int, pad_to_max: bool):
    """Just the attributes `_preprocess_data` reads, on an unbuilt instance of `cls`."""
    model = cls.__new__(cls)
    torch.nn.Module.__init__(model)
    model.add_decoder = model.pre_process = model.post_process = True
    model.img_seq_len = img_seq_len
    model._language_is_pipeline_parallel = pad_to_max
    model._language_max_sequence_length = max_length
    model.context_parallel_lm = 1
    model.vision_model = None
    return model


def _batch(rows: list[list[int]], seed: int):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.tensor(rows)
    labels = torch.randint(0, 50, input_ids.shape, generator=gen)
    loss_mask = (torch.rand(input_ids.shape, generator=gen) > 0.3).float()
    return input_ids, labels, loss_mask


def _preprocess(model, input_ids, labels, loss_mask, img_seq_len, seed, layout=None):
    """Both sides' outputs and the gradients of a random projection of the embedding."""
    gen = torch.Generator().manual_seed(seed)
    batch, text_len = input_ids.shape
    tiles = int((input_ids == IMAGE).sum())
    text = torch.randn(batch, text_len, HIDDEN, generator=gen, dtype=torch.float64, requires_grad=True)
    images = torch.randn(img_seq_len, tiles, HIDDEN, generator=gen, dtype=torch.float64, requires_grad=True)
    if tiles == 0:  # what megatron-core's forward gives then: an empty constant
        images = torch.zeros(0, 0, 0, dtype=torch.float64)
    model._combined = layout
    embedding, new_labels, new_mask = model._preprocess_data(
        images, text, input_ids, loss_mask, labels, False, None, IMAGE, torch.ones(tiles, dtype=torch.int))
    weights = torch.randn(embedding.shape, generator=gen, dtype=torch.float64)
    (embedding * weights).sum().backward()
    return embedding, new_labels, new_mask, text.grad, images.grad


CASES = {
    # rows of different image counts: none, one at the start, two in a row, one at the end
    "unpacked rows": ([[1, 2, 3, 4, 5, 6], [IMAGE, 7, 8, 9, 10, 11], [12, IMAGE, IMAGE, 13, 14, 15],
                       [16, 17, 18, 19, 20, IMAGE]], 4, 64, False),
    "one packed row": ([[1, IMAGE, 2, 3, 4, IMAGE, 5, 6, IMAGE, 7, 8, 9]], 5, 64, False),
    "padded for pipeline stages": ([[1, IMAGE, 2, 3], [4, 5, 6, 7]], 3, 16, True),
    "cut at the model's length": ([[1, IMAGE, 2, 3, IMAGE, 4], [IMAGE, 5, 6, 7, 8, 9]], 4, 9, False),
    "one position per image token (tiled)": ([[1, IMAGE, IMAGE, IMAGE, 2, 3], [IMAGE, 4, 5, 6, 7, 8]], 1, 64, False),
    "text only": ([[1, 2, 3], [4, 5, 6]], 4, 64, False),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_the_host_layout_gives_megatron_cores_preprocessing_exactly(case):
    rows, img_seq_len, max_length, pad_to_max = CASES[case]
    input_ids, labels, loss_mask = _batch(rows, seed=1)
    expected = _preprocess(_model(LLaVAModel, img_seq_len, max_length, pad_to_max), input_ids, labels, loss_mask,
                           img_seq_len, seed=2)
    layout = combined_layout(input_ids, labels, loss_mask, IMAGE, img_seq_len, max_length, pad_to_max)
    got = _preprocess(_model(LaidOutLLaVAModel, img_seq_len, max_length, pad_to_max), input_ids, labels, loss_mask,
                      img_seq_len, seed=2, layout=layout)
    for name, e, g in zip(("embedding", "labels", "loss mask", "text gradient", "image gradient"), expected, got):
        if e is None:  # no image: no image gradient on either side
            assert g is None, name
            continue
        assert g.dtype == e.dtype and g.shape == e.shape, name
        assert torch.equal(g, e), name
    # A contiguous tensor's strides, one row or several: a compiled first layer recompiles for any other.
    assert got[0].stride() == torch.empty(got[0].shape).stride()


def test_without_a_layout_the_model_is_megatron_cores_own():
    input_ids, labels, loss_mask = _batch([[1, IMAGE, 2, 3]], seed=1)
    expected = _preprocess(_model(LLaVAModel, 3, 64, False), input_ids, labels, loss_mask, 3, seed=2)
    got = _preprocess(_model(LaidOutLLaVAModel, 3, 64, False), input_ids, labels, loss_mask, 3, seed=2)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_image_features_that_do_not_fill_the_image_tokens_are_refused():
    input_ids, labels, loss_mask = _batch([[1, IMAGE, 2, IMAGE]], seed=1)
    layout = combined_layout(input_ids, labels, loss_mask, IMAGE, 3, 64, False)
    model = _model(LaidOutLLaVAModel, 3, 64, False)
    model._combined = layout
    one_image = torch.zeros(3, 1, HIDDEN)
    with pytest.raises(ValueError, match="the images give 3 feature rows, the image tokens take 6"):
        model._preprocess_data(one_image, torch.zeros(1, 4, HIDDEN), input_ids, loss_mask, labels, False, None,
                               IMAGE, torch.ones(1, dtype=torch.int))


class _Output(torch.nn.Module):
    """megatron-core's output layer's call shape: (logits, bias) of [s, b, h] hidden states."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN, 11, dtype=torch.float64)
        self.rows = []

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        self.rows.append(hidden.shape[0] * hidden.shape[1])
        return self.linear(hidden), None


def _megatron_loss(labels, logits):
    """compute_language_model_loss: labels [b, s], logits [s, b, V] -> per-token loss [b, s]."""
    loss = torch.nn.functional.cross_entropy(logits.permute(1, 2, 0), labels, reduction="none")
    return loss


def test_logits_are_computed_only_at_the_loss_positions_with_the_same_losses_and_gradients():
    from types import SimpleNamespace

    from megatron_ext.model import loss_positions

    input_ids, labels, loss_mask = _batch([[1, IMAGE, 2, 3, 4, 5], [6, 7, IMAGE, 8, 9, 10]], seed=3)
    layout = combined_layout(input_ids, labels % 11, loss_mask, IMAGE, 2, 64, False, loss_positions=True)
    seq, batch = layout.source.shape[1], layout.source.shape[0]
    assert torch.equal(layout.loss_positions, torch.nonzero(layout.loss_mask.t().reshape(-1)).reshape(-1))
    hidden = torch.randn(seq, batch, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    results = []
    for positions in (None, layout.loss_positions):
        torch.manual_seed(5)  # the same output weights on both sides
        lm = SimpleNamespace(output_layer=_Output(), compute_language_model_loss=_megatron_loss)
        slot = loss_positions.attach(lm)
        slot.positions = positions
        h = hidden.clone().requires_grad_()
        logits, _ = lm.output_layer(h)
        loss = lm.compute_language_model_loss(layout.labels, logits)
        (loss * layout.loss_mask).sum().backward()
        results.append((lm.output_layer.rows, loss * layout.loss_mask, h.grad))
    (all_rows, full, full_grad), (rows, sparse, sparse_grad) = results
    assert all_rows == [seq * batch] and rows == [layout.loss_positions.numel()] and rows[0] < seq * batch / 2
    assert torch.allclose(sparse, full, rtol=1e-12, atol=0) and torch.allclose(sparse_grad, full_grad, rtol=1e-12, atol=0)


def test_a_micro_batch_without_loss_still_runs_the_output_layer_at_one_position():
    input_ids, labels, _ = _batch([[1, IMAGE, 2]], seed=1)
    layout = combined_layout(input_ids, labels, torch.zeros(1, 3), IMAGE, 2, 64, False, loss_positions=True)
    assert layout.loss_positions.tolist() == [0]
