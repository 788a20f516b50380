"""--lora-* options: checked before anything is built, one line naming the flag; an adapter
checkpoint loads only onto the base checkpoint it was trained on."""

from __future__ import annotations

import json

import pytest

from megatron_ext.checkpoint import layout
from megatron_ext.config.options import TrainConfig
from megatron_ext.errors import UserError
from megatron_ext.lora.checkpoint import fingerprint, verified_base
from megatron_ext.lora.settings import lora_settings


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


@pytest.mark.parametrize("targets, what", [("qkv,o_proj", "no target o_proj"), (" , ", "no targets")])
def test_unknown_targets_are_named_with_the_valid_ones(targets, what):
    with pytest.raises(UserError) as error:
        lora_settings(TrainConfig(stage=2, lora_rank=8, lora_targets=targets).resolved())
    assert str(error.value) == (f"--lora-targets {targets!r}: {what}; give a comma-separated subset of "
                                "qkv (self_attention.linear_qkv), proj (self_attention.linear_proj), "
                                "fc1 (mlp.linear_fc1), fc2 (mlp.linear_fc2)")


def _adapters_on(base_dir, record) -> layout.Snapshot:
    return layout.Snapshot(root=base_dir.parent, path=base_dir.parent / "adapters", meta={"lora_base": record})


def test_adapter_checkpoint_refuses_a_changed_or_missing_base(tmp_path):
    base = tmp_path / "base" / "release"
    base.mkdir(parents=True)
    (base / "__0_0.distcp").write_bytes(b"weights" * 1000)
    (base / layout.METADATA_FILE).write_text(json.dumps({"format": layout.FORMAT}))
    adapters = _adapters_on(base, {"path": str(base), "fingerprint": fingerprint(base)})
    assert verified_base(adapters).path == base

    (base / "__0_0.distcp").write_bytes(b"other!!" * 1000)
    with pytest.raises(UserError, match="another version of"):
        verified_base(adapters)
    with pytest.raises(UserError, match="does not exist"):
        verified_base(_adapters_on(base, {"path": str(tmp_path / "gone"), "fingerprint": "x"}))
