"""Multi-turn chat on one KV cache, on the tiny model: reuse, equality with a fresh cache, stopping,
and dropping the oldest turns when the context would overflow; each on a cache of the session's
own and on a shared pool of blocks, where switching chats reuses the other chat's blocks. Then a
model that thinks: the tiny model under DeepSeek-R1's template, which opens the reply's <think>
block, so that it thinks until a budget ends its thinking."""
import copy
from dataclasses import replace

import pytest

from nibble.runner.generation import session as session_module
from nibble.runner.kv.blocks import BlockPool
from nibble.runner.kv.cache import blocks_for
from nibble.runner.generation.generate import stream_generate
from nibble.runner.loader import load
from nibble.runner.text.template import ChatTemplate
from nibble.runner.model import ContextFull
from nibble.runner.text.reasoning import ThinkingOptions
from nibble.runner.settings import SamplerSettings
from nibble.runner.generation.sample import make_sampler
from nibble.runner.generation.session import ChatSession

GREEDY = SamplerSettings(temperature=0)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    model, tok = load(str(tiny_dir))
    tok.eos_ids = frozenset()   # the random model would stop at random: let max_tokens decide
    return model, tok


@pytest.fixture(params=["own cache", "shared pool"])
def new_session(request, tiny):
    """ChatSession(*tiny, ctx=..., ...), on a pool of 4 contexts' blocks or not."""
    def make(ctx, **kw):
        pool = BlockPool(tiny[0].new_pool(4 * blocks_for(ctx))) if request.param == "shared pool" else None
        return ChatSession(*tiny, ctx=ctx, pool=pool, **kw)
    return make


def run(session, messages, max_tokens=8, **kw):
    chunks = list(session.reply(messages, GREEDY, max_tokens=max_tokens, **kw))
    return "".join(c.text for c in chunks), chunks[-1].stats, chunks


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_first_chunk_announces_the_prefill_and_the_last_finishes(new_session):
    s = new_session(ctx=256)
    _, last, chunks = run(s, [user("Hello there")])
    first = chunks[0]
    assert first.text == "" and first.stats.finish_reason is None
    assert first.stats.prefilled == first.stats.prompt_tokens > 0 and first.stats.reused == 0
    assert all(c.stats.finish_reason is None for c in chunks[:-1])
    assert last.finish_reason == "length" and last.generation_tokens == 8
    assert last.ctx_used == s.cache.pos == last.prompt_tokens + 7   # the last token never ran
    assert last.ctx_size == 256


def test_turn_two_prefills_only_the_new_tokens(new_session):
    s = new_session(ctx=256)
    template = s.tokenizer.chat_template
    conv = [{"role": "system", "content": "Be brief."}, user("The quick brown fox")]
    reply, one, _ = run(s, conv)
    in_cache = s.tokenizer.decode(s.cache.ran[one.prompt_tokens:])   # the last token never ran
    assert reply.startswith(in_cache)
    before = template.render(conv) + in_cache
    conv += [assistant(reply), user("jumps over the lazy dog")]
    _, two, _ = run(s, conv)
    new_tokens = s.tokenizer.encode(template.render(conv)[len(before):], add_bos=False)
    assert two.reused == one.prompt_tokens + 7 and two.prefilled == len(new_tokens)
    assert two.prompt_tokens == two.reused + two.prefilled


def alone(tiny, prompt_ids, max_tokens=8):
    """The greedy reply to `prompt_ids` on a fresh cache."""
    return "".join(r.text for r in stream_generate(*tiny, prompt_ids, sampler=make_sampler(GREEDY),
                                                    max_tokens=max_tokens))


def test_greedy_reply_with_reuse_equals_a_fresh_cache(tiny, new_session):
    reused = new_session(ctx=256)
    conv = [user("What is the capital of France?")]
    reply, _, _ = run(reused, conv)
    conv += [assistant(reply), user("And the sea?")]
    again, stats, _ = run(reused, conv, max_tokens=12)
    assert stats.reused > 0 and again == alone(tiny, reused.last_prompt_ids, max_tokens=12)


