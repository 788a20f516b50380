"""Activation memory of one micro batch, measured from what autograd saves, never from a formula.

Each term is a forward on the meta device of a piece of the rank's real model (`saved_tensors.py`
counts what autograd keeps; no memory, no compute), frozen as in the run:
- a language-model layer at two short lengths, fitted to a*s + c*s^2 (linear terms and the S x S
  attention scores of megatron's local kernel) and evaluated at the run's --seq-length;
- the vision tower and the projector for one tile, as LLaVAModel runs them (stem, every layer, the
  class token dropped, the projector), times tiles; on the last stage the final norm, the logits and
  the loss.

Where GPU kernels keep other tensors than the CPU ones measured here:
- sdpa and te (flash attention): on meta, SDPA runs its math kernel, which saves the
  [b, heads, S, S] scores; flash saves only q, k, v, the output and a [b, heads, S] fp32
  log-sum-exp (the CPU's flash kernel too; the output projection reads its output as it is). So
  these backends are measured with megatron's selective recomputation of core attention (which
  saves exactly q, k, v) plus that log-sum-exp. The vision tower takes no recompute setting (it
  never recomputes in a run); its layers' core attention is checkpointed for the measurement alone.
- grouped-query attention: flash reads the grouped K/V heads as they are, as measured here; where
  no kernel takes them grouped (the CPU's; a GPU's in fp32 or with a mask), `model/attention.py`
  repeats them to every query head, and the repeated K/V are kept too.
- te: Transformer Engine's fused LayerNormLinear keeps the norm's output and its statistics
  instead of the norm's fp32 input (torch's RMSNorm here); its layers are measured as the sdpa
  layers they compute the same function as (TE does not build on meta).
- sequence parallelism: the tensors that TP replicates (the residual stream, norm inputs and
  outputs, the inputs of the column-parallel linears) are split over TP, as megatron-core saves
  them sequence-sharded and gathers them again in backward. The layer and the last stage's final
  norm, logits and loss are measured at TP and at TP 1 without it: with m(t) = R + S/t, the
  replicated part R = (t m(t) - m(1)) / (t - 1) is divided by t.
- packing: a pack is measured as one sequence of --seq-length tokens; flash over the packs'
  cu_seqlens saves the same per-token tensors (the local kernel's scores are then an upper bound).

tests/train/test_memory_plan.py checks the terms against the saved-tensor bytes of real CPU forwards
of the trainer's models, within 10% (in fact 0.5%, OneVision's 1.5% the repeated K/V above): a small
LLaVA-1.5 at two lengths and two image counts with sdpa without recomputation, with selective and
with full (the forward's saves plus the largest group that backward recomputes, measured in a real
backward: the peak `lm_layers_bytes` models; uniform in groups of one and of two layers, and block),
local without and with selective; each rank at TP2 with and without sequence parallelism; a tiled
OneVision with an anyres image, then with a video.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

from megatron_ext.memory.saved_tensors import saved_bytes

# Lengths the language-model layer is measured at: short (fast on meta even for the local
# kernel's S x S mask), two of them to separate the linear and the quadratic terms.
FIT_LENGTHS = (128, 256)


@dataclass(frozen=True)
class ActivationPieces:
    """One rank's activation pieces for a micro batch of one sequence (b = 1)."""

    layer_linear: float  # a: bytes per token of one LM layer
    layer_quadratic: float  # c: bytes per token^2 (S x S scores)
    layer_input: int  # per token: what full recomputation keeps of a layer (its input)
    lm_other: int  # the final norm, logits and loss (last stage) at the run's length
    vision_tile: int  # the tower and the projector for one tile (the tower's part is 0 when it is frozen)

    def layer(self, tokens: int) -> float:
        return self.layer_linear * tokens + self.layer_quadratic * tokens * tokens


def _meta(shape, dtype, grad: bool):
    import torch

    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def _layer_forward(model, tokens: int, input_grad: bool, checkpointed: bool = False):
    from megatron.core import tensor_parallel

    lm = model.language_model
    layer = lm.decoder.layers[0]
    x = _meta((tokens, 1, lm.config.hidden_size), lm.config.params_dtype, input_grad)
    rope = _rope(lm, tokens)

    def run(hidden):
        return layer(hidden, attention_mask=None, rotary_pos_emb=rope)[0]

    if checkpointed:  # megatron-core's own recomputation: it saves the checkpointed function's inputs
        return lambda: tensor_parallel.checkpoint(run, False, x)
    return lambda: run(x)


def _rope(lm, tokens: int):
    """The language model's RoPE angles for `tokens` positions (mRoPE's from [3, 1, tokens] positions)."""
    import torch

    if lm.position_embedding_type == "mrope":
        return lm.rotary_pos_emb(torch.zeros((3, 1, tokens), dtype=torch.long), lm.mrope_section).to("meta")
    return lm.rotary_pos_emb(tokens).to("meta")


def flash_lse(heads: int, tokens: int) -> int:
    """The fp32 log-sum-exp a flash kernel keeps per head and query."""
    return heads * tokens * 4


