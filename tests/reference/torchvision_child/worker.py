"""python worker.py REQUESTS.pt RESULTS.pt: tasks of tests/reference/torchvision_child, with torchvision (see there)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch


def _torchvision_ops_or_schemas():
    """torchvision's compiled ops where they load (beside a CUDA torch: declaring `nms` again would
    abort the process), else the two op schemas it registers fake kernels for (never called)."""
    folder = Path(importlib.util.find_spec("torchvision").submodule_search_locations[0])
    try:
        torch.ops.load_library(next(folder.glob("_C*.so")))
        return None
    except OSError:
        schemas = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            schemas.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        return schemas  # kept: the schemas live as long as the Library object


_schemas = _torchvision_ops_or_schemas()

import torchvision  # noqa: E402,F401  (after the ops or schemas it registers fake kernels for)
import transformers  # noqa: E402

# Every task compares with transformers as it runs where torchvision is installed.
assert transformers.utils.is_torchvision_available(), "transformers does not see torchvision"


def video_processor(settings: dict, videos: list, cpu_capability: str | None = None) -> dict:
    """OneVision's video processor of `settings` on uint8 [n, H, W, 3] videos."""
    real_capability = torch.backends.cpu.get_cpu_capability
    if cpu_capability is not None:
        torch.backends.cpu.get_cpu_capability = lambda: cpu_capability
    try:
        processor = transformers.LlavaOnevisionVideoProcessor(**settings)
        return {"pixel_values_videos": [processor(videos=[v], return_tensors="pt")["pixel_values_videos"][0] for v in videos]}
    finally:  # the next task of a batch runs on the real CPU
        torch.backends.cpu.get_cpu_capability = real_capability


def qwen_video_processor(family: str, settings: dict, videos: list) -> dict:
    """Qwen2.5-VL's (`family` "qwen2_vl") or Qwen3-VL's ("qwen3_vl") video processor of `settings`
    on uint8 [n, H, W, 3] videos, each processed alone."""
    classes = {"qwen2_vl": "Qwen2VLVideoProcessor", "qwen3_vl": "Qwen3VLVideoProcessor"}
    processor = getattr(transformers, classes[family])(**settings)
    outputs = [processor(videos=[torch.from_numpy(v).permute(0, 3, 1, 2)], return_tensors="pt") for v in videos]
    return {key: [o[key] for o in outputs] for key in ("pixel_values_videos", "video_grid_thw")}


def saved_processor(hf_dir: str, messages: list, images: list, videos: list) -> dict:
    """What `AutoProcessor.from_pretrained(hf_dir)` is and gives for a chat about images and videos,
    with the images through the PIL-backend image processor, as this project's images are (with
    torchvision, transformers picks the torchvision one, whose resize differs by a few levels)."""
    processor = transformers.AutoProcessor.from_pretrained(hf_dir)
    loaded = {"class": type(processor).__name__, "image_processor": type(processor.image_processor).__name__,
              "video_processor": type(processor.video_processor).__name__,
              "video_settings": processor.video_processor.to_dict()}
    processor.image_processor = transformers.AutoImageProcessor.from_pretrained(hf_dir, backend="pil")
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    batch = processor(text=text, images=images or None, videos=videos or None, return_tensors="pt")
    return {**loaded, "text": text, **batch}


def build_llava(save_dir: str, **options) -> dict:
    """The processor_config.json `megatron_ext.hf.build_llava` writes where torchvision is installed."""
    import json
    from pathlib import Path

    from megatron_ext.hf.build_llava import build_llava as build

    return json.loads((Path(build(save_dir, **options)) / "processor_config.json").read_text())


def our_processor(hf_dir: str, images: list) -> dict:
    """What `megatron_ext.hf.processors.load_processor` gives where torchvision is installed."""
    from megatron_ext.hf.processors import load_processor

    processor = load_processor(hf_dir, "--hf-dir")
    return {"image_processor": type(processor.image_processor).__name__,
            "pixel_values": processor.image_processor(images=images, return_tensors="pt")["pixel_values"]}


def video_rates(settings: dict, frames, rounds: int, repeats: int) -> dict[str, list[float]]:
    """Samples per CPU-second of OneVision's video processor and of megatron_ext's VideoPreprocessor
    on the same frames, rounds interleaved (bench/data_bench.py)."""
    from bench.data_bench import _per_cpu_second
    from megatron_ext.data.video import VideoPreprocessor

    processor = transformers.LlavaOnevisionVideoProcessor(**settings)
    ours = VideoPreprocessor(processor)
    assert torch.equal(ours(frames), processor(videos=[frames], return_tensors="pt")["pixel_values_videos"][0])
    steps = {"hf": lambda: processor(videos=[frames], return_tensors="pt"), "ours": lambda: ours(frames)}
    rates = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            rates[name].append(_per_cpu_second(step, repeats))
    return rates


if __name__ == "__main__":
    tasks = {"video_processor": video_processor, "qwen_video_processor": qwen_video_processor, "saved_processor": saved_processor, "build_llava": build_llava,
             "our_processor": our_processor, "video_rates": video_rates}
    requests = torch.load(sys.argv[1], weights_only=False)
    torch.save([tasks[request.pop("task")](**request) for request in requests], sys.argv[2])
