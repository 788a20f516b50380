"""The prepared OneVision mix the tiled training tests run on (tests/conftest.py's `tiled_mix`):
anyres images, multi-image samples, a video and text-only samples, plus bad ones."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SEQ = 256  # the sequence length the mix is made for: its long samples do not fit in it


def write_video(path: Path, frames: int = 6) -> None:
    """A 64 x 48 video that brightens frame by frame."""
    import av  # here, not at the top: the GPU tests import this module where PyAV is not installed

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=5)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(frames):
            pixels = np.full((48, 64, 3), 30 * i + 20, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def turns(question: str, answer: str) -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


def write_mix_json(src: Path) -> Path:
    """SRC/mix.json and its media: 12 good samples of every kind, 3 too long, 3 bad ones."""
    from megatron_ext.convert.compare import synthetic_image

    sizes = [(83, 50), (50, 117), (70, 60), (60, 70), (120, 40), (40, 40)]
    for i, size in enumerate(sizes):
        synthetic_image(i, size).save(src / f"{i}.png")
    write_video(src / "clip.mp4")
    (src / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(200))
    records = []
    for i in range(12):
        kind = i % 4
        if kind == 0:
            records.append({"id": f"one{i}", "image": f"{i % 6}.png", "conversations": turns("<image>\nWhat is it?", "Noise.")})
        elif kind == 1:
            records.append({"id": f"two{i}", "image": [f"{i % 6}.png", f"{(i + 1) % 6}.png"],
                            "conversations": turns("<image>\n<image>\nSame?", "No, different noise.")})
        elif kind == 2:
            # LLaVA-Video's JSON marks the video with <image>.
            records.append({"id": f"video{i}", "video": "clip.mp4", "conversations": turns("<image>\nWhat happens?", "It brightens.")})
        else:
            records.append({"id": f"text{i}", "conversations": turns("Say hi.", "Hi.")})
    records += [
        {"id": "broken", "video": "broken.mp4", "conversations": turns("<video>\nWhat happens?", "Nothing.")},
        {"id": "markers", "image": "0.png", "conversations": turns("<image>\n<image>\nTwo?", "One.")},
        {"id": "missing", "video": "absent.mp4", "conversations": turns("<video>\nWhat?", "Nothing.")},
    ]
    # Their image would start past the sequence length: skipped when trained on.
    records += [{"id": f"long{i}", "image": "1.png", "conversations": turns("lorem " * SEQ + "<image>", "Noise.")}
                for i in range(3)]
    path = src / "mix.json"
    path.write_text(json.dumps(records))
    return path