def test_an_edited_reply_is_tokenized_afresh(new_session):
    """When the conversation is not what the cache holds (an edited or resumed chat), the prompt
    is the template's text tokenized as a fresh session would, and the reply is the same."""
    s = new_session(ctx=256)
    conv = [user("What is the capital of France?")]
    run(s, conv)
    conv += [assistant("Paris, on the Seine."), user("And the sea?")]
    again, stats, _ = run(s, conv, max_tokens=12)
    fresh, fresh_stats, _ = run(new_session(ctx=256), conv, max_tokens=12)
    assert s.last_prompt_ids == s.tokenizer.chat(conv)
    assert stats.reused > 0 and fresh_stats.reused == 0 and again == fresh


def test_regenerate_and_edit_reuse_what_the_cache_holds(new_session):
    s = new_session(ctx=256)
    conv = [user("Numba compiles Python")]
    first, one, _ = run(s, conv)
    conv += [assistant(first), user("jumps over the lazy dog")]
    _, two, _ = run(s, conv)
    three_ids = list(s.cache.ran)
    # Regenerate turn two: its whole prompt, spliced ids included, is still in the cache.
    again, three, _ = run(s, conv)
    assert three.reused == two.prompt_tokens - 1 and three.prefilled == 1
    assert s.last_prompt_ids == three_ids[:two.prompt_tokens]
    # Edit turn two's message: everything up to it is reused.
    conv[-1] = user("the sky")
    _, four, _ = run(s, conv)
    assert four.reused >= one.prompt_tokens + 7


def test_stopping_the_iteration_keeps_the_text_and_what_ran(new_session):
    s = new_session(ctx=256)
    chunks = s.reply([user("Hello")], GREEDY, max_tokens=100)
    text, n = "", 0
    for chunk in chunks:
        text += chunk.text
        n += bool(chunk.text)
        if n == 2:
            break
    chunks.close()   # the consumer stops the turn
    stopped = chunk.stats
    assert text and stopped.finish_reason is None and stopped.generation_tokens < 100
    assert s.cache.pos == stopped.ctx_used == stopped.prompt_tokens + stopped.generation_tokens - 1
    # The next turn reuses the prompt and the reply as far as it ran.
    _, stats, _ = run(s, [user("Hello"), assistant(text), user("Go on")])
    assert stats.reused == stopped.ctx_used


def test_stopping_during_a_long_prefill_leaves_whole_chunks(new_session):
    conv = [user("The quick brown fox jumps over the lazy dog. " * 3)]
    s = new_session(ctx=256, prefill_chunk=8)
    chunks = s.reply(conv, GREEDY)
    first, second, third = next(chunks), next(chunks), next(chunks)
    chunks.close()
    assert first.stats.prefilled > 24
    assert [c.text for c in (second, third)] == ["", ""]
    assert [c.stats.ctx_used for c in (second, third)] == [8, 16] and s.cache.pos == 16
    assert third.stats.generation_tokens == 0 and third.stats.finish_reason is None
    # The next turn goes on from the chunks that ran, and answers as a fresh session does.
    again, stats, _ = run(s, conv)
    fresh, _, _ = run(new_session(ctx=256), conv)
    assert stats.reused == 16 and again == fresh


def test_long_prefill_in_chunks_gives_the_same_reply(new_session):
    conv = [user("The quick brown fox jumps over the lazy dog. " * 3)]
    whole, _, _ = run(new_session(ctx=256), conv)
    chunked, _, _ = run(new_session(ctx=256, prefill_chunk=8), conv)
    assert chunked == whole


def test_timings_come_from_stream_generate(new_session, monkeypatch):
    """The session reports the generation's own figures, not figures of its own."""
    from nibble.runner.generation import generate

    def figures(*args, **kwargs):
        for r in generate.stream_generate(*args, **kwargs):
            yield replace(r, prompt_tps=111.0, generation_tps=222.0, ttft=3.0)
    monkeypatch.setattr(session_module, "stream_generate", figures)
    _, last, _ = run(new_session(ctx=256), [user("Hello")])
    assert (last.prompt_tps, last.generation_tps, last.ttft) == (111.0, 222.0, 3.0)


