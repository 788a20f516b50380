"""One greedy answer about an image from an HF Qwen2.5-VL or Qwen3-VL checkpoint, with transformers' own
`generate`: the prompt encoded by the trainer's task encoder as `compare` encodes it
(`convert.compare.native_resolution_inputs`: the chat template, the image smart-resized, its pad
token expanded to its merged patch count, the token types transformers computes mRoPE from)."""

from __future__ import annotations

from pathlib import Path


def greedy_answer(hf_dir: str | Path, image: str | Path, question: str, max_new_tokens: int) -> str:
    import torch

    from megatron_ext import families, hf_loading
    from megatron_ext.convert.compare import native_resolution_inputs
    from megatron_ext.eval.prompts import load_image

    arch = families.read_model(hf_loading.load_config(str(hf_dir), "--hf-dir"))
    inputs = native_resolution_inputs(hf_dir, arch, [load_image(image)], question)
    inputs.pop("position_ids")  # transformers computes its own from the token types
    ids = inputs["input_ids"]
    model = families.load_model(hf_dir, "--hf-dir", dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    tokenizer = hf_loading.load_tokenizer(str(hf_dir), "--hf-dir")
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
