"""Hugging Face LLaVA -> Megatron dist checkpoint at any TP x PP.

`convert` checks everything it can before writing (config, parallel layout, weights, tokenizer,
output directory), then starts tp*pp CPU ranks. Each rank builds its own part of the model
uninitialised, only for its layout (its memory is never touched), checks from the HF tensors'
shapes that the mapping table fills every tensor, and the ranks save together with
dist_checkpointing: each chunk is computed from the HF safetensors as the writer reaches it (one
HF tensor read at a time), written and dropped, so a rank holds about one layer at a time
(dist_write.py). The result appears at the output path only when complete (see
checkpoint/layout.py for the layout).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_ext.checkpoint import layout
from megatron_ext.checkpoint.keys import canonical_megatron_name, tensor_of_chunk
from megatron_ext.convert import coverage
from megatron_ext.convert.hf_checkpoint import HfWeights, check_tokenizer_dir, copy_tokenizer_files, read_config
from megatron_ext.convert.mapping import hf_name_of, hf_only_names, model_mapping
from megatron_ext.errors import UserError
from megatron_ext.families import complete_config, read_model
from megatron_ext.fsutil import atomic_output_dir, check_output_dir
from megatron_ext.model.arch import LlavaArch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConversionRequest:
    """A checked conversion request (picklable: it is sent to every rank)."""

    hf_dir: Path
    tp: int
    pp: int
    dtype: str
    hf_config: dict

    @property
    def arch(self):
        """A `LlavaArch`, or a whole vision-language model's arch."""
        return read_model(self.hf_config)


def check_conversion(hf_dir: str | Path, tp: int, pp: int) -> ConversionRequest:
    """Everything about the input that can be refused, refused before any output exists."""
    hf_dir = Path(hf_dir).expanduser().resolve()
    if not hf_dir.is_dir():
        raise UserError(f"--hf-dir {hf_dir} is not a directory")
    # Stored complete: the trainer and the launcher read it back without transformers' defaults.
    hf_config = complete_config(read_config(hf_dir, "--hf-dir"))
    arch = read_model(hf_config)
    arch.check_parallel(tp, pp)
    weights = HfWeights(hf_dir, normalize=hf_name_of(arch))
    check_tokenizer_dir(hf_dir, "--hf-dir")
    return ConversionRequest(hf_dir=hf_dir, tp=tp, pp=pp, dtype=weights.dtype(), hf_config=hf_config)


def _misfit(row, weights: HfWeights, tp_rank: int, tp: int, shape) -> str | None:
    """Why the row's HF tensors do not give this rank's Megatron tensor, or None (from shapes alone)."""
    try:
        part = row.rule.shard(row.rule.hf_to_megatron([weights.meta(hf) for hf in row.hf]), tp_rank, tp)
    except (ValueError, RuntimeError) as exc:  # shapes the rule cannot reshape or split
        return f"{'+'.join(row.hf)} ({exc})"
    if part.shape != shape:
        return f"{'+'.join(row.hf)} (gives {list(part.shape)} on TP rank {tp_rank}, {row.megatron} needs {list(shape)})"
    return None


