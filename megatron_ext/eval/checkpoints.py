"""Open a Megatron or HF checkpoint for generation: cheap checks first, the model only on demand.

`open_checkpoint` validates the directory, loads the processor and picks the chat template (no
torch.distributed, no model), so bad input (wrong kind of directory, unreadable image, prompt
longer than the context) is reported before anything heavy starts. `ModelSource.generator()` then
builds the model: for Megatron it initialises the TP x PP process group (one process per rank,
started by torchrun) and loads the snapshot, whatever layout it was saved with.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_ext.checkpoint import layout
from megatron_ext.errors import UserError
from megatron_ext.eval.generation import Generator, new_token_budget
from megatron_ext.eval.prompts import EncodedPrompt, NativeResolutionPromptEncoder, PromptEncoder, stop_token_ids
from megatron_ext.eval.sampling import SamplingOptions
from megatron_ext.model.arch import LlavaArch
from megatron_ext.model.backends import compute_dtype

MEGATRON_FLAG = "--megatron-dir"
HF_FLAG = "--hf-dir"


@dataclass
class ModelSource:
    kind: str  # "megatron" or "hf"
    path: Path
    processor: object  # the HF processor (a native-resolution model's: its prompt encoder, which holds the tokenizer)
    template_name: str
    encoder: PromptEncoder | NativeResolutionPromptEncoder
    context_length: int  # the language model's max_position_embeddings
    dtype: str  # compute dtype, resolved
    image_aspect: str  # data.images.fit_aspect mode, resolved
    snapshot: layout.Snapshot | None = None

    @property
    def flag(self) -> str:
        return MEGATRON_FLAG if self.kind == "megatron" else HF_FLAG

    def check_fits(self, prompt: EncodedPrompt, options: SamplingOptions) -> None:
        new_token_budget(prompt, self.context_length, options)

    def generator(self, tp: int | None = None, pp: int | None = None) -> Generator:
        if self.kind == "hf":
            from megatron_ext.eval.hf_generator import HFGenerator

            if world_size() > 1:
                raise UserError(f"{HF_FLAG}: HF checkpoints run in one process; start the script without torchrun")
            return HFGenerator.load(self.path, self.processor, self.dtype)
        model = load_megatron_model(self.snapshot, *self.parallel_layout(tp, pp), seq_length=self.context_length,
                                    dtype=self.dtype)
        return megatron_generator(model, self.snapshot.arch, self.processor)

    def parallel_layout(self, tp: int | None, pp: int | None) -> tuple[int, int]:
        """--tp/--pp, defaulting to the saved layout when the process count fits it, else 1 x 1."""
        world = world_size()
        if tp is None and pp is None:
            saved = (self.snapshot.tp, self.snapshot.pp)
            if saved[0] * saved[1] == world:
                return saved
            if world > 1:
                raise UserError(f"{world} processes were started; give --tp and --pp with TP x PP = {world}")
            return 1, 1
        tp, pp = tp or 1, pp or 1
        if tp * pp != world:
            raise UserError(f"--tp {tp} x --pp {pp} needs {tp * pp} processes, this run has {world}; "
                            f"start it with torchrun --nproc-per-node {tp * pp}")
        self.snapshot.arch.check_parallel(tp, pp)
        return tp, pp


def megatron_generator(model, arch, processor) -> Generator:
    """The generator of `arch`'s Megatron model (this rank's, unwrapped): a LLaVA's, or mRoPE's."""
    from megatron_ext.eval.megatron_generator import MegatronGenerator
    from megatron_ext.eval.mrope_generator import MRopeGenerator

    generator_class = MegatronGenerator if isinstance(arch, LlavaArch) else MRopeGenerator
    return generator_class(model, arch, processor, stop_token_ids(processor.tokenizer))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def load_megatron_model(snapshot: layout.Snapshot, tp: int, pp: int, seq_length: int, dtype: str):
    """This rank's model (a LLaVAModel, or a family's own) with the snapshot's weights, computing in
    `dtype` (collective)."""
    from megatron_ext import families
    from megatron_ext.distributed import init_parallel
    from megatron_ext.lora.checkpoint import load_for_inference
    from megatron_ext.model.provider import ModelOptions

    init_parallel(tp, pp)
    model = families.build_model(snapshot.arch, ModelOptions(seq_length=seq_length, dtype=dtype, init_weights=False,
                                                             parallel_output=True))
    load_for_inference(model, snapshot)
    return model.eval()


def _is_megatron_dir(path: Path) -> bool:
    return (path / layout.LATEST_FILE).is_file() or (path / layout.METADATA_FILE).is_file()


def _open_megatron(path: Path) -> tuple[layout.Snapshot, dict]:
    if path.is_dir() and not _is_megatron_dir(path) and (path / "config.json").is_file():
        raise UserError(f"{MEGATRON_FLAG} {path} is a Hugging Face checkpoint (config.json); pass it as {HF_FLAG}")
    snapshot = layout.find_snapshot(path, MEGATRON_FLAG)
    if not snapshot.tokenizer_dir.is_dir():
        raise UserError(f"{MEGATRON_FLAG} {snapshot.root} has no {layout.TOKENIZER_DIR}/ directory (tokenizer and "
                        "processor); re-create the checkpoint with scripts/convert/convert_hf_to_megatron.py")
    return snapshot, snapshot.hf_config


def _open_hf(path: Path) -> dict:
    from megatron_ext.convert.hf_checkpoint import read_config

    if _is_megatron_dir(path):
        raise UserError(f"{HF_FLAG} {path} is a Megatron checkpoint; pass it as {MEGATRON_FLAG}")
    return read_config(path, HF_FLAG)


def _trained_options(snapshot: layout.Snapshot | None) -> dict:
    """The trainer options a trained snapshot was trained with (empty otherwise)."""
    return snapshot.trainer_options if snapshot else {}


def open_checkpoint(megatron_dir: str | None, hf_dir: str | None, chat_template: str | None = None,
                    dtype: str = "auto", image_aspect: str | None = None) -> ModelSource:
    """Exactly one of `megatron_dir` / `hf_dir`. The chat template: `chat_template` if given, else the
    one a trained snapshot was trained with, else the tokenizer's own (else its text family's or the English default).
    The image aspect mode likewise: given, else as trained, else crop.
    `dtype`: the compute dtype (`backends.compute_dtype`), whatever the checkpoint stores."""
    from megatron_ext import families

    if (megatron_dir is None) == (hf_dir is None):
        raise UserError(f"give exactly one of {MEGATRON_FLAG} and {HF_FLAG}")
    kind, flag = ("megatron", MEGATRON_FLAG) if megatron_dir else ("hf", HF_FLAG)
    path = Path(megatron_dir or hf_dir).expanduser().resolve()
    if not path.exists():
        raise UserError(f"{flag} {path} does not exist")
    snapshot = None
    if kind == "megatron":
        snapshot, hf_config = _open_megatron(path)
        processor_dir = snapshot.tokenizer_dir
    else:
        hf_config, processor_dir = _open_hf(path), path
    arch = families.read_model(hf_config)
    trained = _trained_options(snapshot)
    image_aspect = image_aspect or trained.get("image_aspect", "crop")
    prompts = prompt_encoding(processor_dir, flag, hf_config, arch, chat_template or trained.get("chat_template"),
                              trained.get("lang", "en"), image_aspect,
                              (trained.get("min_pixels"), trained.get("max_pixels")))
    return ModelSource(kind=kind, path=snapshot.root if snapshot else path, **prompts,
                       context_length=arch.text.max_position_embeddings,
                       dtype=compute_dtype(dtype, torch.cuda.is_available()), image_aspect=image_aspect, snapshot=snapshot)


def prompt_encoding(processor_dir: Path, flag: str, hf_config: dict, arch, chat_template: str | None, lang: str,
                    image_aspect: str, pixels: tuple[int | None, int | None] = (None, None)) -> dict:
    """{"processor", "template_name", "encoder"} of `arch`'s prompts, its processor read from `processor_dir`
    (`flag` names it in errors); `chat_template` None: the tokenizer's own, else its family's. `pixels`:
    a native-resolution model's (--min-pixels, --max-pixels) as trained (None: its processor's)."""
    if isinstance(arch, LlavaArch):
        return _llava_prompts(processor_dir, flag, hf_config, arch, chat_template, lang, image_aspect)
    return _native_resolution_prompts(processor_dir, arch, chat_template, lang, pixels)


def _llava_prompts(processor_dir: Path, flag: str, hf_config: dict, arch, chat_template: str | None, lang: str,
                   image_aspect: str) -> dict:
    """A LLaVA's processor, chat template and prompt encoder (the processor expands its images)."""
    from megatron_ext import families
    from megatron_ext.data.chat_template import resolve_chat_template
    from megatron_ext.hf.processors import load_processor

    processor = load_processor(processor_dir, flag, families.llava_kind(hf_config))
    name, template = resolve_chat_template(chat_template, lang, processor.tokenizer,
                                           family_default=families.of(arch).text.chat_template)
    return {"processor": processor, "template_name": name, "encoder": PromptEncoder(processor, template, image_aspect)}


def _native_resolution_prompts(processor_dir: Path, arch, chat_template: str | None, lang: str,
                               pixels: tuple[int | None, int | None]) -> dict:
    """A native-resolution model's prompt encoder: the trainer's task encoder for it, its images within
    the bounds it was trained with; it holds the tokenizer, all that the generators ask of a processor."""
    from megatron_ext.data.native_resolution_encoder import NativeResolutionTaskEncoder

    task_encoder = NativeResolutionTaskEncoder.for_model(
        str(processor_dir), arch, *pixels, seq_length=arch.text.max_position_embeddings, pad_token_id=arch.pad_token_id,
        chat_template=chat_template, lang=lang)
    encoder = NativeResolutionPromptEncoder(task_encoder)
    return {"processor": encoder, "template_name": task_encoder.template_name, "encoder": encoder}
