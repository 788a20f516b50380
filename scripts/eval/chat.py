"""Chat about an image or a video in the terminal with a Megatron or Hugging Face LLaVA checkpoint.

    python scripts/eval/chat.py --megatron-dir D --image cat.jpg
    python scripts/eval/chat.py --megatron-dir D --video clip.mp4 --video-frames 16   # LLaVA-OneVision
    torchrun --nproc-per-node 2 scripts/eval/chat.py --megatron-dir D --tp 2 --image cat.jpg

Type a message and press Enter; /image PATH or /video PATH switches to another image or video
(new conversation), /reset forgets the conversation, /exit quits.
"""

from megatron_ext.commands.eval import chat
from megatron_ext.errors import run_command

if __name__ == "__main__":
    run_command(chat)
