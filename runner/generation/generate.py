"""Generation of one reply on one KV cache: prompt ids -> responses (text and thinking deltas,
with timings). The reply's token handling is runner/generation/decoding.py's, as in the serving engine; here
the passes run on the sequence's own cache (a model with GPU layers too)."""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..kv.cache import KVCache
from .decoding import Decoding, Request, check
from .draft import DraftModel
from ..model import Model
from ..text.image_ids import whole_images
from ..text.reasoning import ReasoningSplit
from .sample import Sampler
from ..settings import DEFAULT_DRAFT, MAX_TOKENS
from ..text.tokenizer import Tokenizer

if TYPE_CHECKING:   # llguidance is imported only by those who constrain a reply
    from ..text.grammar import Constraint

# Prompt tokens per forward pass of a long prefill: the consumer may stop between two chunks.
PREFILL_CHUNK = 256


@dataclass
class GenerationResponse:
    """One step of a reply. While a long prompt is prefilled, one response (text "", token None,
    no tokens generated yet) follows each chunk but the last."""
    text: str                   # the new text since the previous response
    token: int | None           # the token behind it (None while prefilling and on a final flush)
    prompt_tokens: int          # tokens prefilled for this call (of the prompt, those the cache did not hold)
    prompt_tps: float           # prefill tokens/s (0 until the first token)
    generation_tokens: int      # tokens generated so far
    generation_tps: float       # decode tokens/s (after the first token)
    ttft: float                 # seconds from the call to the first token (0 until then)
    finish_reason: str | None   # None while running; "stop" (eos or stop string), "length", "context"
    thinking: str = ""          # new thinking text (a model that thinks, with a reasoning split), before `text`
    tokens: tuple[int, ...] = ()   # every id behind it (`token` the last), an end token left out


def stream_generate(model: Model, tokenizer: Tokenizer, prompt_ids: Sequence[int], *,
                    sampler: Sampler | None = None, max_tokens: int = MAX_TOKENS,
                    stop: Sequence[str] = (), cache: KVCache | None = None,
                    prefill_chunk: int = PREFILL_CHUNK, constraint: Constraint | None = None,
                    draft: int = DEFAULT_DRAFT, reasoning: ReasoningSplit | None = None,
                    draft_model: DraftModel | None = None) -> Iterator[GenerationResponse]:
    """Stream the reply to `prompt_ids`, the whole prompt, on `cache` (a fresh one if None): the
    cache keeps what it holds of the prompt (an earlier turn's, KVCache.keep_prefix; a cache on a
    BlockPool is put on the prompt by BlockPool.admit first) and the rest is prefilled.

    The prompt is prefilled in chunks of at most `prefill_chunk` tokens, with a response (text "",
    token None) after each but the last: the consumer cancels by stopping the iteration, between
    two chunks or two tokens, and the cache keeps what ran (cache.ids: the prompt, then the reply
    so far, whose last sampled id never ran). Without a `sampler`, the model's sampling defaults
    apply (tokenizer.sampling). With a `constraint` (a grammar's, runner/text/grammar.py), the
    reply follows the grammar and ends "stop" where it is complete. `draft`: the most tokens a
    pass guesses ahead and checks (none with GPU layers), the same reply sooner: by prompt lookup,
    or by `draft_model`'s guesses (runner/generation/draft.py). With a
    `reasoning` split (a model that thinks), its thinking comes apart in each response's
    `thinking`, and its budget holds. A reply that fills the context ends "context". The
    timings are measured here, from the call; the decode tokens/s count the tokens emitted;
    prompt_tokens counts the tokens prefilled.
    """
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
    cache = cache if cache is not None else model.new_cache()
    request = Request(list(prompt_ids), tokenizer.sampling, max_tokens, tuple(stop), constraint,
                      skip_special=reasoning is None, reasoning=reasoning,
                      draft=draft if model.gpu_stage is None else 0)
    check(request, cache.size)   # before the cache lets go of what it holds
    cached = cache.keep_prefix(prompt_ids)
    decoding = Decoding(request, tokenizer, cache.size, sampler, ids=cache.ids, draft_model=draft_model)
    decoding.cached = cached
    prefill = len(prompt_ids) - cached
    start = time.perf_counter()
    first, prompt_tps = 0.0, 0.0

    def response(e=None):
        n = decoding.reply.tokens
        now = time.perf_counter()
        decode_tps = (n - 1) / (now - first) if n > 1 and now > first else 0.0
        if e is None:   # a prefill chunk ran
            return GenerationResponse("", None, prefill, 0.0, 0, 0.0, 0.0, None)
        reason = "context" if e.finish_reason == "length" and decoding.at_context else e.finish_reason
        return GenerationResponse(e.text, e.tokens[-1] if e.tokens else None, prefill, prompt_tps, n,
                                  decode_tps, first - start, reason, e.thinking, e.tokens)

    while len(prompt_ids) - cache.pos > prefill_chunk:
        end = whole_images(prompt_ids, cache.pos, cache.pos + prefill_chunk)
        if end == len(prompt_ids):   # an image to the prompt's end: the last pass's
            break
        model.forward(prompt_ids[cache.pos:end], cache)
        yield response()
    logits, proposed = model.forward(prompt_ids[cache.pos:], cache), []
    while True:
        events, kept = decoding.next(logits, proposed)
        cache.pos += kept   # the draft's ids it kept ran; the next pass overwrites the rest
        if not first:
            first = time.perf_counter()
            prompt_tps = prefill / (first - start)
        for e in events:
            yield response(e)
        if decoding.done:
            return
        proposed = decoding.draft()
        logits = model.forward(cache.ids[cache.pos:], cache, draft=proposed)
