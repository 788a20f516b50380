"""Worker for test_lora: LoRA training steps on fixed batches in any layout, and what they changed.

Usage: torchrun --nproc-per-node N lora_worker.py CHECKPOINT DATA OUT_DIR OPTIONS_JSON ITERS

The trainer's plan, model (adapters added), optimizer and step run on tests/support/fixed_samples.py's samples:
step i takes global batch i % 3, so a few dozen steps revisit each batch. Every rank writes
OUT_DIR/rank<R>.json: the losses and gradient norms, its parameters that require gradients, those
whose values changed, and the optimizer's parameter count.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a script: the repository root for tests.support
from tests.support.fixed_samples import GLOBAL_BATCH, SEQ, samples  # noqa: E402

BATCHES = 3


def main():
    checkpoint, data, out_dir, options, iters = sys.argv[1], sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5])
    import torch
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

    config = TrainConfig(megatron_load_dir=checkpoint, data_path=data, stage=2, lr=1e-3, seq_length=SEQ,
                         global_batch_size=GLOBAL_BATCH, train_iters=iters, num_workers=0, micro_batch_size=2,
                         lr_decay_style="constant", lr_warmup_fraction=0.0, **options)
    plan = make_plan(config, int(os.environ["WORLD_SIZE"]), on_gpu=False)
    cfg = plan.config
    init_parallel(cfg.tp, cfg.pp, seed=cfg.seed, cp=cfg.cp)
    trained = build_training_model(plan)
    checkpointing.load_weights(trained, plan.start, with_optimizer=False)
    before = {name: p.detach().clone() for name, p in trained.model.named_parameters()}
    forward_step = make_forward_step(ModelInputs.for_model(plan.arch, trained.model, device()))
    encoder = LlavaTaskEncoder.for_model(str(plan.tokenizer_dir), plan.arch, seq_length=plan.seq_length,
                                         alignment=plan.execution.alignment)
    encoded = [encoder.postencode_sample(encoder.preencode_sample(s)) for s in samples(BATCHES * GLOBAL_BATCH)]
    rank, replicas = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    steps = []
    for it in range(iters):
        batch = it % BATCHES
        mine = encoded[batch * GLOBAL_BATCH:(batch + 1) * GLOBAL_BATCH][rank::replicas]
        rows = [mine[i:i + cfg.micro_batch_size] for i in range(0, len(mine), cfg.micro_batch_size)]
        result = train_step(trained, forward_step, [encoder.batch(row).as_dict() for row in rows], plan.seq_length,
                            cfg.micro_batch_size)
        steps.append({"loss": result.loss, "grad_norm": float(result.grad_norm)})
    params = dict(trained.model.named_parameters())
    report = {
        "steps": steps,
        "trainable": sorted(name for name, p in params.items() if p.requires_grad),
        "changed": sorted(name for name, p in params.items() if not torch.equal(p.detach(), before[name])),
        "optimized": sum(p.numel() for group in trained.optimizer.param_groups for p in group["params"]),
        "trainable_numel": sum(p.numel() for p in params.values() if p.requires_grad),
    }
    (out_dir / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(report))
    shutdown()


if __name__ == "__main__":
    main()