def check_model(model, arch: LlavaArch, weights: HfWeights) -> coverage.FillReport:
    """Which of this rank's Megatron tensors the HF tensors fill, and why not the others (nothing is read)."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    layer_offset = model.language_model.decoder.layers[0].layer_number - 1
    table = model_mapping(arch)
    available = set(weights.names)
    report = coverage.FillReport()
    params = {name: p for name, p in model.state_dict(keep_vars=True).items() if not name.endswith("_extra_state")}
    for name, param in params.items():
        row = table.get(canonical_megatron_name(name, layer_offset))
        if row is None:
            report.unmapped.append(canonical_megatron_name(name, layer_offset))
            continue
        lacking = [hf for hf in row.hf if hf not in available]
        misfit = None if lacking else _misfit(row, weights, tp_rank, tp, param.shape)
        if lacking or misfit:
            report.missing_hf.extend(lacking)
            report.misfits.extend([misfit] if misfit else [])
            report.failed.append(row.megatron)
            continue
        report.filled.append(row.megatron)
    return report


class MegatronChunks:
    """Chunks of the checkpoint's global Megatron tensors (the TP1 layout), computed from the HF
    tensors. The last full tensor is kept: a rank's chunks of one tensor come one after another."""

    def __init__(self, arch: LlavaArch, weights: HfWeights):
        self.table = model_mapping(arch)
        self.weights = weights
        self._last: tuple[str, torch.Tensor] | None = None

    def __call__(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        name, where = tensor_of_chunk(key, offsets, sizes)
        full = self._full(name)
        part = full[where]
        # A part of a larger tensor is copied out, so the writer never holds more than the chunk.
        return (part if part.shape == full.shape else part.clone(memory_format=torch.contiguous_format)).reshape(sizes)

    def _full(self, name: str) -> torch.Tensor:
        if self._last is None or self._last[0] != name:
            self._last = None  # dropped before the next is made, so only one is ever held
            row = self.table[name]
            self._last = name, row.rule.hf_to_megatron([self.weights.read(hf) for hf in row.hf])
        return self._last[1]


def _gather(report: coverage.FillReport) -> list[coverage.FillReport]:
    import torch.distributed as dist

    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return reports


def _write_beside_snapshot(request: ConversionRequest, arch: LlavaArch, weights: HfWeights, root: Path) -> None:
    """Rank 0, after the model is saved: the unused HF tensors, tokenizer, metadata, latest marker."""
    from safetensors.torch import save_file

    extra = hf_only_names(arch, weights.names)
    save_file({name: weights.read(name) for name in extra}, str(root / layout.HF_EXTRA_FILE), metadata={"format": "pt"})
    copy_tokenizer_files(request.hf_dir, root / layout.TOKENIZER_DIR)
    layout.write_metadata(root / layout.RELEASE, kind="converted", iteration=0, hf_config=request.hf_config,
                          tp=request.tp, pp=request.pp, dtype=request.dtype)
    layout.mark_latest(root, layout.RELEASE)


def convert_in_world(request: ConversionRequest, root: Path) -> list[str]:
    """Collective over a world whose megatron parallel state is request.tp x request.pp (DP replicas may
    repeat the work; only main replicas are written). Writes the checkpoint into `root`; returns
    the coverage problems instead when there are any (the same list on every rank)."""
    import torch.distributed as dist

    from megatron_ext import families
    from megatron_ext.checkpoint.model_io import save_model_weights
    from megatron_ext.convert.dist_write import ComputedSaveStrategy
    from megatron_ext.model.provider import ModelOptions

    arch = request.arch
    weights = HfWeights(request.hf_dir, normalize=hf_name_of(arch))
    model = families.build_model(arch, ModelOptions(init_weights=False, dtype=request.dtype))
    report = check_model(model, arch, weights)
    problems = coverage.hf_to_megatron_problems(model_mapping(arch), _gather(report), weights.names,
                                                hf_only_names(arch, weights.names))
    if problems:
        return problems
    if dist.get_rank() == 0:
        log.info("every tensor is filled from %s; saving", request.hf_dir)
    save_model_weights(model, root / layout.RELEASE, sharded_strategy=ComputedSaveStrategy(MegatronChunks(arch, weights)))
    if dist.get_rank() == 0:
        _write_beside_snapshot(request, arch, weights, root)
        log.info("saved the TP%d x PP%d checkpoint, its tokenizer and metadata", request.tp, request.pp)
    dist.barrier()
    return []


def _rank_entry(request: ConversionRequest, root: Path) -> list[str]:
    from megatron_ext.distributed import init_parallel, shutdown

    init_parallel(request.tp, request.pp)
    try:
        return convert_in_world(request, root)
    finally:
        shutdown()


def convert(hf_dir: str | Path, megatron_dir: str | Path, tp: int, pp: int, force: bool = False) -> Path:
    """The whole conversion; returns the checkpoint root."""
    from megatron_ext.convert.cpu_ranks import run_on_cpu_ranks

    request = check_conversion(hf_dir, tp, pp)
    out = check_output_dir(megatron_dir, force, "--megatron-dir")
    if out == request.hf_dir or out in request.hf_dir.parents:
        raise UserError(f"--megatron-dir {out} would replace the input --hf-dir {request.hf_dir}; choose another directory")
    log.info("converting %s (%s) to Megatron TP%d x PP%d in %s", request.hf_dir, request.dtype, tp, pp, out)
    with atomic_output_dir(out) as tmp:
        problems = run_on_cpu_ranks(_rank_entry, tp * pp, request, tmp)
        if problems:
            raise UserError(f"--hf-dir {request.hf_dir} does not match the model its config.json describes: "
                            + "; ".join(problems))
    return out
