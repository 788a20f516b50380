"""Worker for test_dpo: one DPO step of the trainer's objective on fixed pairs in any layout.

Usage: torchrun --nproc-per-node N dpo_worker.py CHECKPOINT DATA OUT_DIR OPTIONS_JSON

OPTIONS_JSON: trainer options, "pairs": "tiled" for a tiled LLaVA's pairs (`tiled_pairs`), "native" for a
native-resolution model's (`native_pairs`), and
"steps": how many steps to train on the global batch (1 unless given).

The trainer's plan, model, reference and DPO objective run on `pairs()`: data-parallel replica r
takes pairs r, r + DP, ... of the global batch, as micro batches of --micro-batch-size pairs (or
packed rows of --packing-seq-length). Step 1 trains on the global batch; the same batch is then
evaluated after the update. Rank 0 writes OUT_DIR/result.json (both steps' loss and metrics, the
vision tower's batch sizes) and OUT_DIR/micro_batches.pt: the whole global batch as one replica
would hold it, for the TRL side.
"""

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from PIL import Image

GLOBAL_BATCH, SEQ, VIDEO_FRAMES = 4, 256, 4
COLOURS = {"red": (200, 30, 30), "green": (30, 170, 40), "blue": (40, 60, 210), "yellow": (220, 210, 40)}


def pairs(count: int = GLOBAL_BATCH) -> list:
    """Pair i shows a square of one colour; the chosen answer names it, the rejected one another colour
    at another length. Pair 3 has no image (a text-only pair), pair 1 two images."""
    from megatron_ext.data.shard_format import PreferenceSample

    names = list(COLOURS)
    out = []
    for i in range(count):
        true, false = names[i % 4], names[(i + 1 + i // 4) % 4]
        num_images = {1: 2, 3: 0}.get(i % 4, 1)
        images = [Image.new("RGB", (36 + 5 * i + 3 * k, 30 + 4 * k), COLOURS[true]) for k in range(num_images)]
        prompt = [{"role": "user", "content": "<image>\n" * num_images + "What colour is the square?"}]
        chosen = f"The square is {true}."
        rejected = f"It looks {false} to me, a {false} square on a plain background."[: 20 + 9 * (i % 3)]
        out.append(PreferenceSample(__key__=f"p{i}", __restore_key__=(), images=images, prompt=prompt, chosen=chosen,
                                    rejected=rejected))
    return out


def native_pairs() -> list:
    """`pairs()` as a native-resolution model's chat template writes images: each vision run right
    before the text, no newline between (Qwen2.5-VL's own template, which TRL's collator renders);
    each image random pixels of its size, so that two images of one grid (pair 1's) differ."""
    import numpy as np

    def noisy(image: Image.Image, seed: int) -> Image.Image:
        return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (image.height, image.width, 3), dtype=np.uint8))

    return [replace(p, prompt=[{**m, "content": m["content"].replace("<image>\n", "<image>")} for m in p.prompt],
                    images=[noisy(image, 10 * i + k) for k, image in enumerate(p.images)])
            for i, p in enumerate(pairs())]


def tiled_pairs() -> list:
    """For a tiled LLaVA (OneVision): a wide anyres image, a 4-frame video, a tall image and a text-only
    pair."""
    import numpy as np

    from megatron_ext.convert.compare import synthetic_image
    from megatron_ext.data.shard_format import PreferenceSample

    media = [{"images": [synthetic_image(0, (83, 50))]},
             {"images": [], "videos": [[np.asarray(synthetic_image(10 + i, (60, 60))) for i in range(VIDEO_FRAMES)]]},
             {"images": [synthetic_image(1, (50, 117))]}, {"images": []}]
    questions = ["<image>\nWhat is it?", "<video>\nWhat happens?", "<image>\nWhich shape?", "Name a colour."]
    answers = [("A red square.", "A blue circle, large."), ("It brightens.", "Nothing."), ("A tall bar.", "Round."),
               ("Green.", "I cannot tell you that.")]
    return [PreferenceSample(__key__=f"p{i}", __restore_key__=(), prompt=[{"role": "user", "content": q}], chosen=c,
                             rejected=r, **m) for i, (m, q, (c, r)) in enumerate(zip(media, questions, answers))]


