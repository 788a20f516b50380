"""Test double, imported by every Python process that has this directory on PYTHONPATH: in torchrun's
workers (the trainer's ranks), each rank clips its gradients by the norm of its own shard instead of
the global norm over every rank, the defect the parity check must catch at TP2."""

import os

if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun for its workers only, not for the launcher
    import torch.distributed as dist
    from megatron.core.optimizer import optimizer

    _global_norm = optimizer.get_grad_norm_fp32
    _own_groups = []

    def _own_rank_norm(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
        if not _own_groups:  # every rank creates every one-rank group, together (new_group is collective)
            _own_groups.extend(dist.new_group([r]) for r in range(dist.get_world_size()))
        return _global_norm(grads_for_norm, norm_type, _own_groups[dist.get_rank()])

    optimizer.get_grad_norm_fp32 = _own_rank_norm
