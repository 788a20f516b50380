"""Megatron snapshot (converted or trained, any TP/PP) -> Hugging Face LLaVA directory.

Without megatron-core: the checkpoint's metadata names the model's tensors (whole, as a TP1/PP1
model holds them) with their shapes; the names are checked against the mapping table before
anything is written, and against the HF model the snapshot's config describes (named by a
forked helper process, which also writes the configs and tokenizer) before the directory
appears. The tensors are then
read from the dist checkpoint (whatever TP/PP layout it was saved with) a layer at a time
(dist_read.py), each table row is turned back into HF tensors, and those go straight into the
safetensors files (whose headers were written from the planned shapes), so about one layer is in
memory at a time. The HF tensors LLaVA never uses come back
from `hf_extra.safetensors`; config, generation config, tokenizer and processor complete the
directory, which appears only when complete.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_ext import families
from megatron_ext.checkpoint import layout
from megatron_ext.convert import coverage
from megatron_ext.convert.hf_checkpoint import (
    GENERATION_CONFIG_FILE,
    SAFETENSORS_DTYPES,
    ShardWriter,
    TensorSpec,
    check_tokenizer_dir,
    copy_tokenizer_files,
    hf_model_names,
)
from megatron_ext.convert.lora_export import TrainedTensors, read_trained
from megatron_ext.convert.mapping import model_mapping
from megatron_ext.errors import UserError
from megatron_ext.fsutil import atomic_output_dir, check_output_dir
from megatron_ext.model.arch import LlavaArch
from megatron_ext.progress import progress

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_SIZE = "5GB"


@dataclass(frozen=True)
class Export:
    """A checked export request."""

    snapshot: layout.Snapshot
    arch: LlavaArch
    tokenizer_dir: Path
    max_shard_size: int
    lora: TrainedTensors | None = None  # --lora-merge: the adapters merged into their base's weights

    @property
    def weights(self) -> layout.Snapshot:
        """The snapshot the model's tensors are read from (an adapter snapshot's base)."""
        return self.lora.base if self.lora else self.snapshot


def check_export(megatron_dir: str | Path, tokenizer_dir: str | Path | None = None, tp: int | None = None,
                pp: int | None = None, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, lora_merge: bool = False) -> Export:
    """Refuse bad input before anything is written. `tp`/`pp`, when given, must match the snapshot."""
    from transformers.utils.hub import convert_file_size_to_int

    snapshot = layout.find_snapshot(megatron_dir, "--megatron-dir")
    for flag, given, saved in (("--tp", tp, snapshot.tp), ("--pp", pp, snapshot.pp)):
        if given is not None and given != saved:
            raise UserError(f"{flag} {given} does not match {snapshot.path}, which was saved with TP{snapshot.tp} x "
                            f"PP{snapshot.pp}; the layout is read from the checkpoint, so omit {flag} or pass {saved}")
    arch = snapshot.arch
    try:
        shard_bytes = convert_file_size_to_int(max_shard_size)
    except ValueError:
        raise UserError(f"--max-shard-size {max_shard_size!r} is not a size (use e.g. 5GB, 500MB)") from None
    tok = check_tokenizer_dir(tokenizer_dir or snapshot.tokenizer_dir, "--tokenizer-dir")
    if lora_merge and snapshot.lora_base is None:
        raise UserError(f"--lora-merge: {snapshot.path} holds no LoRA adapters (it was not saved by a --lora-rank run)")
    if snapshot.lora_base is not None and not lora_merge:
        raise UserError(f"--megatron-dir {snapshot.path} holds LoRA adapters, not a whole model: pass --lora-merge for "
                        "an HF model with them merged, or --lora-adapter-dir DIR for a PEFT adapter")
    return Export(snapshot=snapshot, arch=arch, tokenizer_dir=tok, max_shard_size=shard_bytes,
                  lora=read_trained(snapshot) if lora_merge else None)


def _extra_specs(snapshot: layout.Snapshot) -> list[TensorSpec]:
    from safetensors import safe_open

    if not snapshot.hf_extra_file.is_file():
        return []
    with safe_open(str(snapshot.hf_extra_file), "pt") as f:
        return [TensorSpec(name, tuple(f.get_slice(name).get_shape()), SAFETENSORS_DTYPES[f.get_slice(name).get_dtype()])
                for name in f.keys()]


def _refuse(export: Export, problems: list[str], extra: list[str]) -> None:
    if problems:
        hint = "" if extra else f" ({export.snapshot.hf_extra_file} is missing: copy it from the converted checkpoint)"
        raise UserError(f"--megatron-dir {export.snapshot.path}: cannot produce a complete HF model{hint}; "
                        + "; ".join(problems))


def _write_weights(snapshot_tensors, groups: list[dict], extra: list[TensorSpec], export: Export, out: Path) -> None:
    from safetensors import safe_open

    from megatron_ext.model.provider import DTYPES

    # Megatron keeps norms and the patch embedding in float32 whatever the model dtype; HF stores
    # one dtype. Those values came from (or were trained in) the snapshot dtype, so this is exact.
    dtype = DTYPES[export.snapshot.dtype]
    table = model_mapping(export.arch)

    def hf_tensors(name: str, tensor: torch.Tensor):
        return zip(table[name].hf, table[name].rule.megatron_to_hf(tensor))

    # Every HF tensor's name and shape, from the Megatron shapes alone, in the order they will come.
    planned = [TensorSpec(hf_name, tuple(hf.shape), dtype) for group in groups for name, (shape, _) in group.items()
               for hf_name, hf in hf_tensors(name, torch.empty(shape, device="meta"))]
    writer = ShardWriter(out, export.max_shard_size, planned + extra)
    bar = progress(total=len(planned), desc="writing tensors", unit="tensor")
    for group in groups:
        loaded = snapshot_tensors.read(group)
        for name in group:
            tensor = loaded.pop(name)
            for hf_name, hf_tensor in hf_tensors(name, export.lora.merged(name, tensor) if export.lora else tensor):
                writer.add(hf_name, hf_tensor.to(dtype))
                bar.update()
    bar.close()
    if extra:
        with safe_open(str(export.snapshot.hf_extra_file), "pt") as f:
            for spec in extra:
                writer.add(spec.name, f.get_tensor(spec.name))
    writer.close()


def _write_configs(snapshot: layout.Snapshot, tokenizer_dir: Path, out: Path) -> None:
    import transformers

    from megatron_ext.model.provider import DTYPES

    kind = families.model_kind(snapshot.hf_config)
    config = getattr(transformers, kind.config_class).from_dict(snapshot.hf_config)
    config.dtype = DTYPES[snapshot.dtype]
    config.architectures = [kind.model_class]
    config.save_pretrained(out)
    copy_tokenizer_files(tokenizer_dir, out)
    _write_chat_template(snapshot, out)
    _write_trained_pixel_bounds(snapshot, out)
    if not (out / GENERATION_CONFIG_FILE).is_file():
        transformers.GenerationConfig.from_model_config(config).save_pretrained(out)


def _write_chat_template(snapshot: layout.Snapshot, out: Path) -> None:
    """The processor's (and tokenizer's) chat template: the one the snapshot was trained with, else
    the tokenizer's own, in the form that renders HF's structured messages as training did."""
    from megatron_ext import hf_loading
    from megatron_ext.data.chat_template import CHAT_TEMPLATE_FILE, processor_template, resolve_chat_template

    trained = snapshot.trainer_options
    tokenizer = hf_loading.load_tokenizer(str(out), "--tokenizer-dir")
    if not trained and not tokenizer.chat_template:
        return
    try:
        _, template = resolve_chat_template(trained.get("chat_template"), trained.get("lang", "en"), tokenizer,
                                            family_default=families.of(snapshot.arch).text.chat_template)
    except UserError as exc:
        log.warning("the exported processor keeps the tokenizer's chat template: the trained one is not found (%s)", exc)
        return
    (out / CHAT_TEMPLATE_FILE).write_text(processor_template(template, tokenizer))


def _write_trained_pixel_bounds(snapshot: layout.Snapshot, out: Path) -> None:
    """A run trained with --min-pixels / --max-pixels resized its images within them: so does its export's processor."""
    low, high = (snapshot.trainer_options.get(name) for name in ("min_pixels", "max_pixels"))
    if low is None and high is None:
        return
    from megatron_ext.data.native_resolution import save_pixel_bounds
    from megatron_ext.data.native_resolution_encoder import vision_of

    save_pixel_bounds(vision_of(snapshot.arch, out, low, high), out)


