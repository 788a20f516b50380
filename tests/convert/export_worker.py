"""Export every Megatron checkpoint under OUT/megatron back to HF, shared out over the ranks of the
worker that converted them (convert_worker.py, tiled_worker.py): no process launch of its own.

Each rank runs the converter's own `to_hf.convert` (which uses no process group) for its share of the
checkpoint roots OUT/megatron/NAME/LAYOUT and OUT/megatron/trained, writing OUT/hf/<same path>. Rank 0
also tries a copy of one checkpoint without hf_extra.safetensors and records the refusal in
OUT/hf/refusals.json.
"""

import json
import shutil
from pathlib import Path


def export_all(out: Path) -> None:
    """Collective: every rank calls it once the checkpoints are written."""
    import torch.distributed as dist

    from megatron_ext.checkpoint import layout
    from megatron_ext.convert import to_hf
    from megatron_ext.errors import UserError

    dist.barrier()
    rank, world = dist.get_rank(), dist.get_world_size()
    roots = sorted(p.parent for p in (out / "megatron").rglob(layout.LATEST_FILE))
    for root in roots[rank::world]:
        to_hf.convert(root, out / "hf" / root.relative_to(out / "megatron"))
    if rank == 0:
        no_extra = out / "no_extra"
        shutil.copytree(roots[0], no_extra)
        (no_extra / layout.HF_EXTRA_FILE).unlink()
        refusals = {}
        try:
            to_hf.convert(no_extra, out / "hf_no_extra")
        except UserError as exc:
            refusals["no_extra"] = str(exc)
        (out / "hf").mkdir(exist_ok=True)
        (out / "hf" / "refusals.json").write_text(json.dumps(refusals))
    dist.barrier()
