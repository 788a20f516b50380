"""Worker for test_roundtrip (run under torchrun with 4 processes): one launch, many layouts.

Usage: convert_worker.py OUT NAME=HF_DIR [NAME=HF_DIR ...]

The first HF checkpoint is converted at every layout in LAYOUTS, the others at TP2 x PP2 (which
splits both ways; the layouts differ only in the split, not per model): the megatron parallel state
is rebuilt over the same 4 processes (layouts smaller than 4 ranks get data-parallel replicas, which
the converter must tolerate) and the converter's own per-rank code writes OUT/megatron/NAME/tpTppP. Then:
- logits: each checkpoint converted at TP2 x PP2 is loaded at TP1 and at TP2 x PP2 (the first at
  every layout) and its logits saved to OUT/logits/NAME-tpTppP.pt (with the HF processor inputs in
  OUT/logits/NAME-inputs.pt);
- trained: the first checkpoint converted at TP1 is loaded at TP2, changed the way training would
  change it, and saved as a trainer snapshot (optimizer-like keys, iteration 5) in OUT/megatron/trained;
- export: every checkpoint under OUT/megatron back to HF, OUT/hf/... (export_worker.py), shared out over the ranks.
"""

import shutil
import sys
from pathlib import Path

import torch
from export_worker import export_all

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
TRAINED_ITERATION = 5


def set_layout(tp, pp):
    from megatron.core import parallel_state

    from megatron_ext.distributed import init_parallel

    parallel_state.destroy_model_parallel()
    init_parallel(tp, pp)


def first_at_every_layout(fixtures) -> dict:
    """{name: its layouts}: the first checkpoint at every layout, the others at TP2 x PP2."""
    return {name: LAYOUTS if i == 0 else [(2, 2)] for i, name in enumerate(fixtures)}


def convert_all(out, fixtures, layouts):
    """Each checkpoint of `fixtures` at each of its `layouts` ({name: [(tp, pp), ...]})."""
    import torch.distributed as dist

    from megatron_ext.convert.to_megatron import check_conversion, convert_in_world

    for tp, pp in LAYOUTS:
        set_layout(tp, pp)
        for name, hf_dir in fixtures.items():
            if (tp, pp) not in layouts[name]:
                continue
            root = out / "megatron" / name / f"tp{tp}pp{pp}"
            if dist.get_rank() == 0:
                root.mkdir(parents=True)
            dist.barrier()
            problems = convert_in_world(check_conversion(hf_dir, tp, pp), root)
            assert not problems, problems


def save_logits(out, fixtures, layouts):
    import torch.distributed as dist

    from megatron_ext import families
    from megatron_ext.checkpoint.layout import find_snapshot
    from megatron_ext.checkpoint.model_io import load_model_weights
    from megatron_ext.convert.compare import megatron_logits, process_inputs, synthetic_image
    from megatron_ext.hf_loading import load_processor
    from megatron_ext.model.provider import ModelOptions, build_model

    (out / "logits").mkdir(exist_ok=True)
    # A two-image prompt: both images expanded and attended in order.
    images = [synthetic_image(0), synthetic_image(1, (40, 90))]
    batches = {name: process_inputs(load_processor(str(hf), "--hf-dir"), images) for name, hf in fixtures.items()}
    if dist.get_rank() == 0:
        for name, batch in batches.items():
            torch.save(dict(batch), out / "logits" / f"{name}-inputs.pt")
    for tp, pp in LAYOUTS:
        set_layout(tp, pp)
        for name, batch in batches.items():
            if (tp, pp) not in {(1, 1), *layouts[name]}:
                continue
            snapshot = find_snapshot(out / "megatron" / name / "tp2pp2")
            arch = snapshot.arch
            model = build_model(arch, families.of(arch), ModelOptions(seq_length=256, init_weights=False, parallel_output=False))
            load_model_weights(model, snapshot.path)
            logits = megatron_logits(model, batch["pixel_values"], batch["input_ids"], arch.img_seq_len, arch.text.vocab_size)
            if dist.get_rank() == 0:
                torch.save(logits, out / "logits" / f"{name}-tp{tp}pp{pp}.pt")


def save_trained(out, name):
    """What the trainer leaves behind: a TP2 snapshot with changed weights and extra (optimizer) keys."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_ext import families
    from megatron_ext.checkpoint import layout
    from megatron_ext.checkpoint.model_io import load_model_weights, save_model_weights
    from megatron_ext.model.provider import ModelOptions, build_model

    set_layout(2, 1)
    converted = layout.find_snapshot(out / "megatron" / name / "tp1pp1")
    model = build_model(converted.arch, families.of(converted.arch), ModelOptions(init_weights=False, dtype=converted.dtype))
    load_model_weights(model, converted.path)
    with torch.no_grad():
        model.language_model.decoder.final_layernorm.weight.add_(1.0)
    root = out / "megatron" / "trained"
    snapshot = root / layout.snapshot_name(TRAINED_ITERATION)
    optimizer = {"exp_avg": ShardedTensor.from_rank_offsets("optimizer.exp_avg", torch.ones(8), replica_id=dist.get_rank())}
    save_model_weights(model, snapshot, extra={"optimizer": optimizer, "iteration": TRAINED_ITERATION})
    if dist.get_rank() == 0:
        (snapshot / layout.TRAIN_STATE_DIR).mkdir()
        shutil.copytree(converted.tokenizer_dir, root / layout.TOKENIZER_DIR)
        shutil.copy(converted.hf_extra_file, root / layout.HF_EXTRA_FILE)
        layout.write_metadata(snapshot, kind="trained", iteration=TRAINED_ITERATION, hf_config=converted.hf_config,
                              tp=2, pp=1, dtype=converted.dtype, has_optimizer=True)
        layout.mark_latest(root, TRAINED_ITERATION)
    dist.barrier()


def main():
    from megatron_ext.distributed import shutdown

    out = Path(sys.argv[1])
    fixtures = dict(arg.split("=", 1) for arg in sys.argv[2:])
    layouts = first_at_every_layout(fixtures)
    convert_all(out, fixtures, layouts)
    save_logits(out, fixtures, layouts)
    save_trained(out, next(iter(fixtures)))
    export_all(out)
    shutdown()


if __name__ == "__main__":
    main()
