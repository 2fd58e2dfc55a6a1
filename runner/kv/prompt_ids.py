"""A prompt's ids, as the KV cache holds them: remembered ids for the texts seen before.

A sampled reply is not always the tokenization its text gets again (BPE has one canonical split,
sampling may pick another), and a conversation's next prompt contains the reply as text. Encoded
afresh, it would part from the cached ids inside the reply, and everything after would run again.
So the ids behind recent prompts and replies are remembered with their text, and a new prompt
that starts with one of those texts starts with its ids; only the rest is tokenized.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from ..text.image_ids import TAG, TAG_OPEN
from ..text.tokenizer import Tokenizer

MEMO_SIZE = 64   # texts remembered: a few per conversation that is still going on


class PromptMemo:
    """An LRU of (text -> the ids that spell it), shared by every conversation of a model.

        ids = memo.encode(prompt_text)
        ... reply ...
        memo.remember(prompt_text + reply_text, ids + reply_ids)
    """

    def __init__(self, tokenizer: Tokenizer, size: int = MEMO_SIZE):
        self.tokenizer = tokenizer
        self.size = size
        self.texts: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def encode(self, text: str, images: Collection[str] = ()) -> list[int]:
        """The ids of `text`: the longest remembered prefix's, then the rest tokenized (`images`:
        Tokenizer.encode's; a remembered text's images are in its tags)."""
        held = max((t for t in self.texts if text.startswith(t) and _brought(t, images)), key=len, default=None)
        if held is None:
            return self.tokenizer.encode(text, images=images)
        self.texts.move_to_end(held)
        return list(self.texts[held]) + self.tokenizer.encode(text[len(held):], add_bos=False, images=images)

    def remember(self, text: str, ids: Sequence[int]):
        """Note that `ids` spell `text` (a prompt, or a prompt and the reply sampled after it)."""
        if not text:
            return
        self.texts[text] = tuple(ids)
        self.texts.move_to_end(text)
        while len(self.texts) > self.size:
            self.texts.popitem(last=False)


def _brought(text: str, images: Collection[str]) -> bool:
    """Whether the images whose tags `text` holds are among those a prompt brought (a tag typed
    in a message names no image)."""
    return TAG_OPEN not in text or all(digest in images for digest, *_ in TAG.findall(text))
