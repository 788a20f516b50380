"""What building a model asks of the text model's and the vision tower's families.

The model layer knows no family: the caller resolves them once (`megatron_ext.families.of(arch)`)
and passes them to `provider.build_model`. Each hook has a default in the families' base classes
(`LlamaLikeFamily`, `ViTFamily`) that leaves megatron-core's layers as they are; a family that
computes something else overrides it in its own module, with the pieces of this package
(`norms.py`, `output_step.py`, `layer_rope.py`, ...).
"""

from __future__ import annotations

from typing import Any, Protocol

from megatron_ext.model.arch import TextArch, VisionArch


class TextHooks(Protocol):
    def language_config(self, t: TextArch) -> dict:
        """megatron-core TransformerConfig fields of the language model beyond its sizes."""

    def language_spec(self, t: TextArch, spec: Any, config: Any, backend: str, vp_stage: int | None) -> Any:
        """The language model's layer spec (or block spec), given megatron-core's for `backend`."""

    def after_build(self, t: TextArch, model: Any) -> None:
        """Anything done to this rank's freshly built LLaVAModel (e.g. a hook on its embedding)."""


class VisionHooks(Protocol):
    def vision_config(self, v: VisionArch) -> dict:
        """megatron-core TransformerConfig fields of the ViT."""

    def vision_spec(self, v: VisionArch, spec: Any, backend: str) -> Any:
        """The ViT's layer spec, given the one built for `backend`."""


class ModelFamilies(Protocol):
    text: TextHooks
    vision: VisionHooks


class VisionLanguageHooks(Protocol):
    """A whole vision-language model that is not a LLaVA (Qwen2.5-VL): its family reads its HF
    config into an arch of its own and builds this rank's model from it."""

    model_type: str  # the HF config's
    config_class: str  # its transformers classes
    model_class: str

    def read(self, cfg: Any) -> Any:
        """The model's arch (with `check_parallel(tp, pp)`), refusing what cannot be computed exactly."""

    def rows(self, arch: Any) -> list:
        """Every Megatron tensor's `mapping_rules.Mapping`, layers numbered."""

    def build(self, arch: Any, opts: Any, vp_stage: int | None = None) -> Any:
        """This rank's model under the current megatron parallel state."""
