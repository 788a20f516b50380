"""Host work to lay out a packed micro batch for the model: `model.inputs.ModelInputs`, 2 x 4096
positions of LLaVA-1.5-like samples (one 576-position image each, 30-435 text tokens).

    python bench/inputs_bench.py [--repeat 200]

The model's device is `meta` here: tensors sent there and masks built there cost the host their
dispatch, no device time, as a GPU's asynchronous copies and kernel launches do. Meta runs some
shape functions in Python (torch.where, cumsum: ~0.5 ms each here), far slower than a CUDA launch,
so the device-side layouts' times are upper bounds; the torch calls they make are counted too.
Measured:
- "THD": two micro batches of one packed row each (te/sdpa): boundaries read from the host tokens,
  cu_seqlens sent to the device;
- "rows": one micro batch of two packed rows (sdpa rows, local): the block mask built on the device;
- "host mask (before)": the same mask built on the host, as the trainer did before (its time is
  what the GPU waited for).
Prints a Markdown table, then a JSON line (median microseconds per micro-batch layout).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

IMAGE_TOKEN, IMG_SEQ_LEN, SEQ = 32000, 576, 4096


def packed_row(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and segment_ids of one row packed to at most SEQ combined positions."""
    ids, segments, used, number = [], [], 0, 1
    while True:
        text = int(torch.randint(30, 436, (1,), generator=gen))
        if used + text + IMG_SEQ_LEN > SEQ:
            break
        sample = torch.randint(0, 32000, (text + 1,), generator=gen)
        sample[1] = IMAGE_TOKEN
        ids.append(sample)
        segments.append(torch.full((text + 1,), number))
        used, number = used + text + IMG_SEQ_LEN, number + 1
    return torch.cat(ids), torch.cat(segments)


def batch(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    segment_ids = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (ids, segments) in enumerate(rows):
        input_ids[r, : len(ids)], segment_ids[r, : len(ids)] = ids, segments
    images = torch.zeros(int((input_ids == IMAGE_TOKEN).sum()), 3, 1, 1)  # the images' size is not the point
    return {"input_ids": input_ids, "segment_ids": segment_ids, "labels": input_ids, "loss_mask": input_ids.float(),
            "images": images}


def torch_calls(func) -> int:
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, f, types, args=(), kwargs=None):
            Count.calls += 1
            return f(*args, **(kwargs or {}))

    with Count():
        func()
    return Count.calls


def median_us(func, repeat: int) -> float:
    func()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        func()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


@click.command()
@click.option("--repeat", default=200, show_default=True)
def main(repeat: int):
    from megatron_ext.model.inputs import ModelInputs
    from megatron_ext.model.packed_sequences import packed_attention_mask

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    rows = [packed_row(gen), packed_row(gen)]
    two_rows, one_row_each = batch(rows), [batch([row]) for row in rows]
    inputs = dict(image_token_index=IMAGE_TOKEN, img_seq_len=IMG_SEQ_LEN, seq_length=SEQ, pipeline_parallel=False,
                  dtype=torch.bfloat16, device=torch.device("meta"))
    thd, dense = ModelInputs(backend="sdpa", **inputs), ModelInputs(backend="local", **inputs)
    length = dense.combined_length(two_rows["input_ids"])
    layouts = {
        "THD (2 micro batches x 1 row)": lambda: [thd(b) for b in one_row_each],
        "rows (1 micro batch x 2 rows), mask on the device": lambda: dense(two_rows),
        "host mask (before)": lambda: packed_attention_mask(
            two_rows["input_ids"], two_rows["segment_ids"], IMAGE_TOKEN, IMG_SEQ_LEN, length),
    }
    results = {name: median_us(func, repeat) for name, func in layouts.items()}
    samples = int(two_rows["segment_ids"].max(1).values.sum())
    print(f"{samples} samples, {length} positions per row, median of {repeat}\n")
    print("| layout of 2 x 4096 positions | host work (µs) | torch calls |\n|---|---:|---:|")
    for name, func in layouts.items():
        print(f"| {name} | {results[name]:.0f} | {torch_calls(func)} |")
    print(json.dumps({"median_us": results}))


if __name__ == "__main__":
    main()
