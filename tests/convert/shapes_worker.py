"""Worker for test_published_shapes (under torchrun): every model at every layout
it takes, converted by the converter's own per-rank code, its logits, and the way back.

Usage: shapes_worker.py OUT IN.json

IN.json: {name: {"hf_dir": HF directory, "layouts": [[tp, pp], ...], "export": [[tp, pp], ...]}}. For every
layout the megatron
parallel state is rebuilt over the same processes (smaller layouts get data-parallel replicas)
and each model taking it is converted to OUT/megatron/NAME/tpTppP, loaded at that layout, and
its logits on the model's own prompt (one image; a OneVision or NeXT image on a grid of several
tiles; a Qwen-VL's given as OUT/inputs/NAME.pt, `tests.shapes.qwen_vl_sample`) saved to
OUT/logits/NAME-tpTppP.pt (the inputs to OUT/logits/NAME-inputs.pt).
Then the checkpoints of the "export" layouts go back to HF, OUT/hf/NAME/tpTppP, shared out over the ranks.
"""

import json
import os
import sys
from pathlib import Path

import torch
from convert_worker import set_layout

from tests.families.qwen_vl_worker import loaded
from tests.families.qwen_vl_worker import logits as qwen_vl_logits

# Wider than tall: a LLaVA-NeXT / OneVision model tiles it on a grid of two tiles and unpads it.
IMAGE_SIZE = (500, 300)


def main():
    import torch.distributed as dist

    from megatron_ext import families
    from megatron_ext.checkpoint.layout import find_snapshot
    from megatron_ext.checkpoint.model_io import load_model_weights
    from megatron_ext.convert import to_hf
    from megatron_ext.convert.compare import megatron_logits, megatron_media, process_inputs, synthetic_image
    from megatron_ext.convert.to_megatron import check_conversion, convert_in_world
    from megatron_ext.distributed import shutdown
    from megatron_ext.hf.processors import load_processor
    from megatron_ext.model.provider import ModelOptions, build_model

    out = Path(sys.argv[1])
    models = json.loads(Path(sys.argv[2]).read_text())
    (out / "logits").mkdir(parents=True, exist_ok=True)
    given = {path.stem: torch.load(path) for path in (out / "inputs").glob("*.pt")}
    batches = {name: given.get(name) or process_inputs(load_processor(m["hf_dir"], "--hf-dir"),
                                                       [synthetic_image(0, IMAGE_SIZE)])
               for name, m in models.items()}
    world = int(os.environ["WORLD_SIZE"])
    layouts = sorted({tuple(layout) for m in models.values() for layout in m["layouts"] if layout[0] * layout[1] == world},
                     key=lambda layout: (layout[1], layout[0]))
    for tp, pp in layouts:
        set_layout(tp, pp)
        for name, m in models.items():
            if [tp, pp] not in m["layouts"]:
                continue
            root = out / "megatron" / name / f"tp{tp}pp{pp}"
            if dist.get_rank() == 0:
                root.mkdir(parents=True)
            dist.barrier()
            problems = convert_in_world(check_conversion(m["hf_dir"], tp, pp), root)
            assert not problems, (name, tp, pp, problems)
            if name in given:  # a Qwen-VL: its prompt carries its own positions and media
                model, arch = loaded(root)
                logits = qwen_vl_logits(model, batches[name], arch.text.vocab_size)
                if dist.get_rank() == 0:
                    torch.save(logits, out / "logits" / f"{name}-tp{tp}pp{pp}.pt")
                continue
            snapshot = find_snapshot(root)
            arch, batch = snapshot.arch, batches[name]
            model = build_model(arch, families.of(arch), ModelOptions(seq_length=batch["input_ids"].shape[1],
                                                                      init_weights=False, parallel_output=False))
            load_model_weights(model, snapshot.path)
            images, layout = megatron_media(arch, batch)
            logits = megatron_logits(model, images, batch["input_ids"], arch.img_seq_len, arch.text.vocab_size, layout)
            if dist.get_rank() == 0:
                torch.save(logits, out / "logits" / f"{name}-tp{tp}pp{pp}.pt")
    if dist.get_rank() == 0:
        for name, batch in batches.items():
            torch.save(dict(batch), out / "logits" / f"{name}-inputs.pt")
    exports = [f"{name}/tp{tp}pp{pp}" for name, m in models.items() for tp, pp in m["export"] if tp * pp == world]
    for root in exports[dist.get_rank()::world]:
        to_hf.convert(out / "megatron" / root, out / "hf" / root)
    dist.barrier()
    shutdown()


if __name__ == "__main__":
    main()
