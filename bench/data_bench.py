"""Data pipeline throughput and packing efficiency on LLaVA-like data.

    python bench/data_bench.py [--samples 480] [--rounds 5] [--workers 0 --workers 2] [--out bench/results/data.md]

Inputs, built in a temporary directory:
- a tokenizer + image processor directory like a LLaVA-1.5 checkpoint's: the tiny test BPE
  tokenizer (with <image>/<pad>) and a CLIP ViT-L/14-336 image processor (336 px, 576 image
  tokens per image, sequence length 2048);
- LLaVA-like samples: 640x480 photo-like JPEGs (smooth noise) and conversations drawn from the
  kinds in SAMPLE_KINDS (shares modelled on LLaVA-1.5's 665K mix), so that with 576 image tokens
  samples span ~620-1100 positions with most of them short; built into shards with
  scripts/data/build_energon_dataset.py's code.

Throughput: samples/s of (a) a bare energon loop that only decodes the shards (energon's default
decoder to float tensors, default batching), (b) the full task encoder without packing, (c) the
full task encoder with packing to 2048, and (d) = (b) with the HF image processor replaced by a
no-op, which isolates the encoder's own work (template, tokenizer, masks, batching). Rounds are
interleaved, each on a fresh loader whose first batch (worker start-up) is not timed; medians.
Without worker processes the rate per CPU-second of the process is reported too: it depends less
on what else runs on a shared machine. The cost of each step alone (CPU ms per sample, outside
any loader) is measured too.

Packing efficiency: non-padding fraction of the combined (image-expanded) token grid over three
packing buffers' worth of samples (768), the grid being rows x the longest row (what the model
computes without pipeline parallelism) or rows x the sequence length (with pipeline
parallelism; for packing, the fill of each packed sequence): without packing (micro batch 8) and
with packing to 2048 (micro batch 1 and 2), 4096 and 8192 (micro batch 1), packing buffer 256.

Any-resolution tiles and video frames (`--only tiles` measures just these): samples per
CPU-second of this process (one thread: per core), interleaved rounds, medians, of
- a 672x672 photo-like image -> 5 tiles at 336 (LLaVA-NeXT's settings), by transformers'
  LlavaNextImageProcessorPil and by megatron_ext.data.anyres (the same pixel_values, checked);
- a 640x480 mpeg4 video of 64 frames -> 8 frames sampled (PyAV) -> OneVision's frames at 384
  (megatron_ext.data.video): decoding alone, preprocessing alone, both; and preprocessing by
  transformers' LlavaOnevisionVideoProcessor beside ours (the same pixel_values, checked) in a child
  process with torchvision (tests/reference/torchvision_child; needs `scripts/setup_env.sh --dev`).
"""

from __future__ import annotations

