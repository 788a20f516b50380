"""Model families: everything the toolkit knows about one text model or vision tower, in one module.

Each module of this package that defines `FAMILY` is a family: a `LlamaLikeFamily` (text) or a
`ViTFamily` (vision tower), found by the HF config's model_type. A module may also name related
model_types it refuses, with the reason (`REFUSED`), so the error says more than "unsupported". The rest of the toolkit looks
families up here and never names one. docs/families.md says how to add one.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from megatron_ext.errors import UserError
from megatron_ext.families.llama_like import LlamaLikeFamily
from megatron_ext.families.vit import ViTFamily

# The text family of the tiny models the demo and most tests build.
TINY_TEXT_DEFAULT = "llama"


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


def text_family(model_type: str | None) -> LlamaLikeFamily:
    return _find("text", text_families(), model_type)


def vision_family(model_type: str | None) -> ViTFamily:
    return _find("vision", vision_families(), model_type)


def tower_config(config, flag: str):
    """The vision-tower config of a tower checkpoint or of a two-tower one (e.g. a CLIP one), checked."""
    by_full = {f.full_model_type: f for f in vision_families().values()}
    model_type = getattr(config, "model_type", None)
    if model_type in by_full:
        config = config.vision_config
        model_type = config.model_type
    if model_type not in vision_families():
        supported = ", ".join(sorted([*vision_families(), *by_full]))
        raise UserError(f"{flag}: vision model_type {model_type!r} is not supported{_refused(model_type)} "
                        f"(supported: {supported})")
    return config
