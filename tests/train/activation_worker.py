"""Worker for test_memory_plan: what each rank's real forward keeps for backward at TP > 1.

Usage: torchrun --nproc-per-node TP activation_worker.py LLAVA_CONFIG_JSON CASES_JSON OUT_DIR

CASES_JSON: a list of [options, seq, images], options the TrainConfig (--tp TP) of a run of the LLaVA
config planned with Transformer Engine (as test_memory_plan plans it). Its layers run here as the sdpa
layers the plan measures them as (no TE on a CPU). Every rank writes OUT_DIR/rank<R>.json: the
(vision, LM) bytes of each case, in order.
"""

import json
import os
import sys
from pathlib import Path
from unittest import mock

from saved_parts import saved_in_forward


def sdpa_model(plan):
    """The trainer's model of `plan` with sdpa layers. megatron-core builds sequence parallelism only
    with TE's core attention and norms; the sdpa attention and torch's norms compute the same under it
    (per token; megatron sums the norms' weight gradients over TP, which no forward sees)."""
    import copy
    import dataclasses

    from megatron.core.models.multimodal import llava_model
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_ext.model.attention import SDPAttention
    from megatron_ext.train.model_setup import trained_model

    execution = dataclasses.replace(plan.execution, model=dataclasses.replace(plan.execution.model,
                                                                              attention_backend="sdpa"))
    torch_norm = WrappedTorchNorm.__new__

    def norm(cls, config, *args, **kwargs):
        config = copy.copy(config)
        config.sequence_parallel = False
        return torch_norm(cls, config, *args, **kwargs)

    with mock.patch.object(llava_model, "TEDotProductAttention", SDPAttention, create=True), \
            mock.patch.object(llava_model, "HAVE_TE", True), mock.patch.object(WrappedTorchNorm, "__new__", norm):
        return trained_model(dataclasses.replace(plan, execution=execution))


def main():
    hf_config, cases, out_dir = json.loads(Path(sys.argv[1]).read_text()), json.loads(sys.argv[2]), Path(sys.argv[3])
    import torch

    from megatron_ext.config.options import TrainConfig
    from megatron_ext.distributed import init_parallel, shutdown
    from megatron_ext.memory.plan import published_shape_plan

    world = int(os.environ["WORLD_SIZE"])
    init_parallel(tp=world)
    measured = []
    for options, seq, images in cases:
        plan = published_shape_plan(hf_config, TrainConfig(**options), world_size=world, te=True, on_gpu=False)
        measured.append(saved_in_forward(sdpa_model(plan), plan.arch, seq, images))
    (out_dir / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(measured))
    shutdown()


if __name__ == "__main__":
    main()
