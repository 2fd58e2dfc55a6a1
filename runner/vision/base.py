"""What every family's vision does with a prompt's images: their tags in the prompt's text, where
the chat template wrote the model's image marker (image_ids.py), and the rows their ids stand for,
made by the family's tower when a pass first runs them and kept for the next prompt.

A prompt's images are held (HELD of them, the least recently used let go) from when their tags
are placed until a pass needs their rows: a prefix the KV cache already holds (in memory or on
disk) never runs its image's tower at all.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nibble.formats.errors import FormatError, NibbleError
from nibble.formats.image import Picture
from ..kv.cache import Rows
from ..text.image_ids import key_of, split_ids, tag

HELD = 32   # images whose rows (or pixels, until they run) a model keeps


@dataclass
class _Held:
    picture: Picture
    count: int                        # its tokens
    rows: np.ndarray | None = None    # [count, hidden], once made


class Vision:
    """A family's vision: `marker`, the text its chat template writes where an image goes;
    `bidirectional`, whether an image's tokens see each other in the decoder; `count(picture)`,
    the tokens an image takes; `text(picture)`, what stands for it in the prompt (its tags, and
    the model's text around them: image_ids.tag); `pixels(picture)`, what its processor makes of it; `embed(pixels)`,
    their rows [count, hidden] in one pass of the tower."""
    marker: str
    bidirectional = False
    parts = False   # whether its chat template takes every message's content as a list of parts

    def __init__(self):
        self._held: OrderedDict[int, _Held] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def threads(self):
        """The tower's thread count, pass by pass (runner/threads.py)."""
        return self.tower.threads

    def count(self, picture: Picture) -> int:
        raise NotImplementedError

    def text(self, picture: Picture) -> str:
        return tag(picture.digest, self.count(picture))

    def pixels(self, picture: Picture) -> np.ndarray:
        raise NotImplementedError

    def embed(self, pixels: list[np.ndarray]) -> list[np.ndarray]:
        raise NotImplementedError

    def encode(self, pictures: list[Picture]) -> list[np.ndarray]:
        """The images' rows [count, hidden], float32, all in one pass of the tower."""
        return self.embed([self.pixels(p) for p in pictures])

    def place(self, text: str, pictures: Sequence[Picture]) -> str:
        """A rendered prompt with each image marker, in order, replaced by its image's text and
        tag; the images held until their rows are made."""
        parts = text.split(self.marker)
        if len(parts) - 1 != len(pictures):
            raise NibbleError(f"the prompt has {len(parts) - 1} image markers ({self.marker!r}) for "
                              f"{len(pictures)} images: the chat template wrote them so, or a message's "
                              f"text holds the marker")
        out = [parts[0]]
        for picture, after in zip(pictures, parts[1:]):
            self._hold(picture, self.count(picture))
            out += [self.text(picture), after]
        return "".join(out)

    def _hold(self, picture: Picture, count: int):
        key = key_of(picture.digest)
        with self._lock:
            if key not in self._held:
                self._held[key] = _Held(picture, count)
            self._held.move_to_end(key)
            while len(self._held) > HELD:
                self._held.popitem(last=False)

    def _get(self, key: int) -> _Held:
        with self._lock:
            held = self._held.get(key)
        if held is None:
            raise NibbleError(f"an image of this prompt is no longer held ({HELD} images came after it): "
                              f"send it again")
        return held

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Image ids -> their rows [len(ids), hidden] float32, the images not yet made run through
        the tower together."""
        keys, index = split_ids(ids)
        held = {int(k): self._get(int(k)) for k in np.unique(keys)}
        new = [h for h in held.values() if h.rows is None]
        if new:
            for h, rows in zip(new, self.encode([h.picture for h in new])):
                h.rows = rows
        if np.any(index >= np.array([held[int(k)].count for k in keys])):
            raise NibbleError("an image id past its image's tokens")
        return np.stack([held[int(k)].rows[i] for k, i in zip(keys, index)])

    def placed(self, tokens: np.ndarray, rows: Rows, ids: Sequence[Sequence[int]] | None) -> Rows:
        """A pass's rows as its model runs them: an image token of a bidirectional family sees to
        its image's last token (Rows.sees), every other token up to itself. `ids`: each
        sequence's ids (by rows.seq) up to its rows at least, for a vision whose rows turn by
        where earlier images were (None: no images before them)."""
        sees = rows.positions + 1
        image = tokens < 0
        if self.bidirectional and image.any():
            keys, index = split_ids(tokens[image])
            counts = np.array([self._get(int(k)).count for k in keys])
            sees[image] = rows.positions[image] - index + counts
        return rows._replace(sees=sees)


    def deep(self, tokens: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """What the first decoder layers add to a pass's image rows, each (the rows' indexes,
        what to add): none but for deepstack (Qwen3-VL)."""
        return []


def count_field(config: dict, name: str, default=None) -> int:
    """A vision_config's positive integer `name` (`default` where it is left out)."""
    value = config.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise FormatError(f"config.json: vision_config.{name} must be a positive integer, not {value!r}")
    return value


def for_template(vision: Vision | None, messages: Sequence[dict]) -> tuple[list[dict], list[Picture]]:
    """A conversation's messages as the model's template takes them, and their images (their
    content's {"type": "image", "image": Picture} parts), in order. A text model refuses images
    in one line; a vision whose template reads every content as a list of parts (`parts`:
    SmolVLM's) gets a string content as one text part."""
    pictures = [part["image"] for m in messages if isinstance(m.get("content"), list)
                for part in m["content"] if isinstance(part, dict) and part.get("type") == "image"]
    if pictures and vision is None:
        raise NibbleError("this model reads no images: choose a vision-language model (Gemma 3, SmolVLM) to ask about them")
    if vision is not None and vision.parts:
        messages = [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
                    for m in messages]
    return list(messages), pictures


def with_images(vision: Vision | None, text: str, pictures: Sequence[Picture]) -> tuple[str, frozenset[str]]:
    """A prompt rendered from messages holding `pictures` (for_template) with their tags placed
    (Vision.place), and the digests Tokenizer.encode is to turn into image ids; as it was, and
    none, without images."""
    if not pictures:
        return text, frozenset()
    return vision.place(text, pictures), frozenset(p.digest for p in pictures)
