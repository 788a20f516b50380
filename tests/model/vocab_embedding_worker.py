"""Worker for test_vocab_embedding (2 ranks = TP2): megatron-core's VocabParallelEmbedding and
MaskedFillVocabParallelEmbedding on the same weights and tokens of both vocabulary shards; prints
"equal" when outputs (and weight gradients, without sequence parallelism) are bit-equal."""

import torch


def outputs(embedding, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The embedding's output and, without sequence parallelism, its weight's gradient: that one's
    backward gathers into a CUDA buffer, which cpu_support cannot redirect inside autograd's backward
    (the trainer runs sequence parallelism with TE, on GPUs only); it is megatron-core's own function."""
    embedding.weight.grad = None
    out = embedding(tokens)
    if embedding.reduce_scatter_embeddings:
        return out.detach(), None
    (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), embedding.weight.grad


def main() -> None:
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    from megatron_ext.distributed import init_parallel
    from megatron_ext.model.vocab_embedding import MaskedFillVocabParallelEmbedding

    init_parallel(tp=2)
    torch.manual_seed(0)  # the same tokens on both ranks, as tensor-parallel ranks get them
    tokens = torch.randint(0, 20, (3, 8))
    for sequence_parallel in (False, True):
        config = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel,
                                     use_cpu_initialization=True, params_dtype=torch.float32)
        theirs = VocabParallelEmbedding(20, 16, init_method=torch.nn.init.normal_, config=config,
                                        reduce_scatter_embeddings=sequence_parallel)
        ours = MaskedFillVocabParallelEmbedding(20, 16, init_method=torch.nn.init.normal_, config=config,
                                                reduce_scatter_embeddings=sequence_parallel)
        ours.load_state_dict(theirs.state_dict())
        (out, grad), (our_out, our_grad) = outputs(theirs, tokens), outputs(ours, tokens)
        assert torch.equal(out, our_out), sequence_parallel
        assert sequence_parallel or (grad.abs().sum() > 0 and torch.equal(grad, our_grad))
    print("equal")


if __name__ == "__main__":
    main()
