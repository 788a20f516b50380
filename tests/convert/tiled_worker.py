"""Worker for test_tiled_llava (run under torchrun with 4 processes): one launch, every layout it needs.

Usage: tiled_worker.py OUT NAME=HF_DIR [NAME=HF_DIR ...]

Converts the first HF checkpoint at every layout of convert_worker.LAYOUTS and the others at TP2 x PP2
to OUT/megatron/NAME/tpTppP (convert_worker.convert_all), then loads the one converted at TP2 x PP2 at
TP2 x PP2 (loading at other layouts is test_roundtrip's) and
saves the logits of every sample OUT/inputs/NAME/SAMPLE.pt (HF processor batches, written by the
test) to OUT/logits/NAME/SAMPLE-tpTppP.pt; then exports every checkpoint back to HF, OUT/hf/... (export_worker.py).
"""

import sys
from pathlib import Path

import torch
from convert_worker import convert_all, first_at_every_layout, set_layout
from export_worker import export_all

LOGIT_LAYOUTS = [(2, 2)]


def save_logits(out, names):
    import torch.distributed as dist

    from megatron_ext import families
    from megatron_ext.checkpoint.layout import find_snapshot
    from megatron_ext.checkpoint.model_io import load_model_weights
    from megatron_ext.convert.compare import megatron_logits, megatron_media
    from megatron_ext.model.provider import ModelOptions, build_model

    for tp, pp in LOGIT_LAYOUTS:
        set_layout(tp, pp)
        for name in names:
            snapshot = find_snapshot(out / "megatron" / name / "tp2pp2")
            arch = snapshot.arch
            model = build_model(arch, families.of(arch), ModelOptions(seq_length=256, init_weights=False, parallel_output=False))
            load_model_weights(model, snapshot.path)
            (out / "logits" / name).mkdir(parents=True, exist_ok=True)
            for path in sorted((out / "inputs" / name).glob("*.pt")):
                batch = torch.load(path)
                images, layout = megatron_media(arch, batch)
                logits = megatron_logits(model, images, batch["input_ids"], arch.img_seq_len, arch.text.vocab_size, layout)
                if dist.get_rank() == 0:
                    torch.save(logits, out / "logits" / name / f"{path.stem}-tp{tp}pp{pp}.pt")


def main():
    from megatron_ext.distributed import shutdown

    out = Path(sys.argv[1])
    fixtures = dict(arg.split("=", 1) for arg in sys.argv[2:])
    convert_all(out, fixtures, first_at_every_layout(fixtures))
    save_logits(out, list(fixtures))
    export_all(out)
    shutdown()


if __name__ == "__main__":
    main()
