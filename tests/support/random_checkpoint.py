"""A Hub-style HF LLaVA checkpoint with random weights for a published config.json, at full size,
for measuring the converters on models too big to build in memory.

The directory holds what a download has: the config as given (sparse, as the Hub has it; its dtype
fields name the weights' dtype), the weights under the names and shapes `save_pretrained` writes
(tied copies once) in one dtype, in `model-0000i-of-0000N.safetensors` shards of at most
`max_shard_bytes` with their index (one `model.safetensors` when they fit in one), a
tokenizer (the local one of `demo.tiny_models`: the config keeps its published vocabulary) and the
tower family's image processor. Tensors are made and written one at a time (`ShardWriter`), so
memory holds about two of them whatever the model's size.

Values: normal with the text config's `initializer_range` (norm weights: one plus that), taken as
windows at seeded random offsets of one pool of normal samples. Drawing each value costs more
than writing it (torch draws 10-200 M values/s on one core), so 7 B draws would take longer than
writing their 14 GB; a window costs a copy, and the whole takes about as long as writing the files.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from megatron_ext.convert.hf_checkpoint import CONFIG_FILE, ShardWriter, TensorSpec, hf_model_names, meta_hf_model
from megatron_ext.convert.mapping import normalize_hf_name
from megatron_ext.errors import UserError
from megatron_ext.families import read_llava, vision_family
from megatron_ext.fsutil import atomic_output_dir

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Normal samples the values are windows of; a tensor larger than the pool is several windows.
POOL_SIZE = 1 << 22
# Integers of each dtype's size, whose arrays numpy copies.
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _with_layers(config: dict, layers: int) -> dict:
    """The config with `layers` text layers (and Qwen2's sliding-window layer count kept within them)."""
    if layers < 1:
        raise UserError(f"layers {layers} must be at least 1")
    config = copy.deepcopy(config)
    text = config.setdefault("text_config", {})
    text["num_hidden_layers"] = layers
    if "max_window_layers" in text:
        text["max_window_layers"] = min(text["max_window_layers"], layers)
    return config


def _with_dtype(config: dict, dtype: str) -> dict:
    """The config naming the weights' dtype wherever it names one (the published one may be float16)."""
    config = copy.deepcopy(config)
    for part in (config, config.get("text_config", {}), config.get("vision_config", {})):
        for key in ("torch_dtype", "dtype"):
            if key in part:
                part[key] = dtype
    return config


class _Values:
    """Tensors of random values from one seeded pool. Windows are copied as raw bits with numpy,
    which fills new tensors two to four times as fast as torch's slice assignment here."""

    def __init__(self, std: float, dtype: torch.dtype, seed: int):
        self.generator = torch.Generator().manual_seed(seed)
        pool = (torch.randn(POOL_SIZE, generator=self.generator) * std).to(dtype)
        # Doubled, so that any window of up to POOL_SIZE values is one slice.
        self.bits = torch.cat([pool, pool]).view(_BITS[dtype]).numpy()

    def make(self, spec: TensorSpec) -> torch.Tensor:
        import numpy as np

        bits = np.empty(torch.Size(spec.shape).numel(), dtype=self.bits.dtype)
        offsets = torch.randint(POOL_SIZE, (-(-bits.size // POOL_SIZE),), generator=self.generator).tolist()
        for start, offset in zip(range(0, bits.size, POOL_SIZE), offsets):
            end = min(start + POOL_SIZE, bits.size)
            bits[start:end] = self.bits[offset:offset + end - start]
        tensor = torch.from_numpy(bits).view(spec.dtype).view(spec.shape)
        if len(spec.shape) == 1 and "norm" in spec.name and spec.name.endswith(".weight"):
            tensor += 1  # a scale: near one, as trained norms are
        return tensor


def _write_tokenizer_side(vision_config, out: Path) -> None:
    """The local tokenizer, and the tower family's image processor at the tower's image size."""
    from megatron_ext.demo.tiny_models import TinyTextSpec, train_tokenizer

    size = vision_config.image_size
    train_tokenizer(TinyTextSpec.vocab_size).save_pretrained(out)
    processor = vision_family(vision_config.model_type).image_processor(size[0] if isinstance(size, (list, tuple)) else size)
    processor.save_pretrained(out)


def write_random_checkpoint(config: dict, out_dir: str | Path, dtype: str = "bfloat16", max_shard_bytes: float = 5e9,
                            seed: int = 0, layers: int | None = None) -> Path:
    """Write the checkpoint of `config` (a published config.json's contents; `layers`: that many
    text layers instead) into `out_dir`, which must not exist or be empty; returns its path."""
    if not isinstance(config, dict):
        raise UserError(f"the config is a JSON {type(config).__name__}, not an object; give a LLaVA config.json")
    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r} is not supported (supported: {', '.join(DTYPES)})")
    if max_shard_bytes <= 0:
        raise UserError(f"max_shard_bytes {max_shard_bytes} must be positive")
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty directory; give a new one for the random checkpoint")
    config = _with_dtype(_with_layers(config, layers) if layers is not None else config, dtype)
    read_llava(config)  # what the converters refuse, refused here in one line before anything is written
    model = meta_hf_model(config)
    shapes = {normalize_hf_name(name): tuple(t.shape) for name, t in model.state_dict().items()}
    planned = [TensorSpec(name, shapes[name], DTYPES[dtype]) for name in hf_model_names(config)]
    values = _Values(float(model.config.text_config.initializer_range), DTYPES[dtype], seed)
    with atomic_output_dir(out) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        writer = ShardWriter(tmp, int(max_shard_bytes), planned)
        for spec in planned:
            writer.add(spec.name, values.make(spec))
        writer.close()
        _write_tokenizer_side(model.config.vision_config, tmp)
    return out
