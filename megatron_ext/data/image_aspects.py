"""The image aspect modes (`--image-aspect`; what each does: `data.images`). Apart from that module
because the trainer's and evaluation's options offer them without importing torch or PIL."""

IMAGE_ASPECTS = ("crop", "pad", "resize")
