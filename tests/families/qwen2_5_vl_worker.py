"""Worker for test_qwen2_5_vl (4 ranks): our Qwen2.5-VL at TP/PP 1 and 2, its logits on each sample.

Usage: qwen2_5_vl_worker.py OUT HF_DIR

At each layout (layouts of fewer than 4 ranks get data-parallel replicas) the model is built for
every rank, filled from the HF tensors through the family's rows (each split by its TP rule), and
each sample's logits are saved to OUT/logits/SAMPLE-tpTppP.pt.
"""

import sys
from pathlib import Path

import torch

from tests.support.helpers import hf_tensors
from tests.support.qwen2_5_vl import samples

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def set_layout(tp, pp):
    from megatron.core import parallel_state

    from megatron_ext.distributed import init_parallel

    parallel_state.destroy_model_parallel()
    init_parallel(tp, pp)


def fill(model, rows, hf):
    """Each of this rank's tensors from the HF tensors, as its row's rule splits them."""
    from megatron.core import parallel_state

    from megatron_ext.checkpoint.keys import canonical_megatron_name

    table = {r.megatron: r for r in rows}
    offset = model.language_model.decoder.layers[0].layer_number - 1
    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith("_extra_state") or name.endswith("inv_freq"):
                continue
            r = table[canonical_megatron_name(name, offset)]
            tensor.copy_(r.rule.shard(r.rule.hf_to_megatron([hf[h] for h in r.hf]), rank, size))


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


def main():
    import torch.distributed as dist

    from megatron_ext import families
    from megatron_ext.distributed import shutdown
    from megatron_ext.hf_loading import load_config
    from megatron_ext.model.provider import ModelOptions

    out, hf_dir = Path(sys.argv[1]), Path(sys.argv[2])
    (out / "logits").mkdir(parents=True, exist_ok=True)
    config = load_config(str(hf_dir), "--hf-dir")
    family = families.vision_language_family(config.model_type)
    arch = family.read(config)
    hf = hf_tensors(hf_dir)
    batches = samples()
    for tp, pp in LAYOUTS:
        set_layout(tp, pp)
        model = family.build(arch, ModelOptions(seq_length=512, init_weights=False, parallel_output=False))
        fill(model, family.rows(arch), hf)
        model.eval()
        for name, sample in batches.items():
            result = logits(model, sample, arch.text.vocab_size)
            if dist.get_rank() == 0:
                torch.save(result, out / "logits" / f"{name}-tp{tp}pp{pp}.pt")
    shutdown()


if __name__ == "__main__":
    main()
