"""Qwen2.5-VL: a Qwen2 decoder with 3-D multimodal RoPE (chunked sections, megatron-core's `mrope`,
equal to transformers' to the bit) and a native-resolution vision tower with windowed attention.

The tower is transformers' own module, held whole by every tensor-parallel rank of the first
pipeline stage (`model/mrope_vlm.py`): its window order, 2-D RoPE and patch merger are then HF's
by construction, and its tensors convert as they are (docs/families.md says why).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar

from megatron_ext.errors import UserError
from megatron_ext.families.hf_config import as_dict, get
from megatron_ext.families.llama_like import LlamaLikeFamily
from megatron_ext.model.arch import TextArch, divisibility_problems, text_parallel_checks
from megatron_ext.model.mapping_rules import REPLICATED, Mapping, row

# transformers' default when rope_parameters names no sections (configuration_qwen2_5_vl.py).
DEFAULT_MROPE_SECTION = (16, 24, 24)

# The tower's tensors, as checkpoints store them under `visual.` (`*`: a block's index).
_VISION_ONCE = ("patch_embed.proj.weight", "merger.ln_q.weight", "merger.mlp.0.weight", "merger.mlp.0.bias",
                "merger.mlp.2.weight", "merger.mlp.2.bias")
_VISION_BLOCK = tuple(f"blocks.*.{name}" for name in (
    "norm1.weight", "norm2.weight", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
    *(f"mlp.{p}_proj.{w}" for p in ("gate", "up", "down") for w in ("weight", "bias"))))
# The text rows name LlamaForCausalLM's tensors; Qwen2.5-VL checkpoints store them with other prefixes.
_HF_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))
# transformers' in-memory names -> the names its checkpoints store (save_pretrained writes these).
_STORED_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


@dataclass(frozen=True)
class MRopeTextArch(TextArch):
    mrope_section: tuple[int, ...] = DEFAULT_MROPE_SECTION  # frequency channels following T, H, W


class MRopeTextFamily(LlamaLikeFamily):
    """A Qwen2 decoder whose RoPE angles follow the (T, H, W) positions in chunked sections."""

    def read(self, cfg: Any) -> MRopeTextArch:
        t = super().read(cfg)
        section = tuple((get(cfg, "rope_parameters") or {}).get("mrope_section", DEFAULT_MROPE_SECTION))
        if sum(section) != t.kv_channels // 2:
            raise UserError(f"text_config.rope_parameters.mrope_section {list(section)} must add up to half the head "
                            f"size ({t.kv_channels // 2})")
        return MRopeTextArch(**vars(t), mrope_section=section)

    def language_config(self, t: MRopeTextArch) -> dict:
        return {**super().language_config(t), "mrope_section": list(t.mrope_section)}


TEXT = MRopeTextFamily(model_type="qwen2_5_vl_text", config_class="Qwen2_5_VLTextConfig", qkv_bias=True,
                       chat_template="chatml")


@dataclass(frozen=True)
class Qwen2_5_VLArch:
    text: MRopeTextArch
    vision_config: dict = field(hash=False)  # the tower's HF config, as config.json holds it
    image_token_id: int
    video_token_id: int
    pad_token_id: int | None = None
    model_type: str = "qwen2_5_vl"
    image_token: ClassVar[str] = "<|image_pad|>"  # its tokenizer's

    @property
    def vision_depth(self) -> int:
        return self.vision_config["depth"]

    @property
    def image_token_index(self) -> int:
        return self.image_token_id

    @property
    def img_seq_len(self) -> int:
        """Positions an image token takes: one (the task encoder repeats it per merged patch)."""
        return 1

    @property
    def smallest_image_positions(self) -> int:
        # transformers' processor resizes an image to at least 56 x 56 pixels: 2 x 2 merged patches.
        return 4

    def summary(self) -> dict:
        return {"text": asdict(self.text), "vision": self.vision_config, "image_token_id": self.image_token_id,
                "video_token_id": self.video_token_id}

    def parallel_problems(self, tp: int, pp: int) -> list[str]:
        # The tower is replicated over tensor ranks: only the decoder splits.
        return divisibility_problems(text_parallel_checks(self.text, tp, pp))

    def check_parallel(self, tp: int, pp: int) -> None:
        if problems := self.parallel_problems(tp, pp):
            raise UserError("; ".join(problems))


@dataclass(frozen=True)
class Qwen2_5_VLFamily:
    model_type: str = "qwen2_5_vl"
    config_class: str = "Qwen2_5_VLConfig"
    model_class: str = "Qwen2_5_VLForConditionalGeneration"
    text: MRopeTextFamily = TEXT
    tiled: bool = False  # as a LLaVA kind says it: its images keep their sizes, no tiles

    def complete(self, cfg: Any) -> dict:
        """The config as a dict with every field transformers reads (what checkpoints store)."""
        import transformers

        return getattr(transformers, self.config_class).from_dict(dict(as_dict(cfg))).to_dict()

    @staticmethod
    def stored_name(name: str) -> str:
        """A tensor's name as checkpoints store it, from a stored or a transformers model's name."""
        return _renamed(name, _STORED_PREFIXES)

    def read(self, cfg: Any) -> Qwen2_5_VLArch:
        """The arch of a Qwen2.5-VL config (a transformers config or a config.json dict)."""
        text = dict(as_dict(get(cfg, "text_config")))
        # Tying is the top-level field's (configuration_qwen2_5_vl.py copies it into text_config).
        text["tie_word_embeddings"] = bool(get(cfg, "tie_word_embeddings", False))
        return Qwen2_5_VLArch(text=TEXT.read(text), vision_config=dict(as_dict(get(cfg, "vision_config"))),
                              image_token_id=get(cfg, "image_token_id"), video_token_id=get(cfg, "video_token_id"),
                              pad_token_id=text.get("pad_token_id"))

    def rows(self, arch: Qwen2_5_VLArch) -> list[Mapping]:
        """Every Megatron tensor's row: the decoder's as Qwen2's, the tower's whole on every rank."""
        once, layer = TEXT.rows(arch.text)
        text = once + [r.at_layer(i) for i in range(arch.text.num_layers) for r in layer]
        vision = [row(f"vision_model.{name}", f"visual.{name}", REPLICATED) for name in _VISION_ONCE]
        vision += [row(f"vision_model.{name}", f"visual.{name}", REPLICATED).at_layer(i)
                   for i in range(arch.vision_depth) for name in _VISION_BLOCK]
        return [replace(r, hf=tuple(_renamed(h, _HF_PREFIXES) for h in r.hf)) for r in text] + vision

    def build(self, arch: Qwen2_5_VLArch, opts, vp_stage: int | None = None):
        """This rank's model under the current megatron parallel state (`model.provider.ModelOptions`)."""
        from megatron_ext.model import mrope_vlm

        if problems := self.option_problems(opts):
            raise UserError("; ".join(problems))

        # The tower's patch merger projects into the decoder's width: it trains with the projector.
        return mrope_vlm.build(arch.text, TEXT, lambda: _tower(arch), "merger", arch.image_token_id,
                               arch.video_token_id, opts, vp_stage)

    @staticmethod
    def option_problems(opts) -> list[str]:
        """What this family's model cannot run with yet (each one line)."""
        ex = opts.execution
        problems = []
        if opts.dtype != "float32":
            # The tower would need casting without its RoPE inv_freq buffers; untested so far.
            problems.append(f"Qwen2.5-VL runs in float32 only so far, not {opts.dtype}")
        if ex.sequence_parallel or ex.cp > 1:
            # The media features are placed into whole, unsplit sequences.
            problems.append("Qwen2.5-VL runs without sequence or context parallelism so far")
        return problems


def _renamed(name: str, prefixes) -> str:
    for ours, theirs in prefixes:
        if name.startswith(ours):
            return theirs + name[len(ours):]
    return name


def _tower(arch: Qwen2_5_VLArch):
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = Qwen2_5_VLConfig(vision_config=arch.vision_config).vision_config
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(config).eval()


FAMILY = Qwen2_5_VLFamily()