def micro_batches_of(encoder, encoded: list, micro_batch_size: int, packing: bool) -> list[dict]:
    if packing:
        rows = [[encoder.pack_selected_samples(pack)] for pack in encoder.select_samples_to_pack(encoded)]
    else:
        rows = [encoded[i:i + micro_batch_size] for i in range(0, len(encoded), micro_batch_size)]
    return [encoder.batch(row).as_dict() for row in rows]


def main():
    checkpoint, data, out_dir, options = sys.argv[1], sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4])
    kind, steps = options.pop("pairs", "llava"), options.pop("steps", 1)
    import torch
    from megatron.core import parallel_state

    from megatron_ext.config.options import TrainConfig
    from megatron_ext.config.run_plan import make_plan
    from megatron_ext.distributed import device, init_parallel, shutdown
    from megatron_ext.model.mrope_inputs import inputs_for
    from megatron_ext.objectives import for_run
    from megatron_ext.train import checkpointing
    from megatron_ext.train.batches import task_encoder
    from megatron_ext.train.model_setup import build_training_model
    from megatron_ext.train.step import train_step

    config = TrainConfig(megatron_load_dir=checkpoint, data_path=data, stage="dpo", lr=1e-3, global_batch_size=GLOBAL_BATCH,
                         train_iters=1, num_workers=0, lr_warmup_fraction=0.0, lr_decay_style="constant", clip_grad=0.0,
                         **{"seq_length": SEQ, **options})
    plan = make_plan(config, int(os.environ["WORLD_SIZE"]), on_gpu=False)
    cfg = plan.config
    init_parallel(cfg.tp, cfg.pp, seed=cfg.seed, cp=cfg.cp)
    trained = build_training_model(plan)
    checkpointing.load_weights(trained, plan.start, with_optimizer=False)
    inputs = inputs_for(plan.arch, trained.model, device())
    objective = for_run(plan, trained, inputs)
    encoder = task_encoder(plan.tokenizer_dir, plan.arch, replace(cfg, video_frames=VIDEO_FRAMES), plan.seq_length,
                           plan.execution.alignment)
    examples = {"tiled": tiled_pairs, "native": native_pairs}.get(kind, pairs)()
    encoded = [encoder.postencode_sample(encoder.preencode_sample(p)) for p in examples]
    rank, replicas = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    mine = micro_batches_of(encoder, encoded[rank::replicas], cfg.micro_batch_size, bool(cfg.packing_seq_length))
    # The tiles the trained model's tower takes in the step (with LoRA, the reference pass too), seen
    # at its patch embedding: the tower's own call is shadowed where its output was computed ahead.
    tower_batches = []
    hook = next(trained.model.vision_model.children()).register_forward_hook(
        lambda module, args, output: tower_batches.append(args[0].shape[0])) if trained.model.add_encoder else None
    objective.prepare(mine)
    stepped = []
    for _ in range(steps):
        step = train_step(trained, objective.forward_step, mine, plan.seq_length, cfg.micro_batch_size,
                          reduce=objective.reduce)
        stepped.append({"loss": step.loss, "pairs": step.loss_tokens, **step.metrics})
        if hook is not None:  # the first step's tower batches only
            hook.remove()
            hook = None
    loss, _, metrics = objective.evaluate_batch(mine)
    if torch.distributed.get_rank() == 0:
        result = {"first": stepped[0], "steps": stepped, "after": {"loss": loss, **metrics},
                  "tower_batches": tower_batches, "img_seq_len": getattr(plan.arch, "img_seq_len", 1),
                  "images": [inputs.media_count(b) for b in mine]}
        (out_dir / "result.json").write_text(json.dumps(result))
        torch.save(micro_batches_of(encoder, encoded, cfg.micro_batch_size, bool(cfg.packing_seq_length)),
                   out_dir / "micro_batches.pt")
    shutdown()


if __name__ == "__main__":
    main()