import gc
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # tests/reference/torchvision_child runs transformers' video processor
SEQ = 2048
IMAGE_SIZE = 336
IMG_SEQ_LEN = (IMAGE_SIZE // 14) ** 2
MICRO_BATCH = 8
PACKING_BUFFER = 256  # megatron_ext.data.loader's default
WORDS = ("the a cat dog red green blue sofa window field sky picture man street city bicycle bowl fruit apples "
         "bananas oranges people image shows sitting running under next to two three busy large small left right "
         "behind front color shape detail because likely appears scene light table woman child car tree").split()


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


# (share, exchanges, question words, answer words) modelled on LLaVA-1.5's 665K instruction mix:
# short-answer VQA with several questions per image, each with LLaVA's "Answer the question using
# a single word or phrase." instruction (VQAv2, GQA, OCR-VQA), region questions with
# box answers (RefCOCO, Visual Genome), and LLaVA-Instruct's conversations, detailed
# descriptions and complex reasoning.
SAMPLE_KINDS = {
    "short-answer VQA": (0.45, (1, 8), (10, 20), (1, 3)),
    "region / grounding": (0.15, (1, 6), (4, 8), (4, 8)),
    "conversation": (0.13, (1, 5), (5, 12), (5, 30)),
    "detailed description": (0.13, (1, 1), (6, 12), (40, 100)),
    "complex reasoning": (0.14, (1, 1), (10, 25), (30, 80)),
}


def _conversation(rng: random.Random) -> list[dict]:
    kinds = list(SAMPLE_KINDS.values())
    _, exchanges, q_words, a_words = rng.choices(kinds, weights=[k[0] for k in kinds])[0]
    turns = []
    for i in range(rng.randint(*exchanges)):
        question = _sentence(rng, rng.randint(*q_words))
        turns.append({"from": "human", "value": f"<image>\n{question}" if i == 0 else question})
        turns.append({"from": "gpt", "value": _sentence(rng, rng.randint(*a_words))})
    return turns


def _photo(rng: np.random.RandomState, width: int = 640, height: int = 480):
    from PIL import Image

    coarse = (rng.rand(12, 16, 3) * 255).astype("uint8")
    image = Image.fromarray(coarse).resize((width, height), Image.BICUBIC)
    noise = rng.randint(-12, 12, (height, width, 3))
    return Image.fromarray(np.clip(np.asarray(image, dtype=np.int16) + noise, 0, 255).astype("uint8"))


def make_inputs(work: Path, samples: int) -> tuple[Path, Path]:
    """(tokenizer+processor directory, prepared dataset directory)."""
    import json

    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from megatron_ext.data.build import build_energon_dataset
    from megatron_ext.demo.tiny_models import train_tokenizer
    from megatron_ext.hf.build_llava import add_special_tokens

    model_dir = work / "model"
    tokenizer = train_tokenizer(1000)
    add_special_tokens(tokenizer)
    tokenizer.save_pretrained(model_dir)
    CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                          crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(model_dir)
    src = work / "src"
    (src / "images").mkdir(parents=True)
    rng, np_rng = random.Random(0), np.random.RandomState(0)
    records = []
    for i in range(samples):
        _photo(np_rng).save(src / "images" / f"{i:06d}.jpg", quality=90)
        records.append({"id": str(i), "image": f"images/{i:06d}.jpg", "conversations": _conversation(rng)})
    (src / "llava.json").write_text(json.dumps(records))
    build_energon_dataset(src / "llava.json", work / "energon", split_ratio="1,0,0", samples_per_shard=40, num_workers=2)
    return model_dir, work / "energon"


def _no_image_processing(images):
    """Stands in for the image preprocessing to isolate the task encoder's own work."""
    import torch

    return torch.zeros(len(images), 3, IMAGE_SIZE, IMAGE_SIZE)


def _encoder(model_dir: Path, packing: int | None, image_processing: bool = True):
    from transformers import AutoTokenizer

    from megatron_ext.data.task_encoder import LlavaTaskEncoder

    image_token = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<image>")
    encoder = LlavaTaskEncoder(str(model_dir), seq_length=max(SEQ, packing or 0), img_seq_len=IMG_SEQ_LEN,
                               image_token_index=image_token, packing_seq_length=packing)
    if not image_processing:
        encoder.images = _no_image_processing
    return encoder


def _bare_loader(path: Path, workers: int):
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

    dataset = get_train_dataset(str(path), worker_config=WorkerConfig(rank=0, world_size=1, num_workers=workers),
                                batch_size=MICRO_BATCH, shuffle_buffer_size=100, max_samples_per_sequence=100)
    return get_savable_loader(dataset)


def _task_loader(path: Path, encoder, workers: int, micro_batch: int = MICRO_BATCH):
    from megatron_ext.data.loader import train_loader

    return train_loader(path, encoder, micro_batch_size=micro_batch, num_workers=workers, seed=0)


def _samples_per_second(loader, min_samples: int) -> tuple[float, float]:
    """(samples per wall second, samples per CPU second of this process)."""
    it = iter(loader)
    next(it)  # worker start-up and buffer filling are not timed
    done, wall, cpu = 0, time.perf_counter(), time.process_time()
    while done < min_samples:
        batch = next(it)
        done += getattr(batch, "num_samples", None) or len(batch.__key__)
    return done / (time.perf_counter() - wall), done / (time.process_time() - cpu)


def throughput(model_dir: Path, data: Path, workers: int, rounds: int, min_samples: int) -> dict[str, list[tuple[float, float]]]:
    cases = {
        "bare energon decode": lambda: _bare_loader(data, workers),
        "task encoder, no packing": lambda: _task_loader(data, _encoder(model_dir, None), workers),
        "task encoder, packing 2048": lambda: _task_loader(data, _encoder(model_dir, SEQ), workers, 2),
        "task encoder, no packing, no image processing": lambda: _task_loader(data, _encoder(model_dir, None, False), workers),
    }
    results = {name: [] for name in cases}
    for _ in range(rounds):
        for name, make in cases.items():
            results[name].append(_samples_per_second(make(), min_samples))
            gc.collect()  # drop the finished loader's buffers before the next one starts
    return results


def component_costs(model_dir: Path, src: Path, repeats: int = 5) -> dict[str, float]:
    """CPU milliseconds per sample of each step, outside any loader, over the first 40 samples."""
    import json

    import webdataset as wds

    from megatron_ext.data.conversation import llava_messages

    encoder = _encoder(model_dir, None)
    records = json.loads((src / "llava.json").read_text())[:40]
    jpegs = [(src / r["image"]).read_bytes() for r in records]
    to_tensor, to_pil = wds.autodecode.imagehandler("torchrgb"), wds.autodecode.imagehandler("pil")
    steps = {
        "energon's default decode (JPEG -> float tensor)": lambda i: to_tensor("jpg", jpegs[i]),
        "JPEG -> PIL (the task encoder's decode)": lambda i: to_pil("jpg", jpegs[i]),
        "JPEG -> PIL -> HF image processor (CLIPImageProcessorPil)":
            lambda i: encoder.images.processor(images=[to_pil("jpg", jpegs[i])], return_tensors="pt"),
        "JPEG -> PIL -> ImagePreprocessor (the task encoder's; same pixels)": lambda i: encoder.images([to_pil("jpg", jpegs[i])]),
        "chat template + tokenizer + assistant mask": lambda i: encoder.chat.encode(llava_messages(records[i]["conversations"])),
    }
    costs = {}
    for name, step in steps.items():
        start = time.process_time()
        for _ in range(repeats):
            for i in range(len(records)):
                step(i)
        costs[name] = (time.process_time() - start) / (repeats * len(records)) * 1e3
    return costs


def packing_efficiency(model_dir: Path, data: Path, samples: int) -> dict[str, tuple[float, float]]:
    """(fill of rows x longest row, fill of rows x sequence length) over at least `samples` samples."""
    from megatron_ext.model.packed_sequences import combined_seq_len, token_widths

    out = {}
    cases = [("no packing, micro batch 8", None, 8)]
    cases += [(f"packing to {n}, micro batch {mb}", n, mb) for n, mb in ((SEQ, 1), (SEQ, 2), (2 * SEQ, 1), (4 * SEQ, 1))]
    for name, packing, micro_batch in cases:
        encoder = _encoder(model_dir, packing, image_processing=False)
        it = iter(_task_loader(data, encoder, 0, micro_batch))
        real = padded_to_batch = padded_to_seq = done = 0
        # Whole packing buffers are measured: each buffer's packs come out fullest first.
        while done < samples:
            batch = next(it)
            done += batch.num_samples
            widths = token_widths(batch.input_ids, encoder.layout.image_token_index, IMG_SEQ_LEN)
            real += int((widths * (batch.segment_ids > 0)).sum())
            rows = batch.input_ids.shape[0]
            padded_to_batch += rows * combined_seq_len(batch.input_ids, encoder.layout.image_token_index, IMG_SEQ_LEN, packing or SEQ)
            padded_to_seq += rows * (packing or SEQ)
        out[name] = (real / padded_to_batch, real / padded_to_seq)
    return out


def _first_fit_decreasing(lengths: list[int], capacity: int) -> int:
    """Bins first-fit-decreasing needs (the usual packer; the baseline for knapsack_bins)."""
    free = []
    for n in sorted(lengths, reverse=True):
        fit = next((b for b, room in enumerate(free) if n <= room), None)
        if fit is None:
            free.append(capacity - n)
        else:
            free[fit] -= n
    return len(free)


def _bins_lower_bound(lengths: list[int], capacity: int) -> int:
    """Fewest bins any packer can use when no bin holds 4 samples (4 x shortest > capacity).

    At most k bins hold 3 samples, k the largest with the 3k shortest summing to <= k x capacity
    (a triple of longer samples is never lighter); every other bin holds at most 2.
    """
    ordered = sorted(lengths)
    assert 4 * ordered[0] > capacity
    prefix = np.cumsum([0] + ordered)
    triples = max(k for k in range(len(ordered) // 3 + 1) if prefix[3 * k] <= k * capacity)
    return max(triples + -(-(len(ordered) - 3 * triples) // 2), -(-int(prefix[-1]) // capacity))


def packer_comparison(model_dir: Path, buffers: int = 24) -> dict[int, dict[str, float]]:
    """Fill of packed sequences by packer, over `buffers` packing buffers of sample lengths drawn
    like the dataset's (text only: the lengths are what matters), at 2048 / 4096 / 8192."""
    from megatron_ext.data.conversation import llava_messages
    from megatron_ext.data.packing import knapsack_bins

    encoder = _encoder(model_dir, None, image_processing=False)
    rng = random.Random(1)
    lengths = [len(encoder.chat.encode(llava_messages(_conversation(rng)))[0]) + IMG_SEQ_LEN - 1
               for _ in range(buffers * PACKING_BUFFER)]
    chunks = [lengths[k: k + PACKING_BUFFER] for k in range(0, len(lengths), PACKING_BUFFER)]
    out = {}
    for capacity in (SEQ, 2 * SEQ, 4 * SEQ):
        bins = {"first-fit-decreasing": sum(_first_fit_decreasing(c, capacity) for c in chunks),
                "knapsack_bins (ours)": sum(len(knapsack_bins(c, capacity)) for c in chunks)}
        if 4 * min(lengths) > capacity:
            bins["best possible (bound)"] = sum(_bins_lower_bound(c, capacity) for c in chunks)
        out[capacity] = {name: sum(lengths) / (n * capacity) for name, n in bins.items()}
    return out


def _per_cpu_second(step, repeats: int) -> float:
    start = time.process_time()
    for _ in range(repeats):
        step()
    return repeats / (time.process_time() - start)


def _video(path: Path, frames: int = 64) -> Path:
    """A 640x480 mpeg4 video of photo-like frames."""
    import av

    rng = np.random.RandomState(1)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=30)
        stream.width, stream.height, stream.pix_fmt = 640, 480, "yuv420p"
        for _ in range(frames):
            for packet in stream.encode(av.VideoFrame.from_image(_photo(rng))):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def tile_rates(work: Path, rounds: int, repeats: int = 20) -> dict[str, list[float]]:
    """Samples per CPU-second, per round, of any-resolution tiling and video frame preparation."""
    import torch
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.llava_onevision.video_processing_llava_onevision import LlavaOnevisionVideoProcessor

    from megatron_ext.data.anyres import AnyresPreprocessor
    from megatron_ext.data.video import VideoPreprocessor, read_frames

    processor = LlavaNextImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    anyres = AnyresPreprocessor(processor)
    image = _photo(np.random.RandomState(0), 672, 672)
    hf = processor(images=[image], return_tensors="pt")["pixel_values"][0]
    assert hf.shape[0] == 5 and torch.equal(anyres([image])[0].pixel_values, hf)
    video = _video(work / "video.mp4")
    frames = VideoPreprocessor(LlavaOnevisionVideoProcessor())
    decoded = read_frames(video, 8)
    assert frames(decoded).shape == (8, 3, 384, 384)
    steps = {
        "672x672 -> 5 tiles at 336: HF LlavaNextImageProcessorPil": lambda: processor(images=[image], return_tensors="pt"),
        "672x672 -> 5 tiles at 336: megatron_ext.data.anyres (same pixel_values)": lambda: anyres([image]),
        "video 64 x 640x480 mpeg4 -> 8 frames (PyAV decode, uniform sampling)": lambda: read_frames(video, 8),
        "8 decoded frames -> OneVision pixel_values 8 x 384 (resize, normalize)": lambda: frames(decoded),
        "video -> 8 frames -> OneVision pixel_values 8 x 384 (decode + preprocess)": lambda: frames(read_frames(video, 8)),
    }
    rates = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            rates[name].append(_per_cpu_second(step, repeats))
    return {**rates, **hf_video_rates(work, decoded, rounds, repeats)}


def hf_video_rates(work: Path, decoded, rounds: int, repeats: int) -> dict[str, list[float]]:
    """HF's video processor and ours on the same frames, timed in one child process that has
    torchvision (tests/reference/torchvision_child)."""
    from tests.reference import torchvision_child

    if not torchvision_child.available():
        print(f"no torchvision at {torchvision_child.TORCHVISION_DIR} (scripts/setup_env.sh --dev puts it there): "
              "HF's video processor is not measured")
        return {}
    rates = torchvision_child.call("video_rates", work / "hf-video", timeout=1200, settings={}, frames=decoded,
                              rounds=rounds, repeats=repeats)
    return {"8 decoded frames -> 8 x 384: HF LlavaOnevisionVideoProcessor (torchvision, child process)": rates["hf"],
            "8 decoded frames -> 8 x 384: megatron_ext.data.video in that child (same pixel_values)": rates["ours"]}


def _tiles_report(rates: dict[str, list[float]]) -> list[str]:
    lines = ["## Any-resolution tiles and video frames (samples per CPU-second, one thread)", "",
             "Targets: >= 40 samples/s per core for 672x672 -> 5 tiles at 336, >= 20 for 8 video frames of 384; "
             "not slower than HF's processors.", "",
             "| step | median samples/s | rounds |", "|---|---:|---|"]
    lines += [f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{v:.0f}' for v in values)} |"
              for name, values in rates.items()]
    return lines + [""]


def length_stats(model_dir: Path, data: Path, samples: int) -> dict[str, float]:
    encoder = _encoder(model_dir, None, image_processing=False)
    it = iter(_task_loader(data, encoder, 0, 1))
    lengths = []
    for _ in range(samples):
        batch = next(it)
        lengths.append(int(batch.input_ids.shape[1]) + IMG_SEQ_LEN - 1)
    return {"mean": statistics.mean(lengths), "p50": statistics.median(lengths),
            "p90": float(np.percentile(lengths, 90)), "max": max(lengths), "min": min(lengths)}


def _machine() -> str:
    return (f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared with other jobs), no GPU, "
            f"Python {platform.python_version()}, torch {__import__('torch').__version__}, "
            f"megatron-energon {__import__('megatron.energon', fromlist=['__version__']).__version__}, "
            f"transformers {__import__('transformers').__version__} (no torchvision: HF's PIL image processors).")


def _report(args: dict, stats, tput: dict, costs: dict, efficiency: dict, packers: dict, tiles: dict) -> str:
    lines = ["# Data pipeline: task encoder throughput and packing efficiency", "", _machine(), "",
             f"Command: `python bench/data_bench.py {args}` (inputs described in its docstring). "
             f"Target: task encoder overhead <= 15% vs the bare decode loop; packing efficiency >= 95%.", "",
             f"Data: {stats['n']} LLaVA-like samples, 640x480 JPEG, CLIP-336 processor ({IMG_SEQ_LEN} image tokens), "
             f"combined length (text + image) mean {stats['mean']:.0f}, min {stats['min']}, p50 {stats['p50']:.0f}, "
             f"p90 {stats['p90']:.0f}, max {stats['max']}; sequence length {SEQ}; the tokenizer's chat template.", ""]
    for workers, results in tput.items():
        # With worker processes this process's CPU time does not include theirs.
        cpu = workers == 0
        bare = [statistics.median(v[i] for v in results["bare energon decode"]) for i in (0, 1)]
        lines += [f"## Throughput, {workers} loader worker(s), micro batch {MICRO_BATCH} (packing: 2 packed rows)", "",
                  "| pipeline | median samples/s (wall) | rounds (wall) | ratio to bare (wall) |"
                  + (" samples per CPU-second | ratio to bare (CPU) |" if cpu else ""),
                  "|---|---:|---|---:|" + ("---:|---:|" if cpu else "")]
        for name, values in results.items():
            wall, per_cpu = (statistics.median(v[i] for v in values) for i in (0, 1))
            row = f"| {name} | {wall:.1f} | {', '.join(f'{v[0]:.0f}' for v in values)} | {wall / bare[0]:.2f} |"
            lines.append(row + (f" {per_cpu:.1f} | {per_cpu / bare[1]:.2f} |" if cpu else ""))
        lines.append("")
    lines += ["## Per-sample cost of each step, outside the loader (CPU ms, one thread)", "",
              "| step | ms |", "|---|---:|"]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in costs.items()]
    lines.append("")
    lines += ["## Packing efficiency (non-padding fraction of the combined token grid)", "",
              "| batches | padded to longest row | padded to the sequence length (2048, or the packing length) |",
             "|---|---:|---:|"]
    lines += [f"| {name} | {a:.1%} | {b:.1%} |" for name, (a, b) in efficiency.items()]
    names = list(next(iter(packers.values())))
    lines += ["", f"## Packers compared ({PACKING_BUFFER}-sample buffers of the same length distribution)", "",
              "| packing length | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    lines += [f"| {capacity} | " + " | ".join(f"{fills[n]:.1%}" if n in fills else "" for n in names) + " |"
              for capacity, fills in packers.items()]
    lines += ["", *_tiles_report(tiles)]
    return "\n".join(lines)


@click.command()
@click.option("--samples", default=480, show_default=True, help="Samples in the generated dataset.")
@click.option("--rounds", default=5, show_default=True, help="Interleaved timing rounds per pipeline.")
@click.option("--workers", "workers_list", multiple=True, type=int, default=(0, 2), show_default=True)
@click.option("--out", default=str(REPO_ROOT / "bench" / "results" / "data.md"), show_default=True)
@click.option("--only", type=click.Choice(["all", "tiles"]), default="all", show_default=True,
              help="tiles: only the any-resolution tile and video frame rows.")
def main(samples, rounds, workers_list, out, only):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from megatron_ext.logs import setup_logging

    setup_logging()
    argv = " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        tiles = tile_rates(Path(tmp), rounds)
        if only == "tiles":
            text = "\n".join(["# Data pipeline: any-resolution tiles and video frames", "", _machine(), "",
                              f"Command: `python bench/data_bench.py {argv}`.", "", *_tiles_report(tiles)])
        else:
            model_dir, data = make_inputs(Path(tmp), samples)
            stats = length_stats(model_dir, data, min(samples, 200))
            stats["n"] = samples
            tput = {w: throughput(model_dir, data, w, rounds, min_samples=320) for w in workers_list}
            costs = component_costs(model_dir, Path(tmp) / "src")
            efficiency = packing_efficiency(model_dir, data, samples=3 * PACKING_BUFFER)
            packers = packer_comparison(model_dir)
            text = _report(argv, stats, tput, costs, efficiency, packers, tiles)
    Path(out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
