"""What this rank's trainer holds once it has stepped, as the memory plan (memory/state_bytes.py)
predicts it: the trainer logs it and the tests compare the two."""

from __future__ import annotations


def held_state_bytes(trained) -> tuple[int, int, int]:
    """(parameter, gradient buffer, optimizer state) bytes this rank's trainer holds (`trained`: its
    TrainingModel, after a step: Adam makes its moments then), read from the tensors' storages so that
    views into megatron-core's buffers count once and padding counts. Adam's 0-dim step counters are
    left out."""
    import torch

    def storages(tensors) -> dict[int, int]:
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}

    params = storages(trained.model.parameters())
    grads = storages(b.grad_data for b in trained.ddp.buffers)
    optimizer: dict[int, int] = {}
    for chained in getattr(trained.optimizer, "chained_optimizers", [trained.optimizer]):
        for p, state in chained.optimizer.state.items():
            optimizer.update(storages(t for t in state.values() if torch.is_tensor(t) and t.numel() == p.numel()))
            if p.untyped_storage().data_ptr() not in params:  # an fp32 master copy of a 16-bit parameter
                optimizer.update(storages([p]))
    return sum(params.values()), sum(grads.values()), sum(optimizer.values())
