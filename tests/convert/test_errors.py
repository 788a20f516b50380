"""Bad input is refused with one clear message before anything is written (no processes started)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_ext.convert import to_hf, to_megatron
from megatron_ext.errors import UserError


def _hf_copy(src: Path, dst: Path, edit=None) -> Path:
    """A copy of an HF LLaVA directory whose config.json `edit(config)` may change."""
    shutil.copytree(src, dst)
    if edit:
        config = json.loads((dst / "config.json").read_text())
        edit(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _refused(hf_dir: Path, out: Path, tp=1, pp=1, force=False) -> str:
    with pytest.raises(UserError) as info:
        to_megatron.convert(hf_dir, out, tp, pp, force)
    return str(info.value)


def _set(section, **values):
    def edit(config):
        (config if section is None else config[section]).update(values)

    return edit


def test_unsupported_model_types_name_themselves_and_the_supported_list(llava_clip, tmp_path):
    message = _refused(_hf_copy(llava_clip, tmp_path / "a", _set(None, model_type="blip")), tmp_path / "out")
    assert message == "model_type 'blip' is not supported (supported: llava, llava_next, llava_onevision)"
    message = _refused(_hf_copy(llava_clip, tmp_path / "b", _set("text_config", model_type="gpt2")), tmp_path / "out")
    assert message == "text model_type 'gpt2' is not supported (supported: gemma3_text, llama, mistral, phi3, qwen2, qwen3)"
    message = _refused(_hf_copy(llava_clip, tmp_path / "c", _set("vision_config", model_type="vit")), tmp_path / "out")
    assert "vision model_type 'vit' is not supported (supported: clip_vision_model, internvl_vision, siglip_vision_model)" in message
    assert not (tmp_path / "out").exists()


# The tiny Llama: 4 heads, 2 KV heads, FFN 128, vocab 718 (padded 768), 2 layers; CLIP: 4 heads, FFN 64.
# Each case breaks exactly one divisibility rule.
LAYOUT_CASES = {
    "heads": (dict(tp=3), _set("text_config", num_key_value_heads=3, intermediate_size=129, hidden_size=66),
              "--tp 3 does not divide the text attention heads (4)"),
    "kv_heads": (dict(tp=4), None, "--tp 4 does not divide the text KV heads (num_key_value_heads) (2)"),
    "ffn": (dict(tp=2), _set("text_config", intermediate_size=129), "--tp 2 does not divide the text FFN size (intermediate_size) (129)"),
    "vocab": (dict(tp=3), lambda c: (_set("text_config", num_attention_heads=6, num_key_value_heads=6, intermediate_size=129,
                                          hidden_size=66, vocab_size=1000)(c),
                                     _set("vision_config", num_attention_heads=6, intermediate_size=66)(c)),
              "--tp 3 does not divide the padded vocabulary (1024)"),
    "layers": (dict(pp=3), None, "--pp 3 does not divide the text layers (2)"),
}


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_layouts_that_do_not_divide_the_model_are_refused_before_writing(llava_clip, tmp_path, case):
    sizes, edit, expected = LAYOUT_CASES[case]
    hf_dir = _hf_copy(llava_clip, tmp_path / "hf", edit)
    message = _refused(hf_dir, tmp_path / "out", **sizes)
    # The rule the case is about comes first (the tiny CLIP tower may break others after it).
    assert message.split("; ")[0] == expected
    assert not (tmp_path / "out").exists()


def test_existing_output_is_refused_without_force_and_left_untouched(llava_clip, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    message = _refused(llava_clip, out)
    assert "--megatron-dir" in message and "is not empty" in message and "--force" in message
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_output_inside_the_input_is_refused_even_with_force(llava_clip, tmp_path):
    hf_dir = _hf_copy(llava_clip, tmp_path / "hf")
    message = _refused(hf_dir, hf_dir, force=True)
    assert "would replace the input --hf-dir" in message
    assert (hf_dir / "model.safetensors").is_file()


def test_weights_of_mixed_dtypes_and_pytorch_bin_files_are_refused(llava_clip, tmp_path):
    from safetensors.torch import load_file, save_file

    mixed = _hf_copy(llava_clip, tmp_path / "mixed")
    tensors = load_file(str(mixed / "model.safetensors"))
    tensors["language_model.model.norm.weight"] = tensors["language_model.model.norm.weight"].bfloat16()
    save_file(tensors, str(mixed / "model.safetensors"))
    assert "mix dtypes (BF16, F32)" in _refused(mixed, tmp_path / "out")

    binary = _hf_copy(llava_clip, tmp_path / "bin")
    (binary / "model.safetensors").rename(binary / "pytorch_model.bin")
    assert "holds PyTorch .bin weights" in _refused(binary, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_hf_dir_without_a_tokenizer_is_refused(llava_clip, tmp_path):
    hf_dir = _hf_copy(llava_clip, tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf_dir / name).unlink()
    assert "holds no tokenizer" in _refused(hf_dir, tmp_path / "out")


def test_export_refuses_bad_input_before_writing(llava_clip, tmp_path):
    from megatron_ext.checkpoint import layout
    from megatron_ext.convert.hf_checkpoint import copy_tokenizer_files

    out = tmp_path / "out"
    with pytest.raises(UserError, match="is not a megatron_ext checkpoint"):
        to_hf.convert(llava_clip, out)
    with pytest.raises(UserError, match="does not exist"):
        to_hf.convert(tmp_path / "missing", out)

    # A checkpoint's metadata and tokenizer (no weights are read before these checks).
    root = tmp_path / "megatron"
    (root / layout.RELEASE).mkdir(parents=True)
    layout.write_metadata(root / layout.RELEASE, kind="converted", iteration=0, tp=2, pp=1, dtype="float32",
                          hf_config=json.loads((llava_clip / "config.json").read_text()))
    layout.mark_latest(root, layout.RELEASE)
    copy_tokenizer_files(llava_clip, root / layout.TOKENIZER_DIR)
    with pytest.raises(UserError) as info:
        to_hf.convert(root, out, tp=1)
    assert str(info.value).startswith(f"--tp 1 does not match {root / layout.RELEASE}, which was saved with TP2 x PP1")
    with pytest.raises(UserError, match="--pp 2 does not match"):
        to_hf.convert(root, out, tp=2, pp=2)
    with pytest.raises(UserError, match="--max-shard-size 'big' is not a size"):
        to_hf.convert(root, out, max_shard_size="big")
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="--hf-dir .* is not empty; .* --force"):
        to_hf.convert(root, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_a_crash_while_the_workers_write_leaves_no_partial_output(llava_clip, tmp_path, monkeypatch):
    from megatron_ext.convert import cpu_ranks

    def half_written_then_crash(fn, world_size, request, root):
        (root / "release").mkdir()
        (root / "release" / "__0_0.distcp").write_bytes(b"partial")
        raise RuntimeError("worker died")

    monkeypatch.setattr(cpu_ranks, "run_on_cpu_ranks", half_written_then_crash)
    out = tmp_path / "parent" / "megatron"
    with pytest.raises(RuntimeError, match="worker died"):
        to_megatron.convert(llava_clip, out, 1, 1)
    assert not list(out.parent.iterdir())