def test_overflow_drops_the_oldest_turns_but_never_the_system_prompt(new_session):
    s = new_session(ctx=96)
    system = {"role": "system", "content": "Be brief."}
    conv = [system]
    dropped = []
    for q in ["The quick brown fox", "jumps over the lazy dog", "Numba compiles Python", "the sky"]:
        conv.append(user(q))
        reply, stats, _ = run(s, conv, max_tokens=16)
        assert stats.prompt_tokens + 16 <= 96
        dropped.append(stats.dropped)
        conv.append(assistant(reply))
    assert dropped[0] == 0 and dropped[-1] > 0 and dropped[-1] % 2 == 0   # whole turns
    ids, n = s.fit(conv[:-1], 16)
    text = s.tokenizer.decode(ids)
    assert "Be brief." in text and "the sky" in text and n == dropped[-1]


def test_a_message_longer_than_the_context_is_refused(new_session):
    s = new_session(ctx=32)
    with pytest.raises(ContextFull, match="context holds 32"):
        list(s.reply([user("The quick brown fox jumps over the lazy dog. " * 4)], GREEDY))
    # A last turn that fits, but not with max_tokens: answered in the room left.
    _, stats, _ = run(s, [user("Hello")], max_tokens=500)
    assert stats.finish_reason == "context" and stats.ctx_used == 32


def test_count_and_warm_up(new_session):
    s = new_session(ctx=64)
    s.warm_up()
    assert s.cache.pos == 0 and s.count([]) == 0
    assert s.count([user("Hello")]) == len(s.tokenizer.chat([user("Hello")]))


def test_switching_chats_on_a_shared_pool_prefills_only_the_new_message(tiny):
    """The chat app's way: one session, one pool, several chats in turn."""
    s = ChatSession(*tiny, ctx=256, pool=BlockPool(tiny[0].new_pool(4 * blocks_for(256))))
    a = [{"role": "system", "content": "Be brief."}, user("The quick brown fox jumps over the lazy dog")]
    b = [{"role": "system", "content": "Be brief."}, user("Numba compiles Python to machine code")]
    reply_a, one, _ = run(s, a)
    run(s, b)
    a += [assistant(reply_a), user("the sky")]
    again, back, _ = run(s, a)
    assert back.reused == one.prompt_tokens + 7   # all that chat a's turn ran
    assert again == alone(tiny, s.last_prompt_ids)


def test_truncating_into_a_shared_block_keeps_the_other_chats_blocks(tiny):
    """Chat b shares chat a's system prompt, into the middle of a block: the session copies that
    block rather than overwrite what chat a's chain of blocks names."""
    s = ChatSession(*tiny, ctx=256, pool=BlockPool(tiny[0].new_pool(4 * blocks_for(256))))
    system = {"role": "system", "content": "The quick brown fox jumps over the lazy dog. " * 2}
    a, b = [system, user("the sky")], [system, user("the sea")]
    reply_a, one, _ = run(s, a)
    reply_b, two, _ = run(s, b)
    assert 0 < two.reused < one.prompt_tokens and two.reused % 16
    assert reply_b == alone(tiny, s.last_prompt_ids)   # the copy holds the shared positions
    a += [assistant(reply_a), user("and then?")]
    again, back, _ = run(s, a)
    assert back.reused == one.prompt_tokens + 7
    assert again == alone(tiny, s.last_prompt_ids)


@pytest.fixture(scope="module")
def r1(r1_dir):
    model, tok = load(str(r1_dir))
    tok.eos_ids = frozenset()
    return model, tok


# The forced end of thinking ("\n</think>\n\n") takes the tiny tokenizer 10 tokens: a reply of 20
# thinks 4, ends its thinking and answers.
BUDGET, REPLY = ThinkingOptions(budget=4), 20


def thought_and_said(chunks) -> tuple[str, str]:
    return "".join(c.thinking for c in chunks), "".join(c.text for c in chunks)


def test_a_model_that_thinks_streams_its_thinking_apart_from_its_answer(r1):
    s = ChatSession(*r1, ctx=256, thinking=BUDGET)
    _, last, chunks = run(s, [user("Hello there")], max_tokens=REPLY)
    thinking, answer = thought_and_said(chunks)
    assert thinking and answer and thinking not in answer
    first_answer = next(i for i, c in enumerate(chunks) if c.text)
    assert not any(c.thinking for c in chunks[first_answer:])   # the thinking comes first
    assert last.generation_tokens == REPLY and last.finish_reason == "length"   # thinking counted as before
    assert chunks[-1].thinking_tokens == 4   # the budget's count
    held = s.tokenizer.decode(s.cache.ran[last.prompt_tokens:])
    assert "</think>" in held   # the cache holds the reply as the model wrote it