def _flash_lse(config, tokens: int) -> int:
    """`flash_lse` of this rank's heads (`config`: the TransformerConfig of the layer's model)."""
    from megatron.core import parallel_state

    return flash_lse(config.num_attention_heads // parallel_state.get_tensor_model_parallel_world_size(), tokens)


def _lm_other(model, tokens: int) -> int:
    """The final norm, the logits and the vocab-parallel cross-entropy of the last stage."""
    import torch

    lm = model.language_model
    if not lm.post_process:
        return 0
    hidden = _meta((tokens, 1, lm.config.hidden_size), lm.config.params_dtype, True)
    labels = torch.empty((1, tokens), dtype=torch.long, device="meta")
    weight = lm.shared_embedding_or_output_weight() if lm.share_embeddings_and_output_weights else None
    norm = lm.decoder.final_layernorm or (lambda h: h)

    def forward():
        logits, _ = lm.output_layer(norm(hidden), weight=weight)
        return lm.compute_language_model_loss(labels, logits)

    return saved_bytes(forward, model.parameters())


@contextlib.contextmanager
def _core_attention_checkpointed(layers):
    """megatron-core's selective recomputation switched on in `layers` for the block (a meta model's)."""
    attentions = [layer.self_attention for layer in layers]
    before = [a.checkpoint_core_attention for a in attentions]
    for a in attentions:
        a.checkpoint_core_attention = True
    try:
        yield
    finally:
        for a, was in zip(attentions, before):
            a.checkpoint_core_attention = was


def _vision(model, arch, seq_length: int, flash: bool, tower_trained: bool, native=None) -> int:
    """The tower and the projector for one tile, as megatron-core's LLaVAModel.forward runs them; pixels
    need no grad, so a frozen tower keeps nothing. `flash`: the tower's attention is a flash kernel.
    A native-resolution tower (`native`: the run's input settings): for one of the largest images a
    sequence holds (`native_vision_bytes`)."""
    import torch

    if model.vision_model is None:
        return 0
    if native is not None:
        from megatron_ext.memory.native_vision_bytes import image_bytes, largest_images

        return image_bytes(model.vision_model, largest_images(native, seq_length).grid, tower_trained)
    v = arch.vision
    tower = model.vision_model
    images = torch.empty((1, 3, v.image_size, v.image_size), dtype=tower.config.params_dtype, device="meta")
    layers = tower.decoder.layers

    def forward():
        features = tower(images)
        features = features[:, int(v.class_token and arch.drop_class_token):]
        return model.vision_projection(features.permute(1, 0, 2).contiguous())

    if not flash:
        return saved_bytes(forward, model.parameters())
    with _core_attention_checkpointed(layers):
        kept = saved_bytes(forward, model.parameters())
    patches = v.num_patches + int(v.class_token)
    return kept + (len(layers) * _flash_lse(tower.config, patches) if tower_trained else 0)


def measure(model, arch, seq_length: int, flash_lse: bool, vision_flash: bool, input_grad: bool,
            tower_trained: bool, native=None) -> ActivationPieces:
    """The pieces of this rank's model (meta, frozen as in the run, under its parallel state).
    `flash_lse`: the run's attention is a flash kernel that keeps its log-sum-exp (sdpa or te without
    selective recomputation; `model` is then built with it, see above); `vision_flash`: the tower's
    attention is (sdpa or te); `input_grad`: a gradient flows into the LM layers' input; `native`: a
    native-resolution model's input settings in the run (`run_plan.native_vision`)."""
    from megatron.core import tensor_parallel

    # megatron's local attention forks the model-parallel RNG stream (for dropout) even on meta,
    # where nothing is drawn: the stream must exist.
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    params = list(model.parameters())
    s1, s2 = FIT_LENGTHS
    lm_config = model.language_model.config
    m1, m2 = (saved_bytes(_layer_forward(model, s, input_grad), params) + (_flash_lse(lm_config, s) if flash_lse else 0)
              for s in (s1, s2))
    # m(s) = a s + c s^2 through both points.
    quadratic = (m2 / s2 - m1 / s1) / (s2 - s1)
    linear = m1 / s1 - quadratic * s1
    layer_input = saved_bytes(_layer_forward(model, s1, input_grad, checkpointed=True), params) / s1
    return ActivationPieces(layer_linear=linear, layer_quadratic=quadratic, layer_input=math.ceil(layer_input),
                    lm_other=_lm_other(model, seq_length),
                            vision_tile=_vision(model, arch, seq_length, vision_flash, tower_trained, native))


def with_sequence_parallel(at_tp: ActivationPieces, at_one: ActivationPieces, tp: int) -> ActivationPieces:
    """`at_tp` with the TP-replicated part of each layer and of the last stage's output split over TP
    (see the module's docstring); `at_one`: the last stage at TP 1."""

    def split(mt: float, m1: float) -> float:
        replicated = (tp * mt - m1) / (tp - 1)
        return mt - replicated + replicated / tp

    return ActivationPieces(layer_linear=split(at_tp.layer_linear, at_one.layer_linear),
                    layer_quadratic=split(at_tp.layer_quadratic, at_one.layer_quadratic),
                    layer_input=math.ceil(at_tp.layer_input / tp),
                    lm_other=math.ceil(split(at_tp.lm_other, at_one.lm_other)) if at_tp.lm_other else 0,
                    vision_tile=at_tp.vision_tile)


@dataclass(frozen=True)
class Recompute:
    granularity: str | None  # None | "selective" | "full"
    method: str = "uniform"
    num_layers: int = 1


def lm_layers_bytes(m: ActivationPieces, layers: int, tokens: int, recompute: Recompute) -> int:
    """The stage's `layers` LM layers for one micro batch of `tokens` (micro batch x seq length).
    Full recomputation keeps each group's input, plus one group's activations while it recomputes."""
    per_layer = m.layer(tokens)
    if recompute.granularity != "full":
        return math.ceil(layers * per_layer)
    n = min(recompute.num_layers, layers)
    inputs = m.layer_input * tokens
    if recompute.method == "uniform":
        return math.ceil(math.ceil(layers / n) * inputs + n * per_layer)
    return math.ceil(n * inputs + (layers - n) * per_layer + (per_layer if n else 0))
