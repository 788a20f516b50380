"""Worker for test_backends: per-token losses of the same samples through megatron-core's LLaVAModel
with each attention backend and batch layout (run under torchrun, 1 or 2 processes = TP1 / TP2).

Usage: backend_worker.py MEGATRON_CHECKPOINT OUT_JSON [BACKENDS [TP1_KEYS]]   (default: local,sdpa)

Writes {"<backend>/<layout>": {sample key: [loss of every trained position, in order]}}, and under
2 processes with TP1_KEYS (comma-separated "<backend>/<layout>"), "tp1": those losses at TP1.
"""

import json
import os
import sys

import torch
from PIL import Image

SEQ = 192


def samples():
    """Conversations with one image, none (text-only) and two."""
    from megatron_ext.data.conversation import sample_messages
    from megatron_ext.data.shard_format import ConversationSample

    multi = [{"from": "human", "value": "<image>\nWhat shape is it?"}, {"from": "gpt", "value": "A circle."},
             {"from": "human", "value": "And the color?"}, {"from": "gpt", "value": "Blue, like the sky."}]
    qa = [("What is in the picture?", "A red cat on a sofa.", 1), (multi, None, 1),
          ("Describe the image in detail.", "Two dogs are running across a green field under a blue sky.", 1),
          ("How many?", "Three.", 1), ("Where is it?", "In the top left corner of the picture.", 1),
          ("Write a haiku about rain.", "Rain on the roof, soft.", 0),
          ("<image> or <image>: which is brighter?", "The second one.", 2)]
    out = []
    for i, (question, answer, num_images) in enumerate(qa):
        images = [Image.new("RGB", (50 + 9 * (i + k), 40 + 5 * i), (40 * i, 120 - 50 * k, 200 - 30 * i))
                  for k in range(num_images)]
        messages = sample_messages(question, answer)
        if num_images == 1 and "<image>" not in str(question):
            messages[0]["content"] = "<image>\n" + messages[0]["content"]
        out.append(ConversationSample(__key__=str(i), __restore_key__=(), images=images, messages=messages))
    return out


def batches(encoder, layout: str) -> list:
    encoded = [encoder.postencode_sample(encoder.preencode_sample(s)) for s in samples()]
    if layout == "unpacked":  # one sample per micro batch
        return [encoder.batch([s]) for s in encoded]
    if layout == "unpacked-rows":  # several samples per micro batch, padded rows
        return [encoder.batch(encoded[:3]), encoder.batch(encoded[3:])]
    packs = [encoder.pack_selected_samples(p) for p in encoder.select_samples_to_pack(encoded)]
    if layout == "packed-rows":  # two packed rows per micro batch (a dense mask for every backend)
        return [encoder.batch(packs[i:i + 2]) for i in range(0, len(packs), 2)]
    return [encoder.batch([p]) for p in packs]  # one packed row per micro batch (THD for sdpa)


def per_sample_losses(model, inputs, batch, separate: bool = True) -> dict:
    from megatron_ext.model.packed_sequences import combined_segment_ids

    kwargs = inputs(batch.as_dict())
    if not separate:
        kwargs.pop("packed_seq_params", None)
        kwargs["attention_mask"] = None
    with torch.no_grad():
        loss, loss_mask = model(**kwargs)
    # Beside the model's outputs: on a GPU they are device tensors.
    segments = combined_segment_ids(kwargs["input_ids"], batch.segment_ids.to(loss.device), inputs.image_token_index,
                                    inputs.img_seq_len, loss.shape[1])
    out = {}
    for row, keys in enumerate(batch.__key__):
        for number, key in enumerate(keys.split(","), start=1):
            trained = (segments[row] == number) & (loss_mask[row] > 0)
            out[key] = loss[row][trained].double().tolist()
    return out


def main():
    checkpoint, out = sys.argv[1], sys.argv[2]
    backends = sys.argv[3].split(",") if len(sys.argv) > 3 else ["local", "sdpa"]
    from megatron.core import parallel_state

    from megatron_ext import families
    from megatron_ext.checkpoint import layout
    from megatron_ext.checkpoint.model_io import load_model_weights
    from megatron_ext.data.task_encoder import LlavaTaskEncoder
    from megatron_ext.distributed import device, init_parallel, shutdown
    from megatron_ext.model.execution import ModelExecution
    from megatron_ext.model.inputs import ModelInputs
    from megatron_ext.model.provider import ModelOptions, build_model
    from megatron_ext.model.sequence_alignment import SequenceAlignment

    snapshot = layout.find_snapshot(checkpoint)
    arch = snapshot.arch
    encoders = {
        "": LlavaTaskEncoder.for_model(str(snapshot.tokenizer_dir), arch, seq_length=SEQ, packing_seq_length=SEQ),
        # As context parallelism 2 with FP8 would lay samples out: each a multiple of 4, each batch of 16.
        "aligned ": LlavaTaskEncoder.for_model(str(snapshot.tokenizer_dir), arch, seq_length=SEQ, packing_seq_length=SEQ,
                                               alignment=SequenceAlignment(total=16, per_sample=4)),
    }

    def losses_at(tp: int, only=None) -> dict:
        """Every backend's losses at TP `tp` (the other ranks data-parallel replicas); `only`: just those keys."""
        parallel_state.destroy_model_parallel()
        init_parallel(tp, 1, seed=11)
        results = {}
        for backend in backends:
            model = build_model(arch, families.of(arch), ModelOptions(seq_length=SEQ, init_weights=False,
                                                                      execution=ModelExecution(attention_backend=backend))).eval()
            load_model_weights(model, snapshot.path)
            inputs = ModelInputs.for_model(arch, model, device())
            for prefix, encoder in encoders.items():
                for name in ("unpacked", "unpacked-rows", "packed", "packed-rows"):
                    key = f"{backend}/{prefix}{name}"
                    if (backend == "te" and name == "packed-rows") or (only is not None and key not in only):
                        continue  # te: refused, Transformer Engine takes one packed sequence per micro batch
                    losses = {}
                    for batch in batches(encoder, name):
                        losses.update(per_sample_losses(model, inputs, batch))
                    results[key] = losses
            if only is not None:
                continue
            unseparated = {}
            for batch in batches(encoders[""], "packed"):
                unseparated.update(per_sample_losses(model, inputs, batch, separate=False))
            results[f"{backend}/packed, samples not kept apart"] = unseparated
            results[f"{backend}/packs"] = [b.__key__[0].split(",") for b in batches(encoders[""], "packed")]
        return results

    world = int(os.environ.get("WORLD_SIZE", "1"))
    results = losses_at(world)  # every process a TP rank
    results["tp"] = parallel_state.get_tensor_model_parallel_world_size()
    if world > 1 and len(sys.argv) > 4:
        # In the same launch (one start instead of two): the named losses at TP1, to compare.
        results["tp1"] = losses_at(1, only=sys.argv[4].split(","))
    if torch.distributed.get_rank() == 0:
        json.dump(results, open(out, "w"))
    shutdown()


if __name__ == "__main__":
    main()
