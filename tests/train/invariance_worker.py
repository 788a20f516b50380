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

from PIL import Image

ITERS, GLOBAL_BATCH, SEQ = 3, 4, 192
WORDS = "red green blue cat dog bird tree house car boat sky field river hill cup chair".split()


def samples(count: int) -> list:
    """Sample i has two images when i % 4 == 1, none (text-only) when i % 4 == 3, else one: the last
    micro batch of a replica's step may hold no image, and the projector must still take part."""
    from megatron_ext.data.conversation import qa_messages
    from megatron_ext.data.shard_format import ConversationSample

    out = []
    for i in range(count):
        words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(3 + i % 5)]
        question = f"What is shown next to the {words[0]}?" if i % 2 else "Describe the picture."
        num_images = {1: 2, 3: 0}.get(i % 4, 1)
        images = [Image.new("RGB", (40 + 7 * i, 30 + 11 * (i % 4) + 5 * k), (20 * i % 255, 90 + 60 * k, 200 - 13 * i % 200))
                  for k in range(num_images)]
        messages = qa_messages("<image>\n" * num_images + question, " ".join(words).capitalize() + ".")
        out.append(ConversationSample(__key__=f"s{i}", __restore_key__=(), images=images, messages=messages))
    return out


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
