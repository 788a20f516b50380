"""Worker for test_parallel_losses: three training steps on the same global batches in any layout.

Usage: torchrun --nproc-per-node N invariance_worker.py CHECKPOINT DATA OUT_JSON OPTIONS_JSON

CHECKPOINT may be a tiled LLaVA (LLaVA-NeXT): its samples are then expanded and tiled.

The trainer's own plan, model, optimizer and step (megatron DDP, per-token loss) run on fixed
samples, so every layout sees the same global batch: data-parallel replica r takes samples r, r +
DP, ... of it, as micro batches of --micro-batch-size samples, or packed into sequences of
--packing-seq-length. Rank 0 writes each step's loss and gradient norm.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a script: the repository root for tests.support
from tests.support.fixed_samples import GLOBAL_BATCH, SEQ, samples  # noqa: E402

ITERS = 3


def main():
    checkpoint, data, out, options = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    from megatron.core import parallel_state

    from megatron_ext.config.options import TrainConfig
    from megatron_ext.config.run_plan import make_plan
    from megatron_ext.data.task_encoder import LlavaTaskEncoder
    from megatron_ext.distributed import device, init_parallel, shutdown
    from megatron_ext.model.forward_step import make_forward_step
    from megatron_ext.model.inputs import ModelInputs
    from megatron_ext.train import checkpointing
    from megatron_ext.train.model_setup import build_training_model
    from megatron_ext.train.step import train_step

    config = TrainConfig(megatron_load_dir=checkpoint, data_path=data, stage=2, lr=1e-3,
                         global_batch_size=GLOBAL_BATCH, train_iters=ITERS, num_workers=0, **{"seq_length": SEQ, **options})
    plan = make_plan(config, int(os.environ["WORLD_SIZE"]), on_gpu=False)
    cfg = plan.config
    init_parallel(cfg.tp, cfg.pp, seed=cfg.seed, cp=cfg.cp)
    trained = build_training_model(plan)
    checkpointing.load_weights(trained, plan.start, with_optimizer=False)
    forward_step = make_forward_step(ModelInputs.for_model(plan.arch, trained.model, device()))
    encoder = LlavaTaskEncoder.for_model(str(plan.tokenizer_dir), plan.arch, seq_length=plan.seq_length,
                                         packing_seq_length=cfg.packing_seq_length, alignment=plan.execution.alignment)
    encoded = [encoder.postencode_sample(encoder.preencode_sample(s)) for s in samples(ITERS * GLOBAL_BATCH)]
    rank, replicas = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    steps = []
    for it in range(ITERS):
        mine = encoded[it * GLOBAL_BATCH:(it + 1) * GLOBAL_BATCH][rank::replicas]
        if cfg.packing_seq_length:
            rows = [[encoder.pack_selected_samples(pack)] for pack in encoder.select_samples_to_pack(mine)]
        else:
            rows = [mine[i:i + cfg.micro_batch_size] for i in range(0, len(mine), cfg.micro_batch_size)]
        micro_batches = [encoder.batch(row).as_dict() for row in rows]
        result = train_step(trained, forward_step, micro_batches, plan.seq_length, cfg.micro_batch_size)
        steps.append({"loss": result.loss, "grad_norm": float(result.grad_norm), "tokens": result.loss_tokens,
                      "micro_batches": len(micro_batches)})
    if parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_tensor_model_parallel_rank() == 0 \
            and parallel_state.is_pipeline_first_stage():
        json.dump({"steps": steps, "execution": plan.execution.summary()}, open(out, "w"))
    shutdown()


if __name__ == "__main__":
    main()
