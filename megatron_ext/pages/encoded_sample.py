"""One sample put through the trainer's task encoder, read back for the page: its tokens with the
role of the message each comes from and whether it is trained, its images and videos as the
model gets them, and its counts.

A conversation is one sequence. A preference pair is one encoded sample of two (`data.pairs`): the
prompt with the chosen answer, then with the rejected one; both use the pair's media, which the
page shows once.

Nothing here recomputes what the encoder decides: ids, loss mask, truncation, tiles and media rows
are the encoder's own (`preencode_sample`, `postencode_sample`); this module only lines them up
with the roles of the rendered messages. A token is marked trained when the model learns to
predict it: position t's loss mask is 1 when token t + 1 is trained, so the marked tokens are as
many as the loss mask's sum. What truncation cut is the rest of the rendered chat.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from megatron_ext.data.pairs import PairTaskEncoder
from megatron_ext.data.shard_format import conversation_of, preference_of, videos_of
from megatron_ext.data.task_encoder import LlavaTaskEncoder
from megatron_ext.model import tiling
from megatron_ext.pages.sample_sources import skip_reason

IMAGE, VIDEO = "image", "video"
ADDED = "added"  # a token the tokenizer adds itself (a BOS in front, an EOS), in no message
CHOSEN, REJECTED = "chosen", "rejected"  # a pair's sequences, in the encoder's order
_UNFINISHED = "\ufffd"  # what a tokenizer decodes the first bytes of a character to
_MOST_TOKENS_PER_CHARACTER = 4  # UTF-8 bytes in one character: byte tokens beyond that are text of their own


@dataclass(frozen=True)
class Piece:
    """A token of the sample, or one image / video as a block of its positions."""

    text: str
    role: str  # the message's role, ADDED, or IMAGE / VIDEO for a block
    trained: bool = False
    cut: bool = False  # truncation dropped it
    media: int | None = None  # index into `Inspected.media` for a block
    positions: int = 1
    tokens: int = 1  # text tokens it shows: several where byte-level BPE splits a character over them
    pair: int | None = None  # a block of one frame pair of a video whose pairs are runs of their own (1-based)


class Run(NamedTuple):
    """One run of media positions in the text: which of the sample's media (index into
    `Inspected.media`), how many positions, and which frame pair (1-based) where each of a video's
    pairs is a run of its own (Qwen3-VL's)."""

    media: int
    positions: int
    pair: int | None = None


@dataclass
class ShownMedia:
    """An image or a video of the sample: the original and what the model gets."""

    kind: str  # IMAGE or VIDEO
    number: int  # 1-based among the sample's images (or videos)
    positions: int  # language-model positions it expands to
    original: object  # PIL image, or uint8 frames [n, H, W, 3] as sampled from the video
    tiles: np.ndarray  # uint8 [n, H, W, 3] rendered back from the pixel values
    row: tiling.Media | None = None  # its media-layout row (tiled models)
    times: list[float] | None = None  # a video's sampled frames (a native-resolution one's frame pairs), seconds
    grid: NativeGrid | None = None  # a native-resolution model's patch grid
    # A video whose frame pairs the text times and separates (Qwen3-VL): each pair's time as the text
    # writes it and its positions (the pads of its run).
    timed_pairs: list[tuple[str, int]] | None = None


@dataclass(frozen=True)
class NativeGrid:
    """A native-resolution image's (video's) grid_thw and how its patches merge into tokens."""

    t: int  # frame pairs (1 for an image)
    h: int  # patches down
    w: int  # patches across
    patch: int  # pixels per patch side
    merge: int  # patches per merged token side

    @property
    def tokens(self) -> int:
        """Merged tokens: its pad tokens in the text."""
        return self.t * self.h * self.w // self.merge**2


@dataclass
class Sequence:
    """One sequence of an encoded sample: a conversation, or a pair's prompt with one answer."""

    name: str  # "" for a conversation, else CHOSEN or REJECTED
    text_tokens: int  # kept tokens that are not image or video features
    trained_tokens: int
    image_positions: int
    pieces: list[Piece] = field(default_factory=list)  # of a shown sample; the others are only counted

    @property
    def positions(self) -> int:
        return self.text_tokens + self.image_positions

    @property
    def cut(self) -> list[Piece]:
        return [p for p in self.pieces if p.cut]


@dataclass
class Inspected:
    index: int
    key: str
    shown: bool
    skip_reason: str = ""  # why the trainer would skip it ("" when it trains on it)
    skip_detail: str = ""
    record_id: str = ""  # the input record's "id"
    sequences: list[Sequence] = field(default_factory=list)
    media: list[ShownMedia] = field(default_factory=list)  # of a shown sample, once for all its sequences
    images: int = 0
    truncated: bool = False
    packable: object = None  # with packing: the encoded sample, its pixels dropped

    @property
    def text_tokens(self) -> int:
        return sum(s.text_tokens for s in self.sequences)

    @property
    def trained_tokens(self) -> int:
        return sum(s.trained_tokens for s in self.sequences)

    @property
    def image_positions(self) -> int:
        return sum(s.image_positions for s in self.sequences)

    @property
    def positions(self) -> int:
        return self.text_tokens + self.image_positions


class SampleReader:
    """Puts samples through `encoder` and reads the results back (`read`)."""

    def __init__(self, encoder: LlavaTaskEncoder, arch, pixels):
        """`pixels`: a `media_views.PixelsBack` for this encoder's processors."""
        self.encoder = encoder
        self.pairs = isinstance(encoder, PairTaskEncoder)
        self.arch = arch
        self.pixels = pixels
        self.tokenizer = encoder.chat.tokenizer
        self.media_tokens = self._media_tokens()

    def _media_tokens(self) -> set[int]:
        tokens = {self.arch.image_token_index}
        if self.encoder.media is not None and self.encoder.media.video_token is not None:
            tokens.add(self.encoder.media.video_token)
        return tokens

    @property
    def expanded(self) -> bool:
        """The encoder's ids hold each image's every position (tiled), not one token (LLaVA-1.5)."""
        return self.encoder.media is not None

    @property
    def tiled(self):
        """The encoder's `anyres.FeatureLayout` (tiled models), for drawing grids, else None."""
        return self.encoder.media.layout if self.encoder.media is not None else None

    @property
    def row_capacity(self) -> int:
        """Positions a packed row holds."""
        return self.encoder.layout.max_length

    def packed_length(self, encoded) -> int:
        """Positions an encoded sample takes in a packed row, alignment padding left out."""
        return self.encoder.layout.combined_length(encoded) - sum(encoded.pads)

    def read(self, index: int, key: str, shown: bool, sample) -> Inspected:
        found = Inspected(index, key, shown, record_id=getattr(sample, "record_id", ""))
        try:
            encoded = self.encoder.preencode_sample(sample)
        except Exception as exc:  # energon's error handler skips a sample for any error; so does the page
            found.skip_reason, found.skip_detail = skip_reason(exc)
            return found
        if self.encoder.packing:
            found.packable = self._packable(encoded)
        self._fill(found, sample, encoded)
        return found

    def _packable(self, encoded):
        packable = copy.copy(encoded)
        packable.images = [None] * len(encoded.images)  # packing reads how many, not their pixels
        return packable

    def _fill(self, found: Inspected, sample, encoded) -> None:
        """`found`'s sequences, counts and (shown) media from the encoder's sample `encoded`."""
        shown = found.shown
        conversations, videos = self._conversations(sample)
        # Each sequence holds the sample's media in turn (a pair's two: the same prompt's): PIL
        # images (LLaVA-1.5) or one MediaGroup (tiled) before postencode, and their media rows.
        sources = encoded.images[:len(encoded.images) // len(conversations)]
        rows = encoded.media[:len(encoded.media) // len(conversations)]
        positions = self._positions(rows, len(sources))
        # The sequences follow one another, each with its alignment padding.
        starts = np.cumsum([0] + [n + pad for n, pad in zip(encoded.lengths, encoded.pads)])
        for (name, messages), start, kept in zip(conversations, starts, encoded.lengths):
            ids = encoded.input_ids[start:start + kept].numpy()
            loss_mask = encoded.loss_mask[start:start + kept].numpy() > 0
            # Truncation never cuts an image or video, so all of them are in `positions`.
            sequence = Sequence(name, int(kept - np.isin(ids, list(self.media_tokens)).sum()), int(loss_mask.sum()),
                                sum(positions))
            if shown:
                sequence.pieces = self._pieces(messages, kept, loss_mask, [Run(i, n) for i, n in enumerate(positions)])
            found.sequences.append(sequence)
        found.images = len(sources) if self.encoder.media is None else sum(r.kind == tiling.IMAGE for r in rows)
        found.truncated = bool(encoded.num_truncated)
        if shown:
            # [3, H, W] tensors: the tiles of every medium in token order (a pair's once)
            processed = self.encoder.postencode_sample(encoded).images
            tiles = torch.stack(processed) if processed else None
            found.media = self._media(videos, sources, rows, tiles, positions)

    def _conversations(self, sample) -> tuple[list[tuple[str, list[dict]]], list]:
        """(the sample's sequences as (name, chat messages), as the encoder renders them; its videos)."""
        if self.pairs:
            _, prompt, chosen, rejected = preference_of(sample)
            return [(name, [*prompt, {"role": "assistant", "content": answer}])
                    for name, answer in ((CHOSEN, chosen), (REJECTED, rejected))], sample.videos
        _, messages = conversation_of(sample)
        return [("", messages)], videos_of(sample)

    def _positions(self, rows: list[tiling.Media], images: int) -> list[int]:
        """Positions of each image / video in token order: its features (tiled), else img_seq_len."""
        if self.encoder.media is None:
            return [self.arch.img_seq_len] * images
        layout = self.encoder.media.layout
        return [tiling.feature_count(row, layout.tiling, layout.tile, layout.side) for row in rows]

    def _pieces(self, messages: list[dict], kept: int, loss_mask: np.ndarray, runs: list[Run]) -> list[Piece]:
        """The whole rendered chat as pieces, each run of media tokens (`runs`, in text order) one
        block; the encoder's ids are these tokens with the media expanded, of which it kept the
        first `kept` (truncation)."""
        roles = [ADDED if r is None else messages[r]["role"] for r in self.encoder.chat.token_roles(messages)]
        chat_ids, _ = self.encoder.chat.encode(messages)
        pieces, at, blocks, text = [], 0, iter(runs), []
        for token, role in zip(chat_ids, roles):
            if token in self.media_tokens:
                pieces += self._text_pieces(text)
                text = []
                run = next(blocks)
                kind = VIDEO if token != self.arch.image_token_index else IMAGE
                pieces.append(Piece(kind, kind, cut=at >= kept, media=run.media, positions=run.positions, pair=run.pair))
                at += run.positions if self.expanded else 1
                continue
            trained = 0 < at < kept and bool(loss_mask[at - 1])
            text.append((int(token), role, trained, at >= kept))
            at += 1
        return pieces + self._text_pieces(text)

    def _text_pieces(self, tokens: list[tuple[int, str, bool, bool]]) -> list[Piece]:
        """(token, role, trained, cut) as pieces of whole characters: where byte-level BPE splits a
        character (Japanese, Chinese, emoji) over tokens, one piece shows it for all of them, as
        decoding them one by one gives only U+FFFD."""
        pieces, start = [], 0
        for end in range(1, len(tokens) + 1):
            text = self.tokenizer.decode([token for token, *_ in tokens[start:end]])
            alike = end < len(tokens) and tokens[end][1:] == tokens[start][1:]
            if alike and text.endswith(_UNFINISHED) and end - start < _MOST_TOKENS_PER_CHARACTER:
                continue
            pieces.append(Piece(text, *tokens[start][1:], tokens=end - start))
            start = end
        return pieces

    def _media(self, videos: list, sources: list, rows: list, tiles, positions: list[int]) -> list[ShownMedia]:
        if not sources:  # a text-only conversation
            return []
        if self.encoder.media is None:  # LLaVA-1.5: one tile per image
            return [ShownMedia(IMAGE, i + 1, count, image, self.pixels.image(tile[None]))
                    for i, (image, tile, count) in enumerate(zip(sources, tiles, positions))]
        from megatron_ext.data.video import sampled_frame_times

        group = sources[0]
        images, videos = iter(group.images), iter(zip(group.videos, videos))
        shown, start, numbers = [], 0, {IMAGE: 0, VIDEO: 0}
        for row, count in zip(rows, positions):
            own = tiles[start:start + row.tiles]
            start += row.tiles
            if row.kind == tiling.IMAGE:
                numbers[IMAGE] += 1
                shown.append(ShownMedia(IMAGE, numbers[IMAGE], count, next(images), self.pixels.image(own), row))
            else:
                numbers[VIDEO] += 1
                frames, video = next(videos)
                shown.append(ShownMedia(VIDEO, numbers[VIDEO], count, frames, self.pixels.video(own), row,
                                        sampled_frame_times(video, self.encoder.media.video_frames)))
        return shown
