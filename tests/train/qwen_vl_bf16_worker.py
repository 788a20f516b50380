"""Worker for test_qwen_vl_execution (1 rank): a converted tiny Qwen-VL built in bfloat16 as the trainer
builds it (`families.build_model`, then megatron-core's Float16Module), its tower run on each sample's
media beside transformers' tower loaded with `from_pretrained(dtype=torch.bfloat16)`.

Usage: qwen_vl_bf16_worker.py OUT HF_DIR MEGATRON_DIR SUPPORT_MODULE (its `samples()`)

Writes OUT/tower.json: per sample, whether the merged features (and each DeepStack feature) equal
transformers' bit for bit, and their largest difference; the dtype of every tower buffer.
"""

import importlib
import json
import sys
from pathlib import Path

import torch

MEDIA = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))


def ours(megatron_dir: Path):
    from megatron.core.transformer.module import Float16Module

    from megatron_ext import families
    from megatron_ext.checkpoint.layout import find_snapshot
    from megatron_ext.checkpoint.model_io import load_model_weights
    from megatron_ext.model.provider import ModelOptions

    snapshot = find_snapshot(megatron_dir)
    model = families.build_model(snapshot.arch, ModelOptions(seq_length=512, dtype="bfloat16", init_weights=False))
    load_model_weights(model, snapshot.path)
    Float16Module(model.config, model)  # casts the model as the trainer's wrapper does
    return model.vision_model.eval()


def features(tower, pixels, grid) -> list[torch.Tensor]:
    with torch.no_grad():
        out = tower(pixels, grid_thw=grid)
    return [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]


def main():
    from transformers import AutoModelForImageTextToText

    from megatron_ext.distributed import init_parallel, shutdown

    out, hf_dir, megatron_dir = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    samples = importlib.import_module(sys.argv[4]).samples()
    init_parallel(1, 1)
    tower = ours(megatron_dir)
    reference = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.bfloat16).model.visual.eval()
    result = {"buffers": {name: str(b.dtype) for name, b in tower.named_buffers()}, "samples": {}}
    for name, sample in samples.items():
        for pixels, grid in MEDIA:
            if pixels in sample:
                mine = features(tower, sample[pixels].bfloat16(), sample[grid])
                theirs = features(reference, sample[pixels], sample[grid])
                result["samples"][f"{name} {pixels}"] = {
                    "equal": [torch.equal(a, b) for a, b in zip(mine, theirs)],
                    "max_diff": [float((a.float() - b.float()).abs().max()) for a, b in zip(mine, theirs)],
                    "dtype": str(mine[0].dtype)}
    (out / "tower.json").write_text(json.dumps(result, indent=1))
    shutdown()


if __name__ == "__main__":
    main()
