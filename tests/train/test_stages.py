"""Stage 1 trains only the projector, stage 2 the projector and the LM; the ViT stays fixed.

Checked on the weights a user gets back: the trained checkpoint exported to HF by the real
converter, compared tensor by tensor with the HF checkpoint training started from.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.helpers import hf_tensors
from tests.support.training import train, trainer_args


def _hf_tensors(path):
    from megatron_ext.convert.mapping import normalize_hf_name

    return {normalize_hf_name(k): v for k, v in hf_tensors(path).items()}


def _changed_prefixes(before: dict, after: dict) -> set[str]:
    assert before.keys() == after.keys()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    return {name.split(".")[0] for name in changed}, changed


def _assert_processor_renders_as_trained(hf_dir, template_name):
    """The exported processor renders HF's structured messages (lmms-eval, vLLM) with the template
    the run was trained with: rendered, then tokenized as HF's processor does, the trainer's ids."""
    from transformers import AutoProcessor

    from megatron_ext.data.chat_template import needs_special_tokens, resolve_chat_template

    processor = AutoProcessor.from_pretrained(hf_dir)
    tokenizer = processor.tokenizer
    trained = resolve_chat_template(template_name, "en", tokenizer)[1]
    structured = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    as_trained = [{"role": "user", "content": "<image>\nWhat is it?"}]
    training = tokenizer.apply_chat_template(as_trained, chat_template=trained, tokenize=False, add_generation_prompt=True)
    rendered = processor.apply_chat_template(structured, add_generation_prompt=True)
    assert tokenizer(rendered).input_ids == tokenizer(training, add_special_tokens=needs_special_tokens(tokenizer, training)).input_ids


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
# Stage 2 (projector and language model, the tower fixed) is checked the same way on four more families
# (tests/families/checks.py) and on LLaVA-OneVision through run.py (tests/train/test_tiled_training.py).
@pytest.mark.parametrize("stage,expected", [(1, {"multi_modal_projector"})])
def test_stage_trains_exactly_its_modules(tmp_path, llava_clip, megatron_clip, train_data, stage, expected):
    from megatron_ext.convert.to_hf import convert

    save = tmp_path / "run"
    train(1, *trainer_args(megatron_clip, train_data, save, stage=stage, lr=1e-2, train_iters=2,
                           chat_template="plain"))
    exported = convert(save, tmp_path / "hf")
    _assert_processor_renders_as_trained(exported, "plain")

    prefixes, changed = _changed_prefixes(_hf_tensors(llava_clip), _hf_tensors(exported))
    assert prefixes == expected
    # Every tensor of a trained module moved (nothing is silently frozen), the vision tower none.
    original = _hf_tensors(llava_clip)
    trained_names = {n for n in original if n.split(".")[0] in expected}
    assert changed == trained_names
    assert not any(n.startswith("vision_tower.") for n in changed)
