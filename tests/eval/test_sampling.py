"""Token choice: greedy is the argmax; sampling follows softmax(logits / T) restricted to the top-p
nucleus, reproducibly for a seed; bad sampling flags are one-line errors."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.errors import UserError
from megatron_ext.eval.sampling import SamplingOptions, TokenChooser

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
SEEN = torch.tensor([[5, 6]])


def _draws(options: SamplingOptions, n: int = 4000) -> torch.Tensor:
    chooser = TokenChooser(options)
    return torch.tensor([chooser(SEEN, LOGITS) for _ in range(n)])


def test_greedy_is_the_argmax():
    assert set(_draws(SamplingOptions(), n=20).tolist()) == {0}


def test_sampling_follows_the_tempered_distribution_and_the_nucleus():
    draws = _draws(SamplingOptions(temperature=2.0, seed=3))
    expected = torch.softmax(LOGITS[0] / 2.0, dim=-1)  # [0.455, 0.276, 0.167, 0.102]
    observed = torch.bincount(draws, minlength=4) / len(draws)
    assert torch.allclose(observed, expected, atol=0.03), observed
    # top-p 0.7 keeps the two most likely tokens (0.455 + 0.276 >= 0.7), renormalised.
    nucleus = _draws(SamplingOptions(temperature=2.0, top_p=0.7, seed=3))
    share = torch.bincount(nucleus, minlength=4) / len(nucleus)
    assert share[2:].sum() == 0
    assert share[0] == pytest.approx(float(expected[0] / expected[:2].sum()), abs=0.03)


def test_sampling_is_reproducible_for_a_seed():
    options = SamplingOptions(temperature=1.0, seed=7)
    assert torch.equal(_draws(options, n=50), _draws(options, n=50))
    assert not torch.equal(_draws(options, n=50), _draws(SamplingOptions(temperature=1.0, seed=8), n=50))


@pytest.mark.parametrize("options, message", [
    (SamplingOptions(max_new_tokens=0), "--max-new-tokens must be at least 1"),
    (SamplingOptions(temperature=-1), "--temperature must be >= 0"),
    (SamplingOptions(top_p=0), "--top-p must be in (0, 1]"),
])
def test_bad_sampling_flags(options, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("]", r"\]")):
        options.check()
