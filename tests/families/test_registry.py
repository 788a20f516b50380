"""The family registry: one place knows each family, lookups name what is supported, and no module
outside megatron_ext/families/ names a family but the demo's tiny presets, which have one per family."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_ext import families
from megatron_ext.demo import tiny_presets
from megatron_ext.errors import UserError

PACKAGE = Path(families.__file__).resolve().parent.parent
# What each family's tiny test model sets, keyed by the family's name: the one module outside
# families/ that names them.
PRESETS = Path(tiny_presets.__file__).resolve()


def _family_patterns() -> list[re.Pattern]:
    """Quoted model_type strings and transformers class names of every family."""
    quoted, classes = set(), set()
    for f in families.text_families().values():
        quoted.add(f.model_type)
        classes.add(f.config_class.removesuffix("Config"))
    for f in families.vision_families().values():
        quoted |= {f.model_type, f.full_model_type, f.subtype}
        classes |= {f.config_class.removesuffix("VisionConfig"), f.model_class.removesuffix("VisionModel")}
    suffixes = "Config|VisionConfig|Model|VisionModel|ForCausalLM|ImageProcessor|Tokenizer"
    return [re.compile(rf"""["']({'|'.join(map(re.escape, sorted(quoted)))})["']"""),
            re.compile(rf"\b({'|'.join(map(re.escape, sorted(classes)))})({suffixes})\w*\b")]


def test_no_module_outside_the_families_package_names_a_family():
    patterns = _family_patterns()
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "families" or path == PRESETS:
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if any(p.search(line) for p in patterns):
                hits.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not hits, "family names outside megatron_ext/families/:\n" + "\n".join(hits)


def test_the_grep_would_see_a_family_name():
    patterns = _family_patterns()
    assert any(p.search('if cfg.model_type == "qwen2":') for p in patterns)
    assert any(p.search("from transformers import SiglipVisionModel") for p in patterns)
    assert not any(p.search("clip_grad=cfg.clip_grad") for p in patterns)


def test_every_supported_family_is_registered():
    assert sorted(families.text_families()) == ["gemma3_text", "llama", "mistral", "phi3", "qwen2", "qwen3"]
    assert sorted(families.vision_families()) == ["clip_vision_model", "internvl_vision", "siglip_vision_model"]


def test_every_family_has_a_tiny_preset_and_every_preset_a_family():
    assert sorted(tiny_presets.TEXT_PRESETS) == sorted(families.text_families())
    assert sorted(tiny_presets.TOWER_PRESETS) == sorted(f.full_model_type for f in families.vision_families().values())


def test_unknown_model_types_name_the_supported_ones():
    with pytest.raises(UserError, match=r"^text model_type 'gpt2' is not supported \(supported: gemma3_text, llama, mistral, phi3, qwen2, qwen3\)$"):
        families.text_family("gpt2")
    with pytest.raises(UserError, match=r"^vision model_type 'vit' is not supported "
                                        r"\(supported: clip_vision_model, internvl_vision, siglip_vision_model\)$"):
        families.vision_family("vit")


def test_a_module_dropped_into_the_package_is_a_family_the_whole_toolkit_uses(llava_clip, tmp_path, monkeypatch):
    """ARCHITECTURE.md's recipe: a Llama-shaped family is one module defining FAMILY, and nothing else
    changes. One written into the package's search path is found, reads a LLaVA whose text config
    names it and gives the converters' table."""
    import json
    import sys

    from megatron_ext.convert.mapping import llava_mapping

    (tmp_path / "plugged.py").write_text("from megatron_ext.families.llama_like import LlamaLikeFamily\n"
                                         "FAMILY = LlamaLikeFamily(model_type='plugged_llama', config_class='LlamaConfig')\n")
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "megatron_ext.families.plugged", raising=False)
    families._modules.cache_clear()
    try:
        config = json.loads((llava_clip / "config.json").read_text())
        config["text_config"]["model_type"] = "plugged_llama"
        arch = families.read_llava(config)
        assert families.of(arch).text is families.text_family("plugged_llama")
        table = llava_mapping(arch)
        assert table["language_model.decoder.layers.1.mlp.linear_fc1.weight"].hf == (
            "language_model.model.layers.1.mlp.gate_proj.weight", "language_model.model.layers.1.mlp.up_proj.weight")
    finally:
        families._modules.cache_clear()
