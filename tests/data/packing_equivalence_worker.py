"""Worker for test_packing: packed vs unpacked loss through megatron-core's LLaVAModel on CPU.

Usage: packing_equivalence_worker.py HF_LLAVA_DIR OUT_JSON
"""

import json
import sys

import torch
from megatron.energon import VQASample
from PIL import Image

SEQ = 160


def samples():
    multi = [{"from": "human", "value": "<image>\nWhat shape is it?"}, {"from": "gpt", "value": "A circle."},
             {"from": "human", "value": "And the color?"}, {"from": "gpt", "value": "Blue, like the sky."}]
    qa = [("What is in the picture?", "A red cat on a sofa."), (multi, None),
          ("Describe the image in detail.", "Two dogs are running across a green field under a blue sky."),
          ("How many?", "Three."), ("Where is it?", "In the top left corner of the picture.")]
    return [VQASample(__key__=str(i), __restore_key__=(), image=Image.new("RGB", (50 + 9 * i, 40 + 5 * i), (40 * i, 120, 200 - 30 * i)),
                      context=q, answers=a) for i, (q, a) in enumerate(qa)]


def main():
    hf_dir, out = sys.argv[1], sys.argv[2]
    from megatron_ext.data.packing import combined_seq_len, packed_attention_mask
    from megatron_ext.data.task_encoder import LlavaTaskEncoder
    from megatron_ext.distributed import init_parallel, shutdown
    from megatron_ext.model.arch import LlavaArch
    from megatron_ext.model.provider import ModelOptions, build_model

    init_parallel(1, 1, seed=11)
    arch = LlavaArch.from_hf_config(json.load(open(f"{hf_dir}/config.json")))
    model = build_model(arch, ModelOptions(seq_length=SEQ)).eval()
    encoder = LlavaTaskEncoder.for_model(hf_dir, arch, seq_length=SEQ, packing_seq_length=SEQ)
    encoded = [encoder.postencode_sample(encoder.preencode_sample(s)) for s in samples()]

    def loss_sums(batch, masked=True):
        seq = combined_seq_len(batch.input_ids, arch.image_token_index, arch.img_seq_len, SEQ)
        mask = packed_attention_mask(batch.input_ids, batch.segment_ids, arch.image_token_index, arch.img_seq_len, seq)
        with torch.no_grad():
            loss, loss_mask = model(images=batch.images, input_ids=batch.input_ids, position_ids=None,
                                    attention_mask=mask if masked else None, labels=batch.labels, loss_mask=batch.loss_mask)
        return float((loss.double() * loss_mask).sum()), float(loss_mask.sum()), float(batch.loss_mask.sum())

    packs = encoder.select_samples_to_pack(encoded)
    packed = encoder.batch([encoder.pack_selected_samples(p) for p in packs])
    packed_sum, packed_tokens, batch_tokens = loss_sums(packed)
    causal_sum, _, _ = loss_sums(packed, masked=False)
    singles = [loss_sums(encoder.batch([s])) for s in encoded]
    json.dump({
        "pack_sizes": [len(p) for p in packs],
        "packed_loss": packed_sum / packed_tokens,
        "unpacked_loss": sum(s for s, _, _ in singles) / sum(n for _, n, _ in singles),
        "causal_only_loss": causal_sum / packed_tokens,
        "packed_tokens": packed_tokens,
        "batch_tokens": batch_tokens,
        "unpacked_tokens": sum(n for _, n, _ in singles),
    }, open(out, "w"))
    shutdown()


if __name__ == "__main__":
    main()
