"""Hugging Face checkpoint directories, read and written one tensor at a time.

Reading: a single `model.safetensors` or a sharded `model.safetensors.index.json`; tensor names are
normalized (`mapping.normalize_hf_name`) and every read opens the file, copies one tensor out and
unmaps it, so a converter never holds more than the tensor it is working on.

Writing: `ShardWriter` collects tensors up to a size limit, writes each shard as soon as it is
full and names the files the way `transformers` does, with an index when there is more than one.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path

import torch

from megatron_ext.convert.mapping import normalize_hf_name
from megatron_ext.errors import UserError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# safetensors dtype codes -> ModelOptions dtype names.
_FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# What makes up the model itself. Everything else in an HF directory (tokenizer, processor, chat
# template, generation config) describes the tokenizer side and travels with it.
_MODEL_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth",
                "*.ckpt", "*.h5", "*.msgpack", CONFIG_FILE)
# A directory holds a tokenizer when one of these is present.
_TOKENIZER_MARKERS = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


def read_config(hf_dir: Path, flag: str) -> dict:
    path = Path(hf_dir) / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"{flag} {hf_dir} has no {CONFIG_FILE}; give the directory of a Hugging Face LLaVA checkpoint")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{flag}: {path} is not valid JSON ({exc})") from exc


class HfWeights:
    """The tensors of an HF safetensors checkpoint, by normalized name."""

    def __init__(self, hf_dir: str | Path, flag: str = "--hf-dir"):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        self._where: dict[str, tuple[Path, str]] = {}
        self._dtypes: dict[str, str] = {}
        self.nbytes = 0
        for file in self._files(flag):
            with safe_open(str(file), "pt") as f:
                for stored in f.keys():
                    name = normalize_hf_name(stored)
                    if name in self._where:
                        raise UserError(f"{flag}: tensor {name} appears twice in {self.dir} (as {self._where[name][1]} and {stored})")
                    self._where[name] = (file, stored)
                    self._dtypes[name] = f.get_slice(stored).get_dtype()
            self.nbytes += file.stat().st_size

    def _files(self, flag: str) -> list[Path]:
        index = self.dir / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({self.dir / name for name in weight_map.values()})
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise UserError(f"{flag}: {index} lists files that do not exist: {', '.join(missing)}")
            return files
        if (self.dir / WEIGHTS_FILE).is_file():
            return [self.dir / WEIGHTS_FILE]
        if any(self.dir.glob("*.bin")):
            raise UserError(f"{flag} {self.dir} holds PyTorch .bin weights; re-save it as safetensors "
                            "(LlavaForConditionalGeneration.from_pretrained(d).save_pretrained(d2))")
        raise UserError(f"{flag} {self.dir} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file, stored = self._where[name]
        with safe_open(str(file), "pt") as f:
            return f.get_tensor(stored)

    def dtype(self, flag: str = "--hf-dir") -> str:
        """The one floating-point dtype of the weights, as a ModelOptions dtype name."""
        found = {code for code in self._dtypes.values() if code.startswith(("F", "BF"))}
        unsupported = found - set(_FLOAT_DTYPES)
        if unsupported:
            raise UserError(f"{flag}: weights of dtype {', '.join(sorted(unsupported))} are not supported "
                            f"(supported: {', '.join(_FLOAT_DTYPES.values())})")
        if len(found) != 1:
            raise UserError(f"{flag}: the weights mix dtypes ({', '.join(sorted(found))}); Megatron holds one dtype, "
                            "so the conversion could not be exact. Re-save the model in one dtype first")
        return _FLOAT_DTYPES[found.pop()]


def hf_model_names(hf_config: dict) -> list[str]:
    """The tensor names `transformers` saves for this LLaVA config (tied copies once), normalized."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    with torch.device("meta"):
        model = LlavaForConditionalGeneration(LlavaConfig.from_dict(hf_config))
    unique = {name for name, _ in model.named_parameters()}
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - unique
    return [normalize_hf_name(name) for name in model.state_dict() if name not in tied]


class ShardWriter:
    """Writes tensors into safetensors files of at most `max_shard_size` bytes, as they come."""

    def __init__(self, out_dir: Path, max_shard_size: int):
        self.out_dir = Path(out_dir)
        self.max_shard_size = max_shard_size
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_size:
            self._flush()
        self._pending[name] = tensor.detach().contiguous()
        self._pending_bytes += size
        self.total_size += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self._pending, str(self._shard_path(len(self._shards))), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def _shard_path(self, index: int) -> Path:
        return self.out_dir / f".shard-{index:05d}.safetensors"

    def close(self) -> list[str]:
        """Write the last shard, give the files their final names; returns the tensor names written."""
        if self._pending or not self._shards:
            self._flush()
        count = len(self._shards)
        if count == 1:
            self._shard_path(0).rename(self.out_dir / WEIGHTS_FILE)
            return self._shards[0]
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            self._shard_path(i).rename(self.out_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return list(weight_map)


def check_tokenizer_dir(path: Path, flag: str) -> Path:
    path = Path(path).expanduser().resolve()
    if not path.is_dir() or not any((path / marker).is_file() for marker in _TOKENIZER_MARKERS):
        raise UserError(f"{flag} {path} holds no tokenizer (none of {', '.join(_TOKENIZER_MARKERS)}); "
                        "give the directory of the HF model or its tokenizer")
    return path


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer, processor, chat template and generation config of an HF directory."""
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for file in sorted(Path(src).iterdir()):
        if file.is_file() and not any(fnmatch.fnmatch(file.name, pattern) for pattern in _MODEL_FILES):
            shutil.copy2(file, dst / file.name)
            copied.append(file.name)
    return copied
