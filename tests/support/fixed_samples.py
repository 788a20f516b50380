"""The fixed conversation samples the invariance and LoRA workers train on, whatever the layout."""

from __future__ import annotations

from PIL import Image

GLOBAL_BATCH, SEQ = 4, 192
WORDS = "red green blue cat dog bird tree house car boat sky field river hill cup chair".split()


def samples(count: int) -> list:
    """Sample i has two images when i % 4 == 1, none (text-only) when i % 4 == 3, else one: the last
    micro batch of a replica's step may hold no image, and the projector must still take part."""
    from megatron_ext.data.conversation import qa_messages
    from megatron_ext.data.shard_format import ConversationSample

    out = []
    for i in range(count):
        words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(3 + i % 5)]
        question = f"What is shown next to the {words[0]}?" if i % 2 else "Describe the picture."
        num_images = {1: 2, 3: 0}.get(i % 4, 1)
        images = [Image.new("RGB", (40 + 7 * i, 30 + 11 * (i % 4) + 5 * k), (20 * i % 255, 90 + 60 * k, 200 - 13 * i % 200))
                  for k in range(num_images)]
        messages = qa_messages("<image>\n" * num_images + question, " ".join(words).capitalize() + ".")
        out.append(ConversationSample(__key__=f"s{i}", __restore_key__=(), images=images, messages=messages))
    return out