def _top_level(name: str) -> str:
    """The key prefix of a Megatron tensor's top-level module ("language_model."), or its whole name
    when it belongs to the model itself ("image_newline")."""
    return name.split(".")[0] + "." if "." in name else name


def _export(export: Export, out: Path) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    snapshot = export.snapshot
    # transformers' model and tokenizer code takes seconds to import: a forked process names the
    # tensors transformers expects for the config, then writes the configs and tokenizer, while
    # this one writes the weights; their names are compared before the directory appears.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as helper:
        expected_hf = helper.submit(hf_model_names, snapshot.hf_config)
        configs = helper.submit(_write_configs, snapshot, export.tokenizer_dir, out)
        from megatron_ext.convert.dist_read import SnapshotTensors, by_layer

        extra_specs = _extra_specs(snapshot)
        extra = [spec.name for spec in extra_specs]
        table = model_mapping(export.arch)
        # The model's tensors are those under the table's top-level prefixes (a trainer snapshot also
        # holds its optimizer state); anything there the table does not know is refused by the check.
        weights = SnapshotTensors(export.weights.path)
        stored = weights.stored(tuple({_top_level(name) for name in table}))
        _refuse(export, coverage.megatron_to_hf_problems(table, list(stored), extra), extra)
        _write_weights(weights, by_layer(stored), extra_specs, export, out)
        written = coverage.hf_names_written(table, list(stored), extra)
        _refuse(export, coverage.expected_hf_problems(written, expected_hf.result()), extra)
        configs.result()


def convert(megatron_dir: str | Path, hf_dir: str | Path, tokenizer_dir: str | Path | None = None, tp: int | None = None,
            pp: int | None = None, force: bool = False, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
            lora_merge: bool = False) -> Path:
    """The whole export, in this process; returns the HF directory."""
    export = check_export(megatron_dir, tokenizer_dir, tp, pp, max_shard_size, lora_merge)
    out = check_output_dir(hf_dir, force, "--hf-dir")
    if out == export.snapshot.root or out in export.snapshot.root.parents:
        raise UserError(f"--hf-dir {out} would replace the input --megatron-dir {export.snapshot.root}; choose another directory")
    log.info("converting %s (saved TP%d x PP%d, %s) to HF in %s", export.snapshot.path, export.snapshot.tp,
             export.snapshot.pp, export.snapshot.dtype, out)
    with atomic_output_dir(out) as tmp:
        _export(export, tmp)
    return out
