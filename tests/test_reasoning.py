"""Thinking kept apart: the families of real templates (tests/data/templates), thinking turned on and
off in each, the split of a streamed reply however it is cut, and a budget honoured to the token
by the engine on the tiny model under DeepSeek-R1's template (whose prompt opens the block)."""
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nibble.runner.generation.decoding import Request
from nibble.runner.generation.engine import Engine
from nibble.runner.generation.decoding import Reply
from nibble.runner.loader import load
from nibble.runner.text.reasoning import (HARMONY_END, THINK_END, ReasoningSplit, Thinking, ThinkingOptions, chat_prompt,
                                     reasoning_family)
from nibble.runner.settings import SamplerSettings
from nibble.runner.text.tokenizer import Tokenizer
from nibble.runner.text.tools import Call, ToolCallParser, tool_family
from tests.tiny import TEMPLATES, tiny_model_dir, tiny_with_template

QWEN3, SMOLLM3 = "Qwen-Qwen3-0.6B.jinja", "HuggingFaceTB-SmolLM3-3B.jinja"
R1, GPT_OSS = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "openai-gpt-oss-120b.jinja"
HI = [{"role": "user", "content": "Hi"}]
GREEDY = SamplerSettings(temperature=0)


@pytest.mark.parametrize("template,family", [(QWEN3, "think"), (SMOLLM3, "think"), (R1, "think"),
                                             (GPT_OSS, "harmony"), ("Qwen-Qwen2.5-7B-Instruct.jinja", None)])
def test_the_template_says_how_its_model_thinks(template, family):
    assert reasoning_family((TEMPLATES / template).read_text()) == family


def prompt(template: str, **asked):
    return chat_prompt(Tokenizer(tiny_with_template(template)), HI, ThinkingOptions(**asked))


def test_qwen3_thinks_unless_told_not_to():
    text, split = prompt(QWEN3)
    assert text.endswith("<|im_start|>assistant\n") and not split.thinking   # the model opens <think> itself
    text, split = prompt(QWEN3, think=False)
    assert text.endswith("<think>\n\n</think>\n\n") and not split.thinking
    assert prompt(QWEN3, budget=0)[0] == text   # a budget of 0 is thinking off


def test_smollm3_is_told_in_its_system_prompt():
    text, _ = prompt(SMOLLM3)
    assert "/think" in text and "/no_think" not in text
    text, split = prompt(SMOLLM3, think=False)
    assert "/no_think" in text and text.endswith("<think>\n\n</think>\n") and not split.thinking


def test_deepseek_r1_opens_the_block_in_the_prompt():
    text, split = prompt(R1)
    assert text.endswith("<think>\n") and split.thinking   # the reply starts inside it
    text, split = prompt(R1, think=False)
    assert text.rstrip().endswith("</think>") and not split.thinking


def test_gpt_oss_thinks_as_hard_as_asked():
    assert "Reasoning: medium" in prompt(GPT_OSS)[0]
    assert "Reasoning: high" in prompt(GPT_OSS, effort="high")[0]
    assert "Reasoning: low" in prompt(GPT_OSS, think=False)[0]   # Harmony cannot turn it off


def test_a_model_that_does_not_think_has_no_split():
    assert chat_prompt(Tokenizer(tiny_model_dir()), HI, ThinkingOptions(think=True))[1] is None


