"""CPU generation speed: megatron-core KV-cached generation (scripts/eval/generate.py's path) vs
transformers' `generate` on the same converted checkpoint, one process, fp32, greedy.

    python bench/generate_bench.py [--family llava|qwen2_5_vl] [--new-tokens 64] [--rounds 3] [--workdir DIR]

Builds a small model locally: a LLaVA (Llama text 8 layers x 512, GQA 8/4 heads, + the tiny CLIP
tower, 16 image tokens) or a Qwen2.5-VL (the same decoder widths with mRoPE, + the demo's tiny
tower, the image at its own size), converts it to a Megatron checkpoint (TP1), and for a short and a long prompt
measures the prefill (time to the first new token) and the time per further token, as the median
of `--rounds` runs. End-of-turn stops are disabled so every run makes exactly `--new-tokens`.
Per-token time that stays flat from the short to the long prompt is what the KV cache buys.
"""

from __future__ import annotations

import platform
import statistics
import tempfile
import time
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent
PROMPTS = {"short": "Describe this image.", "long": "Describe this image in detail. " + "red green blue " * 150}


# The decoder's widths, both families.
WIDTHS = {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1408}


def _build(work: Path, family: str) -> tuple[Path, Path]:
    from megatron_ext.convert.to_megatron import convert
    from megatron_ext.demo.tiny_models import TinyTextSpec, make_all, make_qwen_vl
    from megatron_ext.hf.build_llava import build_llava

    if family == "qwen2_5_vl":
        w = WIDTHS
        hf = make_qwen_vl(work / "hf", "qwen2_5_vl", text_fields={
            "hidden_size": w["hidden_size"], "num_hidden_layers": w["num_layers"], "num_attention_heads": w["num_heads"],
            "num_key_value_heads": w["num_kv_heads"], "intermediate_size": w["intermediate_size"], "head_dim": 64,
            "max_position_embeddings": 2048, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                                 "mrope_section": [8, 12, 12]}})
    else:
        tiny = make_all(work / "tiny", text_spec=TinyTextSpec(**WIDTHS, max_position_embeddings=2048))
        hf = build_llava(work / "hf", str(tiny["text"]), str(tiny["vision-clip"]))
    return hf, convert(hf, work / "megatron", tp=1, pp=1)


MODELS = {"llava": "Llama text 8 layers x 512 (GQA 8/4 heads, FFN 1408, vocab ~1k) + tiny CLIP (16 image tokens)",
          "qwen2_5_vl": "Qwen2.5-VL, decoder 8 layers x 512 (GQA 8/4 heads, FFN 1408, mRoPE 8/12/12, vocab ~450) + "
                        "the demo's 2-block tower, the 70x60 image resized to 56x56, 4 merged tokens"}


def _timed(generator, prompt, new_tokens: int) -> float:
    from megatron_ext.eval.sampling import SamplingOptions

    start = time.perf_counter()
    generation = generator.generate(prompt, SamplingOptions(max_new_tokens=new_tokens))
    seconds = time.perf_counter() - start
    assert len(generation.token_ids) == new_tokens, len(generation.token_ids)
    return seconds


def _measure(generator, prompt, new_tokens: int, rounds: int) -> tuple[float, float]:
    """(prefill ms, ms per further token), medians over rounds."""
    _timed(generator, prompt, 2)  # warm-up
    first = [_timed(generator, prompt, 1) for _ in range(rounds)]
    full = [_timed(generator, prompt, new_tokens) for _ in range(rounds)]
    prefill = statistics.median(first)
    return prefill * 1e3, (statistics.median(full) - prefill) / (new_tokens - 1) * 1e3


@click.command()
@click.option("--family", type=click.Choice(["llava", "qwen2_5_vl"]), default="llava", show_default=True)
@click.option("--new-tokens", type=int, default=64, show_default=True)
@click.option("--rounds", type=int, default=3, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False), help="Keep the built models here (default: a temp dir).")
@click.option("--output", type=click.Path(dir_okay=False), help="The report [default: bench/results/generate.md, "
              "generate_qwen2_5_vl.md for --family qwen2_5_vl].")
def main(family, new_tokens, rounds, workdir, output):
    import torch

    from megatron_ext.convert.compare import synthetic_image
    from megatron_ext.distributed import shutdown
    from megatron_ext.eval.checkpoints import open_checkpoint
    from megatron_ext.eval.prompts import user_turn

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(workdir or tmp)
        hf_dir, megatron_dir = _build(work, family)
        image = synthetic_image(0)
        rows = []
        for kind, path in (("megatron-core, KV cache (StaticInferenceContext)", megatron_dir),
                           ("transformers generate (DynamicCache)", hf_dir)):
            source = open_checkpoint(str(path) if kind.startswith("megatron") else None,
                                     None if kind.startswith("megatron") else str(path))
            generator = source.generator()
            generator.stop_ids = []  # every run makes exactly --new-tokens
            for name, text in PROMPTS.items():
                prompt = source.encoder.encode([user_turn(text, 1)], [image])
                prefill, per_token = _measure(generator, prompt, new_tokens, rounds)
                rows.append((kind, name, prompt.length, prefill, per_token))
                print(rows[-1], flush=True)
        shutdown()

    lines = [
        "# Generation speed on CPU: megatron-core KV cache vs transformers",
        "",
        f"Machine: {platform.machine()}, 2 CPU cores (shared), no GPU, Python {platform.python_version()}, "
        f"torch {torch.__version__}; one process, one intra-op thread, fp32, greedy.",
        "",
        f"Command: `python bench/generate_bench.py --family {family} --new-tokens {new_tokens} --rounds {rounds}`",
        "",
        f"Model: {MODELS[family]}, built locally and converted to Megatron TP1. {new_tokens} new tokens per run, "
        f"median of {rounds} runs.",
        "",
        "| generator | prompt | prompt positions | prefill ms | ms per further token |",
        "|---|---|---:|---:|---:|",
        *[f"| {kind} | {name} | {length} | {prefill:.1f} | {per_token:.2f} |"
          for kind, name, length, prefill, per_token in rows],
        "",
    ]
    report = output or REPO / "bench/results" / ("generate.md" if family == "llava" else f"generate_{family}.md")
    Path(report).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
