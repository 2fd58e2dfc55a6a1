"""A multi-turn chat on one KV cache: each turn prefills only the tokens the cache does not hold.

The session keeps no conversation of its own. Each turn the caller passes the whole conversation;
the session renders it with the model's chat template, keeps the longest prefix the cache already
holds, runs the rest and streams the reply. Regenerating, editing the last prompt or resuming a
stored chat are therefore just other conversations: whatever they share with the cache is reused.

On a shared pool of KV blocks (runner/kv/blocks.py; the chat app makes one), the session's cache is
one sequence of the pool, and a conversation it left earlier is still there, block by block,
until the pool needs the room: switching back to another chat prefills only its new message.

A sampled reply is not always the tokenization its text would get again: the prompt memo
(runner/kv/prompt_ids.py) gives the ids the cache holds for the texts of earlier turns.

A model that thinks (runner/text/reasoning.py) streams its thinking apart from its answer. An earlier
reply's thinking comes back as its message's "reasoning_content", which the template keeps or
drops as the model's own does; most drop it, so a reply that thought is not reused from the
cache past its prompt.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from ..kv.blocks import BlockPool
from ..kv.cache import KVCache
from .draft import DraftModel
from .generate import PREFILL_CHUNK, stream_generate
from ..model import ContextFull, Model
from ..kv.prompt_ids import PromptMemo
from ..text.reasoning import ReasoningSplit, ThinkingOptions, chat_prompt
from .sample import make_sampler
from ..settings import DEFAULT_DRAFT, MAX_TOKENS, SamplerSettings
from ..text.tokenizer import Tokenizer
from ..vision.base import for_template, with_images


@dataclass(frozen=True)
class TurnStats:
    """What one turn cost, and where the context stands."""
    prompt_tokens: int = 0        # the conversation as rendered for this turn
    reused: int = 0               # of those, already in the KV cache
    from_disk: int = 0            # of those, read back from the disk tier (runner/kv/disk.py)
    prefilled: int = 0            # of those, run this turn (prompt_tokens - reused)
    dropped: int = 0              # oldest messages left out so that the reply fits the context
    generation_tokens: int = 0
    prompt_tps: float = 0.0       # prefilled tokens / time to the first token
    generation_tps: float = 0.0   # decode tokens/s (after the first token)
    ttft: float = 0.0             # seconds from the prefill's start to the first token
    ctx_used: int = 0             # positions filled in the KV cache
    ctx_size: int = 0
    # None while running; "stop", "length" or "context"; "stopped" is the consumer's to set when
    # it stops the turn (see ChatSession.reply)
    finish_reason: str | None = None


@dataclass(frozen=True)
class ChatChunk:
    text: str                 # the new answer text since the previous chunk
    stats: TurnStats
    thinking: str = ""        # the new thinking text (a model that thinks), which comes before the answer
    thinking_tokens: int = 0  # of the reply's tokens so far, those that were thinking (its budget's count)


@dataclass(frozen=True)
class Prompt:
    """A conversation rendered for one turn."""
    text: str                      # through the chat template (the memo's key)
    ids: list[int]
    split: ReasoningSplit | None   # how its reply's thinking comes apart (None: the model does not think)


class ChatSession:
    """A model, its tokenizer and one KV cache, reused from turn to turn.

        session = ChatSession(model, tokenizer, ctx=4096)
        for chunk in session.reply([{"role": "user", "content": "Hi"}]):
            print(chunk.text, end="")

    With a `pool` (BlockPool of model.new_pool(), CPU only), the cache is a sequence of that
    pool's blocks; without, a cache of its own. `thinking`: what is asked of a model that thinks
    (the command line's --think and --reasoning-budget), unless a turn says otherwise. Not
    thread-safe: run one reply at a time (in any one thread).
    """

    def __init__(self, model: Model, tokenizer: Tokenizer, ctx: int | None = None,
                 kv_type: str = "f32", threads: int | None = None, prefill_chunk: int = PREFILL_CHUNK,
                 pool: BlockPool | None = None, draft: int = DEFAULT_DRAFT,
                 thinking: ThinkingOptions = ThinkingOptions(), draft_model: DraftModel | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        if pool is None:
            self.cache = model.new_cache(ctx, kv_type)
        else:
            longest = model.config.max_position_embeddings
            self.cache = KVCache.on_pool(pool.kv, min(ctx or longest, longest))
        self.kv_type = kv_type
        model.threads.pin(threads)
        self.prefill_chunk = prefill_chunk   # prompt tokens per forward pass of a long prefill
        self.draft = draft                   # tokens a decode pass guesses ahead (0: none)
        self.draft_model = draft_model       # guesses by it, not by prompt lookup (None)
        self.thinking = thinking             # a turn's own options are laid over these
        self.memo = PromptMemo(tokenizer)
        self.last_prompt_ids: list[int] = []                # the ids of the last turn's prompt

    @property
    def ctx_size(self) -> int:
        return self.cache.size


    def warm_up(self):
        """Run the kernels once: Numba compiles them (or loads them from its cache) on first use,
        which would otherwise delay the first reply by a second or more."""
        scratch = self.model.new_cache(4, self.kv_type)
        self.model.forward([0, 0], scratch)   # the prefill kernels
        self.model.forward([0], scratch)      # the decode kernels

    def count(self, messages: list[dict], thinking: ThinkingOptions | None = None) -> int:
        """Tokens of `messages` through the chat template, ready for the reply."""
        if not messages:
            return 0
        # not the memo's ids: a count may be asked for while a reply runs in another thread
        text, _, images = self._render(messages, self._asked(thinking))
        return len(self.tokenizer.encode(text, images=images))

    def fit(self, messages: list[dict], max_tokens: int,
            thinking: ThinkingOptions | None = None) -> tuple[list[int], int]:
        """-> (prompt ids, how many of the oldest messages were left out)."""
        prompt, dropped = self._fit(messages, max_tokens, self._asked(thinking))
        return prompt.ids, dropped

    def _asked(self, thinking: ThinkingOptions | None) -> ThinkingOptions:
        """A turn's thinking options over the session's."""
        return thinking.over(self.thinking) if thinking is not None else self.thinking

    def _render(self, messages: list[dict], asked: ThinkingOptions) -> tuple[str, ReasoningSplit | None, frozenset[str]]:
        """-> (the prompt's text, its reply's split, the digests of its images)."""
        messages, pictures = for_template(self.model.vision, messages)
        text, split = chat_prompt(self.tokenizer, messages, asked)
        text, images = with_images(self.model.vision, text, pictures)
        return text, split, images

    def _encode(self, messages: list[dict], asked: ThinkingOptions) -> Prompt:
        """The conversation's prompt, its ids reusing those of what the cache holds."""
        text, split, images = self._render(messages, asked)
        return Prompt(text, self.memo.encode(text, images), split)

    def _fit(self, messages: list[dict], max_tokens: int, asked: ThinkingOptions) -> tuple[Prompt, int]:
        """-> (the prompt, how many of the oldest messages were left out).

        Drops whole turns (a user message and the replies after it), oldest first, never the
        system message nor the last user turn, until prompt + max_tokens fits the context. Raises
        ContextFull when even the last turn alone does not fit.
        """
        system = messages[:1] if messages and messages[0]["role"] == "system" else []
        turns = messages[len(system):]
        dropped = 0
        while True:
            prompt = self._encode(system + turns, asked)
            if len(prompt.ids) + max_tokens <= self.cache.size:
                break
            n = 1   # the oldest turn: its user message and what follows up to the next user message
            while n < len(turns) and turns[n]["role"] != "user":
                n += 1
            if n >= len(turns):
                break   # only the last turn is left: answer in whatever room remains
            turns, dropped = turns[n:], dropped + n
        if len(prompt.ids) >= self.cache.size:
            what = "the message and the system prompt take" if system else "the message takes"
            raise ContextFull(f"{what} {len(prompt.ids)} tokens and the context holds {self.cache.size}: "
                              "shorten it, or start nibble chat with a larger --ctx-size")
        return prompt, dropped

    def reply(self, messages: list[dict], settings: SamplerSettings | None = None,
              max_tokens: int = MAX_TOKENS, thinking: ThinkingOptions | None = None) -> Iterator[ChatChunk]:
        """Stream the assistant's reply to `messages` ([{"role", "content"}, ...]; an earlier
        reply's thinking as its "reasoning_content"), sampled as `settings` say (None: the model's
        defaults, tokenizer.sampling), its thinking as `thinking` asks over the session's.

        The first chunk (empty text) comes before the prefill and says what will be prefilled
        and dropped; a long prefill then yields an empty chunk after each of its chunks; the last
        chunk has a finish_reason. The consumer stops the turn by stopping the iteration (closing
        this generator) between two chunks: the cache and the session keep what ran, and the last
        chunk's stats with finish_reason "stopped" describe the turn.
        """
        prompt, dropped = self._fit(messages, max_tokens, self._asked(thinking))
        ids = prompt.ids
        self.last_prompt_ids = ids
        cache = self.cache
        if self.pool is None:   # keep what the cache shares with the new prompt
            reused, from_disk = cache.keep_prefix(ids), 0
        else:   # or where the pool holds more of it: another chat's blocks, say
            reused, from_disk = self.pool.admit(cache, ids, min(len(ids) + max_tokens, cache.size),
                                                self.model.prefix_root())
        stats = TurnStats(prompt_tokens=len(ids), reused=reused, from_disk=from_disk, prefilled=len(ids) - reused,
                          dropped=dropped, ctx_used=cache.pos, ctx_size=cache.size)
        yield ChatChunk("", stats)

        sampler = make_sampler(settings or self.tokenizer.sampling, self.tokenizer)
        answer = []
        try:
            for r in stream_generate(self.model, self.tokenizer, ids, sampler=sampler,
                                     max_tokens=max_tokens, cache=cache, prefill_chunk=self.prefill_chunk,
                                     draft=self.draft, reasoning=prompt.split, draft_model=self.draft_model):
                stats = replace(stats, generation_tokens=r.generation_tokens, prompt_tps=r.prompt_tps,
                                generation_tps=r.generation_tps, ttft=r.ttft, ctx_used=cache.pos,
                                finish_reason=r.finish_reason)
                answer.append(r.text)
                yield ChatChunk(r.text, stats, r.thinking, prompt.split.thinking_tokens if prompt.split else 0)
        finally:   # also when the consumer stops the turn: note what the cache now holds
            thought = prompt.split is not None and prompt.split.thinking_tokens > 0
            self._remember(prompt, None if thought else "".join(answer))
            if self.pool is not None:   # its full blocks shared, and kept on disk where the pool has a tier
                self.pool.commit(cache)

    def _remember(self, prompt: Prompt, answer: str | None):
        """Note the ids behind the cache's text: the prompt, then the reply as far as its tokens
        ran (the last sampled token never does). The reply is noted only where its tokens spell
        `answer`, the text the next turn's template is given: not where the model thought (None),
        since its tokens spell the thinking too, which the template renders its own way, if at all."""
        tokens = self.cache.ran
        if tokens[:len(prompt.ids)] != prompt.ids:
            return   # the prefill was stopped halfway
        self.memo.remember(prompt.text, prompt.ids)
        if answer is None:
            return
        said = self.tokenizer.decode(tokens[len(prompt.ids):])
        if said and answer.startswith(said):
            self.memo.remember(prompt.text + said, tokens)

