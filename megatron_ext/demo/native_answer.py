"""One greedy answer about an image from an HF Qwen2.5-VL checkpoint, with transformers' own
`generate`: the prompt rendered with the chat template the trainer uses (the tokenizer's, else the
family's), the image smart-resized by transformers' image processor and its pad token expanded to
its merged patch count (`data/native_resolution.py`), the token types transformers computes the
mRoPE positions from."""

from __future__ import annotations

from pathlib import Path

from megatron_ext.data.conversation import IMAGE_MARKER


def greedy_answer(hf_dir: str | Path, image: str | Path, question: str, max_new_tokens: int) -> str:
    import torch

    from megatron_ext import families, hf_loading
    from megatron_ext.data.chat_template import resolve_chat_template
    from megatron_ext.data.native_resolution import expand_placeholders, image_inputs, token_types
    from megatron_ext.data.native_resolution_encoder import vision_of, with_vision_runs
    from megatron_ext.eval.prompts import load_image

    arch = families.read_model(hf_loading.load_config(str(hf_dir), "--hf-dir"))
    vision = vision_of(arch)
    tokenizer = hf_loading.load_tokenizer(str(hf_dir), "--hf-dir")
    _, template = resolve_chat_template(None, "en", tokenizer, family_default=families.of(arch).text.chat_template)
    messages = [{"role": "user", "content": with_vision_runs(f"{IMAGE_MARKER}\n{question}")}]
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    media = image_inputs([load_image(image)], vision)
    ids = tokenizer(expand_placeholders(text, vision, media["image_grid_thw"]), add_special_tokens=False,
                    return_tensors="pt").input_ids
    types = torch.from_numpy(token_types(ids[0], arch.image_token_id, arch.video_token_id))[None]
    model = families.load_model(hf_dir, "--hf-dir", dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types, **media,
                             max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
