"""A vision-language model whose decoder is megatron-core's GPTModel with 3-D multimodal RoPE
(mRoPE) and whose image and video token embeddings are replaced by a vision encoder's features.

The encoder is any module taking (patch rows, grid_thw) and returning its merged features in token
order as `pooler_output` (transformers' Qwen2.5-VL or Qwen3-VL tower, held whole: every
tensor-parallel rank runs it on the same inputs, and its gradients are averaged over them). It lives
on the first pipeline stage, beside the embedding. Positions are `[3, B, S]` (T, H, W), as
`data/native_resolution.mrope_positions` gives them per sample; their angles are megatron-core's
chunked mRoPE or Qwen3-VL's interleaved one (`interleaved_mrope.py`).

DeepStack (Qwen3-VL): an encoder whose output also holds `deepstack_features` (one [tokens, hidden]
tensor per feature) has feature i added to the decoder's hidden states after decoder layer i, at
the same media tokens. Forward hooks on the first stage's decoder layers add them, so megatron-core's
decoder stays as it is.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from megatron_ext.model.arch import TextArch
from megatron_ext.model.family_hooks import TextHooks


class MRopeVisionLanguageModel(torch.nn.Module):
    def __init__(self, language_model, vision_model, projections: tuple[str, ...], image_token_id: int,
                 video_token_id: int):
        """`projections`: the names of the encoder's modules that map its features into the decoder's
        width (trained with the projector, as LLaVA's)."""
        super().__init__()
        # What megatron-core's schedules read off a model.
        self.config, self.model_type = language_model.config, language_model.model_type
        self.language_model = language_model
        self.vision_model = vision_model  # None off the first pipeline stage
        # The projections are part of the encoder here: nothing apart from it (the trainer's forward step
        # looks for a LLaVA's separate projector).
        self.vision_projection = None
        self.projections = projections
        self.image_token_id, self.video_token_id = image_token_id, video_token_id
        # (rows of the [S * B] hidden states, features [tokens, hidden]) per media kind, for each DeepStack
        # feature of the forward under way; read by the hooks on the first decoder layers.
        self._deepstack: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        if vision_model is not None:
            for index, layer in enumerate(language_model.decoder.layers):
                layer.register_forward_hook(self._deepstack_hook(index))

    # What megatron-core's finalize_model_grads asks of a pipeline stage's model (tied embeddings).
    @property
    def pre_process(self) -> bool:
        return self.language_model.pre_process

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.language_model.share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self):
        return self.language_model.shared_embedding_or_output_weight()

    @property
    def add_encoder(self) -> bool:
        """Whether the encoder runs on this rank (megatron-core's LLaVAModel's name for it)."""
        return self.vision_model is not None

    def freeze(self, freeze_language_model: bool, freeze_vision_model: bool, freeze_vision_projection: bool) -> None:
        """megatron-core's LLaVAModel.freeze: the projections follow their own flag, inside the encoder too."""
        encoder = self.vision_model
        projections = [getattr(encoder, name) for name in self.projections] if encoder is not None else []
        for module, frozen in ((self.language_model, freeze_language_model), (encoder, freeze_vision_model),
                               *((p, freeze_vision_projection) for p in projections)):
            if module is not None:
                module.requires_grad_(not frozen)

    def _apply(self, fn, recurse=True):
        """A cast or move (`.bfloat16()`: megatron-core's Float16Module) leaves the encoder's computed buffers
        (kept out of its state dict, e.g. its RoPE's float32 inv_freq) in their own dtype, moved only, as
        transformers' `from_pretrained(dtype=...)` makes them: angles from a bfloat16 inv_freq are wrong."""
        computed = [(module, name, module._buffers[name]) for module in self._encoder_modules()
                    for name in module._non_persistent_buffers_set if module._buffers.get(name) is not None]
        super()._apply(fn, recurse)
        for module, name, before in computed:
            module._buffers[name] = before.to(module._buffers[name].device)
        return self

    def _encoder_modules(self):
        return self.vision_model.modules() if self.vision_model is not None else ()

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import sharded_state_dict_default

        state = self.language_model.sharded_state_dict(f"{prefix}language_model.", sharded_offsets, metadata)
        if self.vision_model is not None:
            # A plain torch module: each of its tensors whole, replicated over the ranks that hold it.
            # Without the TP group megatron-core counts every tensor rank as the main copy.
            state.update(sharded_state_dict_default(self.vision_model, f"{prefix}vision_model.", sharded_offsets, metadata,
                                                    tp_group=parallel_state.get_tensor_model_parallel_group()))
        return state

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask=None,
                pixel_values=None, image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None, labels=None,
                loss_mask=None, packed_seq_params=None, image_rows=None, video_rows=None, image_order=None,
                video_order=None, image_tower_inputs=None, video_tower_inputs=None,
                runtime_gather_output: bool | None = None, inference_context=None):
        """Logits [B, S, V]; with `labels` and `loss_mask`, (loss [B, S], loss_mask) as megatron-core's
        LLaVAModel returns them. `input_ids` [B, S] with every image and video expanded to one token
        per merged patch, `position_ids` [3, B, S]; `packed_seq_params`: a one-row batch of packed
        samples (THD), its positions restarting at each sample. `image_rows` / `video_rows`: long
        [tokens], where the image (video) tokens lie in the [S * B] order of hidden states, sample by
        sample (`media_rows`; `mrope_inputs` finds them on the host, so the device never waits); None:
        found here. `image_order` / `video_order`: long [tokens], the encoder's output row each of those
        tokens shows (`feature_order`), where one image serves several sequences (a preference pair's);
        None: each is shown once, in order. `image_tower_inputs` / `video_tower_inputs`: what the encoder
        computes from its grid, computed on the host (`tower_inputs.py`); None: the encoder computes them.
        `runtime_gather_output`: GPTModel's (this call's logits gathered over TP, the model built with
        parallel output). `inference_context`: GPTModel's KV cache (`eval/mrope_generator.py`)."""
        embeddings = None
        self._deepstack = []
        if self.language_model.pre_process:
            embeddings = self.language_model.embedding(input_ids=input_ids, position_ids=None)
            for token, pixels, grid, rows, order, precomputed in (
                    (self.image_token_id, pixel_values, image_grid_thw, image_rows, image_order, image_tower_inputs),
                    (self.video_token_id, pixel_values_videos, video_grid_thw, video_rows, video_order,
                     video_tower_inputs)):
                if pixels is not None:
                    rows = media_rows(input_ids == token) if rows is None else rows
                    encoded = self.vision_model(pixels, grid_thw=grid, **(precomputed or {}))
                    features, deepstack = encoded.pooler_output, getattr(encoded, "deepstack_features", None) or []
                    if order is not None:
                        features, deepstack = features[order], [feature[order] for feature in deepstack]
                    embeddings = self._placed(embeddings, rows, features)
                    self._keep_deepstack(rows, deepstack)
        try:
            output = self.language_model(input_ids, position_ids, attention_mask, decoder_input=embeddings,
                                         labels=labels, packed_seq_params=packed_seq_params,
                                         runtime_gather_output=runtime_gather_output, inference_context=inference_context)
        finally:
            self._deepstack = []  # the features are this forward's only
        return output if loss_mask is None else (output, loss_mask)

    def _keep_deepstack(self, rows: torch.Tensor, features: list) -> None:
        layers = len(self.language_model.decoder.layers)
        if len(features) > layers:
            raise ValueError(f"the vision encoder gives {len(features)} DeepStack features but this first pipeline "
                             f"stage holds {layers} decoder layers; use a smaller pipeline-parallel size")
        self._deepstack += [[] for _ in range(len(features) - len(self._deepstack))]
        # Rows, not a boolean index inside a layer: its data-dependent shape would break the graph of a
        # layer compiled by --compile-layers.
        for index, feature in enumerate(features):
            self._deepstack[index].append((rows, feature))

    def _deepstack_hook(self, index: int):
        def add_features(layer, args, output):
            if index >= len(self._deepstack):
                return None
            hidden, context = output
            for rows, features in self._deepstack[index]:
                hidden = self._added(hidden, rows, features)
            return hidden, context

        return add_features

    @staticmethod
    def _placed(embeddings: torch.Tensor, rows: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """[S, B, H] embeddings with `rows` of their [S * B] flattening replaced by the encoder's
        `features` [tokens, H]."""
        if rows.shape[0] != features.shape[0]:
            raise ValueError(f"{rows.shape[0]} media tokens but {features.shape[0]} features: expand each "
                             "placeholder to its merged patch count (native_resolution.expand_placeholders)")
        return embeddings.flatten(0, 1).index_copy(0, rows, features.to(embeddings.dtype)).view_as(embeddings)

    @staticmethod
    def _added(hidden: torch.Tensor, rows: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """[S, B, H] hidden states with `features` added at `rows` of their [S * B] flattening."""
        return hidden.flatten(0, 1).index_add(0, rows, features.to(hidden.dtype)).view_as(hidden)


def media_rows(where: torch.Tensor) -> torch.Tensor:
    """The rows of a [B, S] mask's set positions in the [S * B] order of hidden states, sample by
    sample (the order the encoder's features come in)."""
    batch, position = where.nonzero(as_tuple=True)
    return position * where.shape[0] + batch


def feature_order(grid: torch.Tensor, uses: torch.Tensor, merge_size: int) -> torch.Tensor:
    """The encoder's output rows each use of an image shows, use by use: `grid` [images, 3] (T, H, W
    in patches), `uses` [uses] the image each run of media tokens shows; an image gives one row per
    `merge_size` x `merge_size` patches."""
    counts = grid.prod(-1) // merge_size**2
    starts, taken = counts.cumsum(0) - counts, counts[uses]
    # Each use's first row, repeated over its rows, plus the row's place within it.
    return torch.repeat_interleave(starts[uses] - (taken.cumsum(0) - taken), taken) + torch.arange(
        int(taken.sum()), device=grid.device)


def build(t: TextArch, family: TextHooks, vision: Callable[[], Any], projections: tuple[str, ...], image_token_id: int,
          video_token_id: int, opts, vp_stage: int | None = None,
          interleaved_mrope: bool = False, meta: bool = False,
          tower_inputs: Callable[[Any, torch.Tensor], dict] | None = None) -> MRopeVisionLanguageModel:
    """This rank's model under the current megatron parallel state: `family`'s language config
    must give `mrope_section`; `vision()` makes the encoder (called on the first stage only), whose
    modules `projections` map its features into the decoder's width; `interleaved_mrope`: the sections
    interleave over the channels (Qwen3-VL) instead of chunking; `meta`: every tensor on PyTorch's
    meta device (shapes only: `memory/meta_ranks.py`); `tower_inputs(encoder, grid)`: what the encoder
    computes from its grid, by keyword (`tower_inputs.py`)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.compat import without_te
    from megatron_ext.distributed import device
    from megatron_ext.model.build_errors import megatron_refusals
    from megatron_ext.model.interleaved_mrope import InterleavedMultimodalRotaryEmbedding
    from megatron_ext.model.padded_vocab import mask_padded_vocab
    from megatron_ext.model.provider import language_transformer_config, mark_tensor_parallel_weights
    from megatron_ext.model.specs import llava_specs
    from megatron_ext.model.vocab_embedding import use_masked_fill

    without_te.apply()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    backend = opts.resolved_backend()
    with torch.device("meta") if meta else contextlib.nullcontext():
        with megatron_refusals():
            config = language_transformer_config(t, family, opts, backend, tp, pp)
            language = GPTModel(
                config=config,
                transformer_layer_spec=family.language_spec(t, llava_specs(backend, config).language, config, backend, vp_stage),
                vocab_size=t.padded_vocab_size,
                max_sequence_length=opts.seq_length,
                pre_process=first,
                post_process=last,
                parallel_output=opts.parallel_output,
                share_embeddings_and_output_weights=t.tie_word_embeddings,
                position_embedding_type="mrope",
                rotary_base=t.rope_theta,
                vp_stage=vp_stage,
            )
        if interleaved_mrope:
            language.rotary_pos_emb = InterleavedMultimodalRotaryEmbedding(config.kv_channels, 1.0, rotary_base=t.rope_theta)
        if first:
            use_masked_fill(language)
        if last:
            mask_padded_vocab(language.output_layer, t.vocab_size, t.padded_vocab_size)
        model = MRopeVisionLanguageModel(language, _replicated(vision(), projections) if first else None, projections,
                                         image_token_id, video_token_id)
    model.attention_backend = backend  # how batches must express packing to it (`mrope_inputs`)
    model.tower_inputs = tower_inputs  # what `mrope_inputs` may compute on the host for the encoder
    if not opts.init_weights:
        mark_tensor_parallel_weights(model)
    return model if meta else model.to(device())


def _replicated(module: torch.nn.Module, projections: tuple[str, ...]) -> torch.nn.Module:
    """`module` marked as held whole by every tensor rank: megatron-core's `finalize_model_grads`
    averages such parameters' gradients over the tensor-parallel group, which keeps the copies equal.
    Its `projections`' parameters are marked too: --vision-lr leaves them at the projector's rate."""
    for param in module.parameters():
        param.average_gradients_across_tp_domain = True
    for name in projections:
        for param in getattr(module, name).parameters():
            param.is_vision_projection = True
    return module
