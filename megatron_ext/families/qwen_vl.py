"""What the Qwen-VL families (Qwen2.5-VL, Qwen3-VL) share: a Llama-shaped decoder with 3-D
multimodal RoPE (mRoPE) and transformers' own vision tower, held whole by every tensor-parallel rank
of the first pipeline stage (`model/mrope_vlm.py`). The tower's window order, 2-D RoPE, position
embedding, mergers and DeepStack features are then HF's by construction, and its tensors convert as
they are (docs/families.md says why). `qwen2_5_vl.py` and `qwen3_vl.py` each make one `QwenVLFamily`
with what sets them apart.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, ClassVar

from megatron_ext.errors import UserError
from megatron_ext.families.hf_config import as_dict, get
from megatron_ext.families.llama_like import LlamaLikeFamily
from megatron_ext.model.arch import TextArch, divisibility_problems, text_parallel_checks
from megatron_ext.model.mapping_rules import REPLICATED, Mapping, row


@dataclass(frozen=True)
class MRopeTextArch(TextArch):
    mrope_section: tuple[int, ...] = ()  # frequency channels following T, H, W


@dataclass(frozen=True)
class MRopeTextFamily(LlamaLikeFamily):
    """A decoder whose RoPE angles follow the (T, H, W) positions in sections of its channels."""

    default_mrope_section: tuple[int, ...] = ()  # transformers' when rope_parameters names none
    # The sections interleave over the channels (Qwen3-VL) instead of chunking them (Qwen2-VL).
    interleaved_mrope: bool = False

    def read(self, cfg: Any) -> MRopeTextArch:
        t = super().read(cfg)
        section = tuple((get(cfg, "rope_parameters") or {}).get("mrope_section", self.default_mrope_section))
        if sum(section) != t.kv_channels // 2:
            raise UserError(f"text_config.rope_parameters.mrope_section {list(section)} must add up to half the head "
                            f"size ({t.kv_channels // 2})")
        return MRopeTextArch(**vars(t), mrope_section=section)

    def language_config(self, t: MRopeTextArch) -> dict:
        return {**super().language_config(t), "mrope_section": list(t.mrope_section)}


@dataclass(frozen=True)
class QwenVLArch:
    text: MRopeTextArch
    vision_config: dict = field(hash=False)  # the tower's HF config, as config.json holds it
    image_token_id: int
    video_token_id: int
    model_type: str
    name: str  # the family's, for messages
    pad_token_id: int | None = None
    image_token: ClassVar[str] = "<|image_pad|>"  # its tokenizers'

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

    @property
    def deepstack_features(self) -> int:
        """How many decoder layers, from the first, get a DeepStack feature added after them."""
        return len(self.vision_config.get("deepstack_visual_indexes") or ())

    def parallel_problems(self, tp: int, pp: int) -> list[str]:
        # The tower is replicated over tensor ranks: only the decoder splits.
        problems = divisibility_problems(text_parallel_checks(self.text, tp, pp))
        first_stage = self.text.num_layers // max(pp, 1)
        if not problems and first_stage < self.deepstack_features:
            problems.append(f"--pp {pp} leaves {first_stage} decoder layers on the first pipeline stage, fewer than the "
                            f"{self.deepstack_features} that {self.name}'s DeepStack features are added after")
        return problems

    def check_parallel(self, tp: int, pp: int) -> None:
        if problems := self.parallel_problems(tp, pp):
            raise UserError("; ".join(problems))


@dataclass(frozen=True)
class QwenVLFamily:
    model_type: str
    config_class: str
    model_class: str
    name: str  # for messages
    text: MRopeTextFamily
    tower_class: str  # transformers' vision module, "module:Class"
    # The text rows name LlamaForCausalLM's tensors; checkpoints store them with other prefixes.
    hf_prefixes: tuple[tuple[str, str], ...]
    visual_prefix: str  # where checkpoints store the tower's tensors
    # transformers' in-memory names -> the names its checkpoints store (save_pretrained writes these).
    stored_prefixes: tuple[tuple[str, str], ...] = ()
    # The tower's modules that project into the decoder's width: they train with the projector.
    projections: tuple[str, ...] = ("merger",)
    tiled: bool = False  # as a LLaVA kind says it: its images keep their sizes, no tiles
    # (tower, grid [images, 3]) -> what the tower computes from its grid, by keyword (`model/tower_inputs.py`).
    tower_inputs: Callable[[Any, Any], dict] | None = None

    def complete(self, cfg: Any) -> dict:
        """The config as a dict with every field transformers reads (what checkpoints store)."""
        import transformers

        return getattr(transformers, self.config_class).from_dict(dict(as_dict(cfg))).to_dict()

    def stored_name(self, name: str) -> str:
        """A tensor's name as checkpoints store it, from a stored or a transformers model's name."""
        return _renamed(name, self.stored_prefixes)

    def read(self, cfg: Any) -> QwenVLArch:
        """The arch of a config of this family (a transformers config or a config.json dict)."""
        text = dict(as_dict(get(cfg, "text_config")))
        # Tying is the top-level field's (the text config's copy may be absent or stale).
        text["tie_word_embeddings"] = bool(get(cfg, "tie_word_embeddings", False))
        return QwenVLArch(text=self.text.read(text), vision_config=dict(as_dict(get(cfg, "vision_config"))),
                          image_token_id=get(cfg, "image_token_id"), video_token_id=get(cfg, "video_token_id"),
                          model_type=self.model_type, name=self.name, pad_token_id=text.get("pad_token_id"))

    def rows(self, arch: QwenVLArch) -> list[Mapping]:
        """Every Megatron tensor's row: the decoder's as a Llama's, each tower tensor whole on every rank."""
        once, layer = self.text.rows(arch.text)
        text = once + [r.at_layer(i) for i in range(arch.text.num_layers) for r in layer]
        vision = [row(f"vision_model.{name}", self.visual_prefix + name, REPLICATED) for name in self._tower_names(arch)]
        return [replace(r, hf=tuple(_renamed(h, self.hf_prefixes) for h in r.hf)) for r in text] + vision

    def _tower_names(self, arch: QwenVLArch) -> list[str]:
        """The tower's tensor names, read off the module built without memory."""
        import torch

        with torch.device("meta"):
            return list(self.tower(arch).state_dict())

    def tower(self, arch: QwenVLArch, dtype=None):
        """transformers' vision module of `arch`, randomly initialised, in eval mode; its parameters in
        `dtype` (default: torch's), made as `from_pretrained(dtype=...)` makes them (its RoPE inv_freq stays float32)."""
        import transformers

        module, name = self.tower_class.split(":")
        config = getattr(transformers, self.config_class)(vision_config=arch.vision_config).vision_config
        return getattr(importlib.import_module(module), name)._from_config(config, dtype=dtype).eval()

    def build(self, arch: QwenVLArch, opts, vp_stage: int | None = None, meta: bool = False):
        """This rank's model under the current megatron parallel state (`model.provider.ModelOptions`;
        `meta`: on PyTorch's meta device)."""
        from megatron.core import parallel_state

        from megatron_ext.model import mrope_vlm, tower_attention
        from megatron_ext.model.provider import DTYPES

        if problems := self.option_problems(opts, arch):
            raise UserError("; ".join(problems))
        arch.check_parallel(parallel_state.get_tensor_model_parallel_world_size(),
                            parallel_state.get_pipeline_model_parallel_world_size())

        def tower():
            return tower_attention.use(self.tower(arch, DTYPES[opts.dtype]), opts.execution.vision_attention)

        return mrope_vlm.build(arch.text, self.text, tower, self.projections, arch.image_token_id, arch.video_token_id,
                               opts, vp_stage, interleaved_mrope=self.text.interleaved_mrope, meta=meta, tower_inputs=self.tower_inputs)

    def option_problems(self, opts, arch: QwenVLArch) -> list[str]:
        """What this family's model cannot run with yet (each one line)."""
        ex = opts.execution
        problems = []
        if ex.sequence_parallel or ex.cp > 1:
            # The media features are placed into whole, unsplit sequences.
            problems.append(f"{self.name} runs without sequence or context parallelism so far")
        if arch.deepstack_features and ex.recompute_granularity == "full":
            # Recomputed layers would run without the DeepStack features, which live for one forward only.
            problems.append(f"{self.name} runs without full recomputation so far (its DeepStack features are added "
                            "by hooks on the first decoder layers); use --recompute-granularity selective")
        return problems


def _renamed(name: str, prefixes) -> str:
    for ours, theirs in prefixes:
        if name.startswith(ours):
            return theirs + name[len(ours):]
    return name
