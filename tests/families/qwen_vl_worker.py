"""Worker for test_qwen2_5_vl and test_qwen3_vl (4 ranks): a tiny Qwen-VL model through the
converters at TP/PP 1 and 2.

Usage: qwen_vl_worker.py OUT HF_DIR SUPPORT_MODULE (its `samples()`: tests.support.qwen2_5_vl, ...)

- OUT/megatron/tpTppP: HF_DIR converted by the converter's own per-rank code at each layout (the
  megatron parallel state rebuilt over the same 4 processes; smaller layouts get data-parallel
  replicas);
- OUT/logits/SAMPLE-tpTppP.pt: each checkpoint loaded at its own layout, and the TP2 x PP2 one at
  TP1 (SAMPLE-tp2pp2-at-tp1pp1.pt), its full-vocabulary logits on each sample;
- OUT/vision.json: at each layout, per rank, whether each vision block's qkv weight and bias are
  the HF tensors whole ("qkv"), and whether every tower parameter is marked for gradient averaging
  over TP ("averaged"; a rank without the tower: None);
- OUT/hf/tpTppP: every checkpoint back to HF (export_worker.py).
"""

import importlib
import json
import sys
from pathlib import Path

import torch

from tests.convert.export_worker import export_all
from tests.support.helpers import hf_tensors

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def set_layout(tp, pp):
    from megatron.core import parallel_state

    from megatron_ext.distributed import init_parallel

    parallel_state.destroy_model_parallel()
    init_parallel(tp, pp)


def convert(out, hf_dir, tp, pp):
    import torch.distributed as dist

    from megatron_ext.convert.to_megatron import check_conversion, convert_in_world

    root = out / "megatron" / f"tp{tp}pp{pp}"
    if dist.get_rank() == 0:
        root.mkdir(parents=True)
    dist.barrier()
    assert not convert_in_world(check_conversion(hf_dir, tp, pp), root)
    return root


def loaded(root):
    from megatron_ext import families
    from megatron_ext.checkpoint.layout import find_snapshot
    from megatron_ext.checkpoint.model_io import load_model_weights
    from megatron_ext.model.provider import ModelOptions

    snapshot = find_snapshot(root)
    model = families.build_model(snapshot.arch, ModelOptions(seq_length=512, init_weights=False, parallel_output=False))
    load_model_weights(model, snapshot.path)
    return model.eval(), snapshot.arch


def logits(model, sample, vocab_size):
    """Full-vocabulary logits [1, S, V] of one sample, on every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    media = {k: v for k, v in sample.items() if k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}

    def forward_step(data_iterator, module):
        batch = next(data_iterator)
        return module(batch["input_ids"], batch["position_ids"], **media), None

    ids = sample["input_ids"]
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([sample]), model=[model], num_microbatches=1,
            seq_length=ids.shape[1], micro_batch_size=1, forward_only=True)
    out = outputs[0][..., :vocab_size].float().contiguous() if parallel_state.is_pipeline_last_stage() else \
        torch.empty(1, ids.shape[1], vocab_size)
    dist.broadcast(out, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())
    return out


def save_logits(out, model, arch, name, samples):
    import torch.distributed as dist

    for sample_name, sample in samples.items():
        result = logits(model, sample, arch.text.vocab_size)
        if dist.get_rank() == 0:
            torch.save(result, out / "logits" / f"{sample_name}-{name}.pt")


def vision_qkv_whole(model, hf, arch) -> list[bool]:
    """Per block, whether this rank holds HF's qkv weight and bias exactly (first stage; else [])."""
    from megatron_ext import families

    if model.vision_model is None:
        return []
    visual = families.of(arch).visual_prefix
    return [torch.equal(block.attn.qkv.weight, hf[f"{visual}blocks.{i}.attn.qkv.weight"])
            and torch.equal(block.attn.qkv.bias, hf[f"{visual}blocks.{i}.attn.qkv.bias"])
            for i, block in enumerate(model.vision_model.blocks)]


def vision_grads_averaged(model) -> bool | None:
    if model.vision_model is None:
        return None
    return all(p.average_gradients_across_tp_domain for p in model.vision_model.parameters())


def gathered(value) -> list:
    import torch.distributed as dist

    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, value)
    return per_rank


def main():
    import torch.distributed as dist

    from megatron_ext.distributed import shutdown

    out, hf_dir = Path(sys.argv[1]), Path(sys.argv[2])
    samples = importlib.import_module(sys.argv[3]).samples()
    (out / "logits").mkdir(parents=True, exist_ok=True)
    hf = hf_tensors(hf_dir)
    vision = {"qkv": {}, "averaged": {}}
    for tp, pp in LAYOUTS:
        set_layout(tp, pp)
        model, arch = loaded(convert(out, hf_dir, tp, pp))
        save_logits(out, model, arch, f"tp{tp}pp{pp}", samples)
        vision["qkv"][f"tp{tp}pp{pp}"] = gathered(vision_qkv_whole(model, hf, arch))
        vision["averaged"][f"tp{tp}pp{pp}"] = gathered(vision_grads_averaged(model))
    set_layout(1, 1)
    model, arch = loaded(out / "megatron" / "tp2pp2")
    save_logits(out, model, arch, "tp2pp2-at-tp1pp1", samples)
    if dist.get_rank() == 0:
        (out / "vision.json").write_text(json.dumps(vision))
    export_all(out)
    shutdown()


if __name__ == "__main__":
    main()
