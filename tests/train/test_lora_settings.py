"""--lora-* options: checked before anything is built, one line naming the flag."""

from __future__ import annotations

import pytest

from megatron_ext.errors import UserError
from megatron_ext.lora.settings import lora_settings
from megatron_ext.train.options import TrainConfig


def test_settings_from_flags():
    settings = lora_settings(TrainConfig(stage=2, lora_rank=8, lora_alpha=32, lora_targets="qkv, fc2,qkv").resolved())
    assert (settings.rank, settings.scaling, settings.targets) == (8, 4.0, ("qkv", "fc2"))
    assert lora_settings(TrainConfig(stage=2).resolved()) is None


@pytest.mark.parametrize("options, flag", [
    ({"stage": 1, "lora_rank": 8}, "--stage 2"),
    ({"lora_rank": -1}, "--lora-rank"),
    ({"lora_rank": 8, "lora_targets": "qkv,o_proj"}, "--lora-targets"),
    ({"lora_rank": 8, "lora_dropout": 1.0}, "--lora-dropout"),
    ({"lora_rank": 8, "lora_alpha": 0}, "--lora-alpha"),
    ({"lora_rank": 8, "unfreeze_vit": True}, "--unfreeze-vit"),
])
def test_bad_settings_name_the_flag(options, flag):
    with pytest.raises(UserError, match=flag):
        lora_settings(TrainConfig(**{"stage": 2, **options}).resolved())