def test_thinking_off_for_the_session_or_for_one_turn(r1):
    s = ChatSession(*r1, ctx=256, thinking=ThinkingOptions(think=False))
    _, _, chunks = run(s, [user("Hello there")], max_tokens=REPLY)
    thinking, answer = thought_and_said(chunks)
    assert thinking == "" and answer
    assert s.tokenizer.decode(s.last_prompt_ids).endswith("<think>\n</think>")   # closed in the prompt
    s = ChatSession(*r1, ctx=256, thinking=BUDGET)
    _, _, chunks = run(s, [user("Hello there")], max_tokens=REPLY, thinking=ThinkingOptions(think=False))
    assert thought_and_said(chunks)[0] == ""
    # A turn's options lie over the session's: unsaid, the session's budget holds.
    _, _, chunks = run(s, [user("Hello there")], max_tokens=REPLY, thinking=ThinkingOptions())
    assert thought_and_said(chunks)[0]


def test_a_follow_up_reuses_the_prompt_and_sends_the_answer_not_the_thinking(r1):
    s = ChatSession(*r1, ctx=256, thinking=BUDGET)
    conv = [user("The quick brown fox")]
    _, one, chunks = run(s, conv, max_tokens=REPLY)
    thinking, answer = thought_and_said(chunks)
    first_prompt = s.tokenizer.decode(s.last_prompt_ids)
    conv += [{"role": "assistant", "content": answer, "reasoning_content": thinking}, user("jumps")]
    again, two, _ = run(s, conv, max_tokens=REPLY)
    prompt = s.tokenizer.decode(s.last_prompt_ids)
    assert answer in prompt and thinking not in prompt   # DeepSeek-R1's template drops earlier thinking
    # The prompt text is the same up to the reply, whose thinking the cache holds and the prompt
    # does not: reused up to there, "<think>\n" excepted.
    opening = len(s.tokenizer.encode("<think>\n", add_bos=False))
    assert first_prompt.endswith("<think>\n") and two.reused == one.prompt_tokens - opening
    assert again == alone_thinking(r1, s.last_prompt_ids)


def test_a_reply_that_thought_is_not_remembered_as_its_answer(r1):
    """Its tokens spell the thinking and the answer: remembered as the answer's, they would put the
    thinking back into a prompt whose template dropped it."""
    s = ChatSession(*r1, ctx=256, thinking=BUDGET)
    run(s, [user("Hello there")], max_tokens=REPLY)
    prompt = s.tokenizer.decode(s.last_prompt_ids)
    assert [t for t in s.memo.texts if t.startswith(prompt) and t != prompt] == []


def test_earlier_thinking_reaches_the_template_as_reasoning_content(r1):
    """A template that keeps it (here every turn's) renders it in its own block, not in the content."""
    model, tok = r1
    keeps = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>\n"
             "{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    tok = replace_template(tok, keeps)
    s = ChatSession(model, tok, ctx=256, thinking=BUDGET)
    conv = [user("Hi"), {"role": "assistant", "content": "Hello.", "reasoning_content": "A greeting."},
            user("Bye")]
    run(s, conv, max_tokens=2)
    prompt = s.tokenizer.decode(s.last_prompt_ids)   # without the special tokens
    assert "assistant\n<think>\nA greeting.\n</think>\n\nHello.\nuser\nBye" in prompt


def replace_template(tok, source: str):
    tok = copy.copy(tok)   # the module's tokenizer keeps its own
    tok.chat_template = ChatTemplate(source, tok.chat_template.special_tokens)
    return tok


def alone_thinking(r1, prompt_ids):
    """The greedy reply to `prompt_ids` (which open a <think> block) on a fresh cache, its answer."""
    from nibble.runner.text.reasoning import THINK_END, ReasoningSplit
    model, tok = r1
    split = ReasoningSplit("think", inside=True, budget=4, end_ids=tok.encode(THINK_END, add_bos=False))
    return "".join(r.text for r in stream_generate(model, tok, prompt_ids, sampler=make_sampler(GREEDY),
                                                    max_tokens=REPLY, reasoning=split))
