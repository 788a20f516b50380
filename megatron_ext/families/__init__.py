"""Model families: everything the toolkit knows about one text model or vision tower, in one module.

Each module of this package that defines `FAMILY` is a family: a `LlamaLikeFamily` (text) or a
`ViTFamily` (vision tower), found by the HF config's model_type. It reads its HF config into the
model's numbers (`model.arch`), names its HF <-> Megatron tensors (`rows`) and says what its model
computes through hooks (`model/family_hooks.py`). A module may also name related model_types it
refuses, with the reason (`REFUSED`), so the error says more than "unsupported".

The rest of the toolkit reads an HF LLaVA config with `read_llava`, resolves the families of the
model once with `of(arch)` and passes them on; it never names a family or compares a model_type.
ARCHITECTURE.md and docs/families.md say how to add one.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from functools import cache
from typing import Any

from megatron_ext.errors import UserError
from megatron_ext.families import llava
from megatron_ext.families.hf_config import get
from megatron_ext.families.llama_like import LlamaLikeFamily
from megatron_ext.families.vit import ViTFamily
from megatron_ext.model.arch import LlavaArch


@cache
def _modules() -> tuple:
    return tuple(importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__))


def _families() -> tuple:
    return tuple(module.FAMILY for module in _modules() if hasattr(module, "FAMILY"))


def _refused(model_type: str | None) -> str:
    reasons = {k: v for module in _modules() for k, v in getattr(module, "REFUSED", {}).items()}
    return f": {reasons[model_type]}" if model_type in reasons else ""


def text_families() -> dict[str, LlamaLikeFamily]:
    return {f.model_type: f for f in _families() if isinstance(f, LlamaLikeFamily)}


def vision_families() -> dict[str, ViTFamily]:
    return {f.model_type: f for f in _families() if isinstance(f, ViTFamily)}


def _find(kind: str, known: dict, model_type: str | None):
    if model_type not in known:
        raise UserError(f"{kind} model_type {model_type!r} is not supported{_refused(model_type)} "
                        f"(supported: {', '.join(sorted(known))})")
    return known[model_type]


def vision_language_families() -> dict:
    """Families of whole vision-language models that are not LLaVAs (Qwen2.5-VL), by model_type:
    `model/family_hooks.VisionLanguageHooks`."""
    return {f.model_type: f for f in _families() if not isinstance(f, (LlamaLikeFamily, ViTFamily))}


def vision_language_family(model_type: str | None):
    return _find("vision-language", vision_language_families(), model_type)


def text_family(model_type: str | None) -> LlamaLikeFamily:
    return _find("text", text_families(), model_type)


def vision_family(model_type: str | None) -> ViTFamily:
    return _find("vision", vision_families(), model_type)


@dataclass(frozen=True)
class Tower:
    config: Any  # the vision tower's own config
    family: ViTFamily
    whole: bool  # the checkpoint holds more than the tower (a two-tower CLIP, a whole InternVL)


def vision_tower(config, flag: str) -> Tower:
    """The vision tower of a tower checkpoint's config or of a larger one's (e.g. a CLIP one), checked."""
    by_full = {f.full_model_type: f for f in vision_families().values()}
    model_type = getattr(config, "model_type", None)
    whole = model_type in by_full
    if whole:
        config = config.vision_config
        model_type = config.model_type
    if model_type not in vision_families():
        supported = ", ".join(sorted([*vision_families(), *by_full]))
        raise UserError(f"{flag}: vision model_type {model_type!r} is not supported{_refused(model_type)} "
                        f"(supported: {supported})")
    return Tower(config=config, family=vision_families()[model_type], whole=whole)


@dataclass(frozen=True)
class Families:
    """The families of one model: what `model.provider.build_model` and the converters ask of them."""

    text: LlamaLikeFamily
    vision: ViTFamily


def of(arch):
    """A LLaVA's families (text model, tower), or a whole vision-language model's own family."""
    if not isinstance(arch, LlavaArch):
        return vision_language_family(arch.model_type)
    return Families(text=text_family(arch.text.model_type), vision=vision_family(arch.vision.model_type))


def image_token(arch) -> str:
    """The text of the image token in the model's tokenizer (LLaVA's `<image>`, or the family's own)."""
    return llava.IMAGE_TOKEN if isinstance(arch, LlavaArch) else arch.image_token


def _whole(cfg: Any):
    """The vision-language family of a config that is not a LLaVA's, or None."""
    return vision_language_families().get(get(cfg, "model_type"))


def read_model(cfg: Any):
    """The arch of an HF config: a LLaVA's `LlavaArch`, or a vision-language family's own."""
    family = _whole(cfg)
    return family.read(cfg) if family else read_llava(cfg)


def complete_config(cfg: Any) -> dict:
    """`complete_llava_config`, or a vision-language family's config completed likewise."""
    family = _whole(cfg)
    return family.complete(cfg) if family else complete_llava_config(cfg)


def model_kind(cfg: Any):
    """The transformers classes of a config's model (`config_class`, `model_class`)."""
    return _whole(cfg) or llava_kind(cfg)


def build_model(arch, opts, vp_stage: int | None = None, meta: bool = False):
    """This rank's model of `arch` (`model.provider.ModelOptions`): megatron-core's LLaVAModel, or
    a vision-language family's model; with `opts.execution.compile_layers`, its transformer layers compiled;
    `meta`: on PyTorch's meta device (`memory/meta_ranks.py`)."""
    from megatron_ext.model import float8_linears
    from megatron_ext.model.compiled_layers import compile_layers
    from megatron_ext.model.provider import build_model as build_llava

    model = (build_llava(arch, of(arch), opts, vp_stage, meta=meta) if isinstance(arch, LlavaArch)
             else of(arch).build(arch, opts, vp_stage, meta=meta))
    if opts.execution.fp8 and opts.execution.fp8_backend == "torchao":
        float8_linears.apply(model)
    if opts.execution.compile_layers:
        compile_layers(model)
    return model


def read_llava(cfg: Any) -> LlavaArch:
    """The LlavaArch of an HF LLaVA config (a transformers config or a config.json dict), checked."""
    return llava.read_llava(cfg, text_family, vision_family)


def complete_llava_config(cfg: Any) -> dict:
    """An HF LLaVA config as a dict with every field transformers would read, defaults included
    (published config.json files leave them out); what checkpoints store, so that reading them
    again needs no transformers."""
    return llava.complete(cfg)


def llava_kind(cfg: Any) -> llava.LlavaKind:
    """The HF LLaVA architecture of a config (object or config.json dict): its transformers classes."""
    return llava.kind_of(cfg)


def llava_kinds() -> dict[str, llava.LlavaKind]:
    """Every supported HF LLaVA architecture, by its build-llava --arch name."""
    return {kind.arch_flag: kind for kind in llava.KINDS.values()}


def load_model(source, flag: str, **kwargs):
    """An HF checkpoint in the class its config names: a LLaVA's (LLaVA, LLaVA-NeXT, OneVision) or a
    vision-language family's."""
    import transformers

    from megatron_ext import hf_loading

    model_class = getattr(transformers, model_kind(hf_loading.load_config(str(source), flag)).model_class)
    return hf_loading.load_pretrained(model_class, str(source), flag, **kwargs)
