"""write_random_checkpoint (bench/convert_bench.py --shape): the directory transformers' save_pretrained
would write for the config, with random values, which the converter accepts."""

from __future__ import annotations

import json
import re

import pytest
import torch

from megatron_ext.errors import UserError


def _tensors(path) -> dict[str, tuple[list[int], str]]:
    """{name: (shape, dtype)} over every safetensors file of an HF directory."""
    from safetensors import safe_open

    found = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            found.update({name: (f.get_slice(name).get_shape(), f.get_slice(name).get_dtype()) for name in f.keys()})
    return found


@pytest.mark.parametrize("fixture", ["llava_clip", "llava_qwen2_siglip", "llava_next_clip"])
def test_names_and_shapes_are_what_save_pretrained_writes_in_shards_the_converter_reads(request, fixture, tmp_path):
    from megatron_ext.convert.hf_checkpoint import INDEX_FILE
    from megatron_ext.convert.to_megatron import check_conversion
    from tests.support.random_checkpoint import write_random_checkpoint

    saved = request.getfixturevalue(fixture)
    config = json.loads((saved / "config.json").read_text())
    limit = 200_000
    out = write_random_checkpoint(config, tmp_path / "random", max_shard_bytes=limit)

    expected = {name: (shape, "BF16") for name, (shape, _) in _tensors(saved).items()}
    assert _tensors(out) == expected  # tied embeddings (the Qwen2 fixture): embed_tokens only, as saved
    files = sorted(out.glob("*.safetensors"))
    assert len(files) > 1 and all(re.fullmatch(rf"model-0000\d-of-0000{len(files)}\.safetensors", f.name) for f in files)
    index = json.loads((out / INDEX_FILE).read_text())
    assert sorted(index["weight_map"]) == sorted(expected) and set(index["weight_map"].values()) == {f.name for f in files}
    # A file over the limit holds one tensor larger than the limit.
    assert all(f.stat().st_size <= limit + 4096 or len(_tensors_in(f)) == 1 for f in files)
    written = json.loads((out / "config.json").read_text())
    assert _without_dtypes(written) == _without_dtypes(config) and set(_dtypes(written)) == {"bfloat16"}
    request = check_conversion(out, 1, 1)  # config, weights, dtype and tokenizer as the converter checks them
    assert request.dtype == "bfloat16"


_DTYPE_KEYS = ("dtype", "torch_dtype")


def _dtypes(config: dict) -> list[str]:
    parts = (config, config["text_config"], config["vision_config"])
    return [part[key] for part in parts for key in _DTYPE_KEYS if key in part]


def _without_dtypes(config: dict) -> dict:
    return {key: _without_dtypes(value) if isinstance(value, dict) else value
            for key, value in config.items() if key not in _DTYPE_KEYS}


def _tensors_in(file) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        return list(f.keys())


def test_values_are_seeded_normal_and_norms_near_one(llava_clip, tmp_path):
    from megatron_ext.convert.hf_checkpoint import HfWeights
    from tests.support.random_checkpoint import write_random_checkpoint

    config = json.loads((llava_clip / "config.json").read_text())
    first, again, other = (HfWeights(write_random_checkpoint(config, tmp_path / name, seed=seed, dtype="float32"))
                           for name, seed in (("a", 0), ("b", 0), ("c", 1)))
    assert all(torch.equal(first.read(name), again.read(name)) for name in first.names)
    assert not torch.equal(first.read("language_model.lm_head.weight"), other.read("language_model.lm_head.weight"))
    weight = first.read("language_model.model.embed_tokens.weight")
    std = config["text_config"]["initializer_range"]
    assert abs(weight.std().item() - std) < 0.1 * std and abs(weight.mean().item()) < 0.1 * std
    norm = first.read("language_model.model.norm.weight")
    assert abs(norm.mean().item() - 1) < std and 0 < norm.std().item() < 2 * std


def test_layers_sets_the_text_layers(llava_clip, tmp_path):
    from tests.support.random_checkpoint import write_random_checkpoint

    config = json.loads((llava_clip / "config.json").read_text())
    out = write_random_checkpoint(config, tmp_path / "one", layers=1)
    assert json.loads((out / "config.json").read_text())["text_config"]["num_hidden_layers"] == 1
    layers = {int(m.group(1)) for name in _tensors(out) if (m := re.match(r"language_model\.model\.layers\.(\d+)\.", name))}
    assert layers == {0}


@pytest.mark.parametrize("change, message", [
    (dict(dtype="int8"), "dtype 'int8' is not supported (supported: bfloat16, float16, float32)"),
    (dict(layers=0), "layers 0 must be at least 1"),
    (dict(config={"model_type": "blip"}), "model_type 'blip' is not supported"),
    (dict(config=[1]), "the config is a JSON list, not an object"),
])
def test_bad_input_is_one_line_and_writes_nothing(llava_clip, tmp_path, change, message):
    from tests.support.random_checkpoint import write_random_checkpoint

    config = change.pop("config", json.loads((llava_clip / "config.json").read_text()))
    with pytest.raises(UserError, match=re.escape(message)) as error:
        write_random_checkpoint(config, tmp_path / "out", **change)
    assert "\n" not in str(error.value) and not (tmp_path / "out").exists()


def test_a_directory_holding_files_is_refused(llava_clip, tmp_path):
    from tests.support.random_checkpoint import write_random_checkpoint

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="exists and is not an empty directory"):
        write_random_checkpoint(json.loads((llava_clip / "config.json").read_text()), tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]
