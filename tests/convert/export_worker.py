"""Worker for test_roundtrip: export every Megatron checkpoint under OUT/megatron back to HF.

Usage: export_worker.py OUT

One process running the converter's own `to_hf.convert` (GPUs hidden, a world of 1) for each
checkpoint root OUT/megatron/NAME/LAYOUT and OUT/megatron/trained, writing OUT/hf/<same path>.
Also tries a copy of one checkpoint without hf_extra.safetensors and records the refusal in
OUT/hf/refusals.json.
"""

import json
import shutil
import sys
from pathlib import Path


def main():
    from megatron_ext.checkpoint import layout
    from megatron_ext.convert import to_hf
    from megatron_ext.errors import UserError

    out = Path(sys.argv[1])
    roots = sorted(p.parent for p in (out / "megatron").rglob(layout.LATEST_FILE))
    for root in roots:
        to_hf.convert(root, out / "hf" / root.relative_to(out / "megatron"))

    no_extra = out / "no_extra"
    shutil.copytree(roots[0], no_extra)
    (no_extra / layout.HF_EXTRA_FILE).unlink()
    refusals = {}
    try:
        to_hf.convert(no_extra, out / "hf_no_extra")
    except UserError as exc:
        refusals["no_extra"] = str(exc)
    (out / "hf" / "refusals.json").write_text(json.dumps(refusals))


if __name__ == "__main__":
    main()
