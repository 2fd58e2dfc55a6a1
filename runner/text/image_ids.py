"""An image's tokens among a prompt's ids: ids below zero, each naming its image by the hash of its
pixels and its place among the image's tokens.

So a sequence's ids tell one image from another as they tell texts apart: the prefix cache, in
memory and on disk, reuses an image's keys and values only for the same pixels, and a chat that
keeps asking about one screenshot runs its tower once. A model's vision (runner/vision) makes the
rows these ids stand for.

In a prompt's text an image is a tag, `TAG_OPEN digest:start:count TAG_CLOSE` (its tokens
start.., several tags where the model's text runs between an image's tiles), which the vision
puts where the chat template wrote the model's image marker, and Tokenizer.encode turns into
`count` ids, only for the digests of the images the request brought (a tag typed in a message is
text).
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

INDEX_BITS = 24   # an image's tokens: up to 16 million
KEY_BITS = 38     # of its pixels' hash: 63 bits in all, an int64's
TAG_OPEN, TAG_CLOSE = "\ue000", "\ue001"   # Unicode's private use: no model's text
TAG = re.compile(f"{TAG_OPEN}([0-9a-f]{{32}}):([0-9]+):([0-9]+){TAG_CLOSE}")


def key_of(digest: str) -> int:
    """The image's key: the top KEY_BITS of the hash of its pixels (formats.image.Picture.digest)."""
    return int(digest, 16) >> (4 * len(digest) - KEY_BITS)


def image_ids(digest: str, count: int, start: int = 0) -> list[int]:
    """The ids of an image's `count` tokens from its token `start` on."""
    base = key_of(digest) << INDEX_BITS
    return [-1 - (base + k) for k in range(start, start + count)]


def split_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Image ids -> (their images' keys, each one's place among its image's tokens)."""
    code = -1 - np.asarray(ids, np.int64)
    return code >> INDEX_BITS, code & ((1 << INDEX_BITS) - 1)


def tag(digest: str, count: int, start: int = 0) -> str:
    """The text that stands for an image's `count` tokens from its token `start` on in a prompt."""
    return f"{TAG_OPEN}{digest}:{start}:{count}{TAG_CLOSE}"


def whole_images(ids: Sequence[int], start: int, end: int) -> int:
    """`end`, or past it to the end of the image it would cut: a pass runs an image's tokens
    together, as those of a model whose image tokens see each other must run. (An image's ids
    count down one by one.)"""
    if start < end:
        while end < len(ids) and ids[end - 1] < 0 and ids[end] == ids[end - 1] - 1:
            end += 1
    return end
