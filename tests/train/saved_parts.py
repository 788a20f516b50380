"""What a real forward of the trainer's LLaVA keeps for backward, by part (the vision tower and
projector, the language model): the measurements test_memory_plan compares the memory plan with,
in its own process and in activation_worker's.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def counted_inside(modules, counter):
    """Saves made while one of `modules` runs its forward go to `counter()` (called once per run), not
    to any counting around the block: the innermost saved-tensor hooks are the ones that count."""
    inside = contextlib.ExitStack()

    def enter(*_):  # a pre-hook's return value would replace the module's inputs
        inside.enter_context(counter().counting())

    with contextlib.ExitStack() as hooks:
        for module in modules:
            hooks.callback(module.register_forward_pre_hook(enter).remove)
            hooks.callback(module.register_forward_hook(lambda *_: inside.close()).remove)
        yield


@contextlib.contextmanager
def saved_by_part(model, parameters):
    """(vision, rest): the bytes saved for backward by the forwards in the block, the vision tower's
    and projector's (counted while those modules run) apart from the rest's (the language model's)."""
    from megatron_ext.memory.saved_tensors import SavedBytes

    vision, rest = SavedBytes(parameters), SavedBytes(parameters)
    # A native-resolution model's projection is inside its tower (its vision_projection is None).
    towers = [m for m in (model.vision_model, model.vision_projection) if m is not None]
    with rest.counting(), counted_inside(towers, lambda: vision):
        yield vision, rest


def cut_below_the_layers(model):
    """Backward stops at the LM layers' input (a leaf from there): the tower's backward measures
    nothing here. megatron's recomputation refuses torch.autograd.grad, which would stop there too."""

    def cut(_, args, kwargs):
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"].detach().requires_grad_()}

    model.language_model.decoder.register_forward_pre_hook(cut, with_kwargs=True)


def largest_recomputed_group(model, parameters, loss, layers_per_group: int) -> int:
    """The most bytes one group of LM layers saves while full recomputation reruns it in the backward
    of `loss`: a group's layers rerun one after the other, and hold their activations together until
    the group's backward is done."""
    from megatron_ext.memory.saved_tensors import SavedBytes

    runs = []

    def run():
        runs.append(SavedBytes(parameters))
        return runs[-1]

    with counted_inside(model.language_model.decoder.layers, run):
        loss.sum().backward()
    return max(sum(r.bytes for r in runs[i:i + layers_per_group]) for i in range(0, len(runs), layers_per_group))


def saved_in_forward(model, arch, seq: int, images: int, recomputed_group: int = 0) -> tuple[int, int]:
    """(vision, LM) bytes kept for backward by a forward of one packed row of `seq` positions holding
    `images` LLaVA-1.5 images. With full recomputation in groups of `recomputed_group` layers, the
    LM's peak: the forward's saves (the checkpoints, the layers not recomputed) plus the largest group
    backward recomputes (`model` then cut by `cut_below_the_layers`)."""
    import torch

    parameters = list(model.parameters())
    torch.manual_seed(seq + images)  # every tensor rank gets the same row
    text = seq - images * (arch.img_seq_len - 1)  # each image token becomes img_seq_len positions
    ids = torch.randint(0, arch.image_token_index, (1, text))
    ids[0, 1:1 + images] = arch.image_token_index
    # The unpacked rows' path (the layers' causal mask): a one-row micro batch on the CPU in fp32
    # goes through SDPA's masked kernel, which keeps an fp32 copy of the block mask in every layer; a
    # GPU's varlen flash kernel keeps none (docs/gpu.md).
    with saved_by_part(model, parameters) as (vision, rest):
        loss, _ = model(images=torch.randn(images, 3, arch.vision.image_size, arch.vision.image_size),
                        input_ids=ids, position_ids=None, attention_mask=None,
                        labels=torch.randint(0, arch.image_token_index, (1, text)), loss_mask=torch.ones(1, text))
    lm = rest.bytes
    if recomputed_group:
        lm += largest_recomputed_group(model, parameters, loss, recomputed_group)
    return vision.bytes, lm


def saved_in_tiled_forward(model, arch, seq: int, layout) -> tuple[int, int]:
    """(vision, LM) bytes kept for backward by a forward of a tiled LLaVA (OneVision, NeXT) over one
    packed row of `seq` positions holding `layout`'s images and videos (`tiling.Media`), each feature
    one image token, text around them."""
    import torch

    from megatron_ext.model.tiling import VIDEO, feature_count, layout_tensor

    parameters = list(model.parameters())
    tile = arch.vision.image_size
    side = tile // arch.vision.patch_size
    torch.manual_seed(seq)
    ids = torch.randint(0, arch.image_token_index, (1, seq))
    start = 1
    for media in layout:
        features = feature_count(media, arch.tiling, tile, side)
        ids[0, start:start + features] = arch.tiling.video_token_index if media.kind == VIDEO else arch.image_token_index
        start += features + 1
    tiles = sum(media.tiles for media in layout)
    with saved_by_part(model, parameters) as (vision, rest):
        model(images=torch.randn(tiles, 3, tile, tile), input_ids=ids, position_ids=None, attention_mask=None,
              labels=torch.randint(0, arch.image_token_index, (1, seq)), loss_mask=torch.ones(1, seq),
              media_layout=layout_tensor(layout))
    return vision.bytes, rest.bytes


def saved_in_native_forward(model, arch, grid: tuple[int, int, int], images: int) -> tuple[int, int]:
    """(vision, LM) bytes kept for backward by a forward of a Qwen-VL over one row of `images` images
    of `grid` (t, h, w patches), their merged tokens filling it."""
    import torch

    parameters = list(model.parameters())
    config = arch.vision_config
    patches = grid[0] * grid[1] * grid[2]
    tokens = images * patches // config["spatial_merge_size"] ** 2
    torch.manual_seed(tokens)
    ids = torch.full((1, tokens), arch.image_token_id)
    row = config["in_channels"] * config["temporal_patch_size"] * config["patch_size"] ** 2
    with saved_by_part(model, parameters) as (vision, rest):
        model(ids, torch.arange(tokens).expand(3, 1, tokens), pixel_values=torch.randn(images * patches, row),
              image_grid_thw=torch.tensor([grid] * images), labels=torch.randint(0, arch.image_token_id, (1, tokens)),
              loss_mask=torch.ones(1, tokens))
    return vision.bytes, rest.bytes
