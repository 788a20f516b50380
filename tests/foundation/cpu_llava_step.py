"""Worker for test_cpu_support: real megatron-core LLaVA training steps on CPU (run under torchrun).

Usage: cpu_llava_step.py HF_LLAVA_DIR TP PP OUT_JSON
"""

import json
import sys

import torch


def main():
    hf_dir, tp, pp, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    from megatron_ext import cpu_support
    from megatron_ext.distributed import init_parallel, shutdown
    from megatron_ext.model.arch import LlavaArch
    from megatron_ext.model.provider import ModelOptions, build_model

    init_parallel(tp, pp, seed=7)
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    arch = LlavaArch.from_hf_config(json.load(open(f"{hf_dir}/config.json")))
    seq = 48
    model = build_model(arch, ModelOptions(seq_length=seq))
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, clip_grad=1.0), [ddp])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    gen = torch.Generator().manual_seed(0)

    def micro_batch():
        ids = torch.randint(10, arch.text.vocab_size - 10, (2, seq - arch.img_seq_len + 1), generator=gen)
        ids[:, 2] = arch.image_token_index
        return dict(images=torch.rand(2, 3, 56, 56, generator=gen), input_ids=ids, position_ids=None,
                    attention_mask=None, labels=torch.roll(ids, -1, 1), loss_mask=torch.ones(ids.shape))

    def forward_step(data, module):
        output, loss_mask = module(**next(data))

        def loss_func(per_token):
            loss = (per_token.float() * loss_mask).sum() / loss_mask.sum()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    losses, grad_norms = [], []
    for _ in range(2):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        result = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([micro_batch(), micro_batch()]),
                                             model=[ddp], num_microbatches=2, seq_length=seq, micro_batch_size=2,
                                             forward_only=False)
        _, grad_norm, _ = optimizer.step()
        grad_norms.append(float(grad_norm))
        if parallel_state.is_pipeline_last_stage():
            losses.append([float(r["loss"]) for r in result])
    changed = sum(not torch.equal(before[n], p) for n, p in model.named_parameters())
    if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        json.dump({"losses": losses, "grad_norms": grad_norms, "changed": changed, "params": len(before),
                   "cpu_mode": cpu_support.cpu_mode_active()}, open(out, "w"))
    shutdown()


if __name__ == "__main__":
    main()