def test_an_earlier_turns_thinking_goes_back_only_as_the_template_says():
    """Both templates drop the thinking of turns a later question closed, and keep it within the
    turn still running (a tool call and its result)."""
    closed = HI + [{"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
                   {"role": "user", "content": "Bye"}]
    running = HI + [{"role": "assistant", "content": "", "reasoning_content": "Need the weather.",
                     "tool_calls": [{"id": "c1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "21 C"}]
    for template in (QWEN3, GPT_OSS):
        tok = Tokenizer(tiny_with_template(template))
        assert "A greeting." not in chat_prompt(tok, closed)[0]
        assert "Need the weather." in chat_prompt(tok, running)[0]


def split_all(split: ReasoningSplit, pieces: list[str]) -> tuple[str, str]:
    parts = [p for piece in pieces for p in split.feed(piece)] + split.finish()
    return ("".join(p.text for p in parts if isinstance(p, Thinking)),
            "".join(p for p in parts if isinstance(p, str)))


def cuts(text: str):
    """`text` cut into pieces at any places."""
    return st.sets(st.integers(1, len(text) - 1)).map(
        lambda at: [text[i:j] for i, j in zip([0, *sorted(at)], [*sorted(at), len(text)])])


THOUGHT = "<think>\nThe user greets me. <b>Be</b> kind.\n</think>\n\nHello! </thin> stays."


@given(cuts(THOUGHT))
def test_a_think_block_splits_the_same_however_the_reply_is_cut(pieces):
    assert split_all(ReasoningSplit("think"), pieces) == ("The user greets me. <b>Be</b> kind.",
                                                          "Hello! </thin> stays.")


@given(cuts("Plain answer, <think> later is text."))
def test_without_a_block_first_everything_is_the_answer(pieces):
    assert split_all(ReasoningSplit("think"), pieces) == ("", "Plain answer, <think> later is text.")


@given(cuts("We think.\n</think>\n\nDone."))
def test_a_reply_that_starts_inside_the_block(pieces):
    assert split_all(ReasoningSplit("think", inside=True), pieces) == ("We think.", "Done.")


HARMONY = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
           'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')


@given(cuts(HARMONY))
def test_harmony_analysis_is_thinking_and_a_commentary_call_is_a_call(pieces):
    thought, answer = split_all(ReasoningSplit("harmony"), pieces)
    assert thought == "Need the weather."
    parser = ToolCallParser(tool_family((TEMPLATES / GPT_OSS).read_text()), ["get_weather"])
    [call] = parser.feed(answer) + parser.finish()
    assert isinstance(call, Call) and call.name == "get_weather" and call.arguments == '{"city": "Paris"}'


@given(cuts("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>final<|message|>Paris."))
def test_harmony_final_is_the_answer(pieces):
    assert split_all(ReasoningSplit("harmony"), pieces) == ("Hmm.", "Paris.")


def test_stop_strings_cut_the_answer_not_the_thinking():
    tok = Tokenizer(tiny_model_dir())
    reply = Reply(tok, 100, stop=["sky"], reasoning=ReasoningSplit("think", inside=True))
    answer = ""
    for i in tok.encode("the sky</think>the sea, the sky, more"):
        answer += reply.add(i)
        if reply.finish_reason:
            break
    assert reply.take_thinking() == "the sky" and answer == "the sea, the " and reply.stop_string == "sky"


@pytest.fixture(scope="module")
def r1_engine(r1_dir):
    engine = Engine(*load(str(r1_dir)), parallel=2)
    engine.start()
    yield engine
    engine.close()


def reply(engine: Engine, budget: int | None, max_tokens: int = 24):
    text, split = chat_prompt(engine.tokenizer, [{"role": "user", "content": "Why is the sky blue?"}],
                              ThinkingOptions(budget=budget))
    events, done = [], threading.Event()

    def emit(event):
        events.append(event)
        if event.finish_reason:
            done.set()
    engine.submit(Request(engine.tokenizer.encode(text), GREEDY, max_tokens, reasoning=split, skip_special=False), emit)
    done.wait()
    return events


@pytest.mark.parametrize("budget", [1, 5])
def test_a_budget_ends_thinking_after_that_many_tokens(r1_engine, budget):
    events = reply(r1_engine, budget)
    tok = r1_engine.tokenizer
    ids = [i for e in events for i in e.tokens]
    end = tok.encode(THINK_END, add_bos=False)
    assert ids[budget:budget + len(end)] == end   # the budget's tokens, then the forced end
    thinking = "".join(e.thinking for e in events)
    assert thinking.strip() and thinking == _text(tok, ids[:budget]).strip()
    answer = "".join(e.text for e in events)
    assert answer == _text(tok, ids[budget + len(end):]).lstrip()
    # every event's thinking comes before any answer text
    first_answer = next((k for k, e in enumerate(events) if e.text), len(events))
    assert not any(e.thinking for e in events[first_answer + 1:])


def _text(tok: Tokenizer, ids: list[int]) -> str:
    return tok.tokenizer.decode(ids, skip_special_tokens=False)


def test_without_a_budget_the_reply_thinks_to_its_end(r1_engine):
    events = reply(r1_engine, None, max_tokens=12)
    assert "".join(e.text for e in events) == "" and "".join(e.thinking for e in events)
    assert events[-1].finish_reason == "length"


def test_a_harmony_budget_switches_to_the_final_channel():
    """gpt-oss thinks on its analysis channel: past the budget, Reply forces the end of that
    message and the final channel's header, and what follows is the answer."""
    tok = Tokenizer(tiny_model_dir())
    end = tok.encode(HARMONY_END, add_bos=False)
    reply = Reply(tok, 200, skip_special=False, reasoning=ReasoningSplit("harmony", budget=3, end_ids=end))
    answer = "".join(reply.add(i) for i in tok.encode("<|channel|>analysis<|message|>"))
    assert reply.forced() is None   # the header is not thinking
    thought = tok.encode(" the sky is blue because")
    for i in thought[:3]:
        assert reply.forced() is None
        answer += reply.add(i)
    forced = []
    while (token := reply.forced()) is not None:
        forced.append(token)
        answer += reply.add(token)
    assert forced == end and reply.take_thinking() == tok.decode(thought[:3])
    for i in tok.encode("Rayleigh scattering."):
        answer += reply.add(i)
    assert answer + reply.close("stop") == "Rayleigh scattering." and reply.take_thinking() == ""
