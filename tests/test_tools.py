"""Tool calls: family detection and rendering on llama.cpp's copies of real templates
(tests/data/templates), the streaming parser on each family's output, forced calls on the tiny model."""
import json
from pathlib import Path

import pytest

from nibble.runner.text.template import ChatTemplate
from nibble.runner.text.grammar import GrammarError
from nibble.runner.generation.sample import make_sampler
from nibble.runner.settings import SamplerSettings
from nibble.runner.text.tools import (Call, Content, MessageError, ToolCallParser, forced_call_grammar,
                                 prepare_messages, tool_family)

TEMPLATES = Path(__file__).parent / "data" / "templates"
FAMILY = {
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes",
    "Qwen-Qwen2.5-7B-Instruct": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "Qwen-Qwen3-0.6B": "hermes",
    "HuggingFaceTB-SmolLM3-3B": "generic",   # its tools go in the system prompt, as nibble's generic does
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "generic",
    "openai-gpt-oss-120b": "harmony",
}
# SmolLM2's kind of template: it ignores tools
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "description": "the city", "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object",
                   "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"type": "integer", "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
NAMES = ["get_weather", "add"]

# A tool turn as an OpenAI client sends it back: arguments as a JSON string, content None.
TURN = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_Xy12_long", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_Xy12_long", "content": '{"temp": 21}'},
]
SINGLE = '{"city": "Paris", "unit": "celsius"}'


@pytest.mark.parametrize("name", FAMILY)
def test_family_detection(name):
    assert tool_family((TEMPLATES / f"{name}.jinja").read_text()) == FAMILY[name]


def test_a_template_without_tools_is_generic():
    assert tool_family(CHATML) == "generic"


@pytest.mark.parametrize("name", [*FAMILY, "chatml"])
def test_a_tool_turn_renders_with_its_arguments_encoded_once(name):
    source = CHATML if name == "chatml" else (TEMPLATES / f"{name}.jinja").read_text()
    family = tool_family(source)
    messages, tools = prepare_messages(TURN, TOOLS, family)
    text = ChatTemplate(source, SPECIAL).render(messages, tools=tools)
    assert SINGLE in text and '\\"city\\"' not in text          # not '"{\"city\": …}"'
    assert "Weather in a city" in text and "a + b" in text      # the tools are shown
    assert '{"temp": 21}' in text and '\\"temp\\"' not in text   # the tool's result, once
    assert TURN[1]["tool_calls"][0]["function"]["arguments"] == SINGLE   # the caller's messages are untouched


def test_without_prepare_messages_templates_encode_arguments_twice():
    """The quirk prepare_messages is for (design §4): Qwen 2.5 writes a string with tojson."""
    text = ChatTemplate((TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()).render(TURN, tools=TOOLS)
    assert '"arguments": "{\\"city\\": \\"Paris\\"' in text


def test_a_conversation_with_tools_goes_through_the_tool_use_template():
    from nibble.runner.text.tokenizer import Tokenizer
    from tests.tiny import tiny_model_dir
    md = tiny_model_dir()
    hermes = (TEMPLATES / "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja").read_text()
    md.tokenizer_config = dict(md.tokenizer_config, chat_template=[{"name": "default", "template": CHATML},
                                                                   {"name": "tool_use", "template": hermes}])
    tok = Tokenizer(md)
    assert tool_family(tok.tool_template.source) == "hermes" and tool_family(tok.chat_template.source) == "generic"
    user = [{"role": "user", "content": "Hi"}]
    assert "function calling AI model" in tok.tokenizer.decode(tok.chat(user, tools=TOOLS))
    assert tok.chat(user) == tok.encode(ChatTemplate(CHATML).render(user))


def test_mistral_ids_become_nine_alphanumerics_the_same_each_turn():
    source = (TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()
    with pytest.raises(Exception, match="Tool call IDs should be alphanumeric strings with length 9"):
        ChatTemplate(source, SPECIAL).render(TURN, tools=TOOLS)
    first, _ = prepare_messages(TURN, TOOLS, "mistral")
    again, _ = prepare_messages(TURN, TOOLS, "mistral")
    call_id = first[1]["tool_calls"][0]["id"]
    assert len(call_id) == 9 and call_id.isalnum() and first[2]["tool_call_id"] == call_id
    assert again == first
    kept, _ = prepare_messages([dict(TURN[2], tool_call_id="abc123XYZ")], None, "mistral")
    assert kept[0]["tool_call_id"] == "abc123XYZ"


def test_generic_lists_the_tools_in_the_system_message_and_calls_as_text():
    system = [{"role": "system", "content": "Be brief."}]
    messages, tools = prepare_messages(system + TURN + [dict(TURN[2], content="second")], TOOLS, "generic")
    assert tools is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "add"' in messages[0]["content"]
    assert messages[2]["content"] == f'<tool_call>\n{{"name": "get_weather", "arguments": {SINGLE}}}\n</tool_call>'
    assert messages[3]["content"] == ('<tool_response>\n{"temp": 21}\n</tool_response>\n'
                                      '<tool_response>\nsecond\n</tool_response>')


def test_text_parts_are_joined_image_parts_kept_and_others_refused():
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert prepare_messages(parts, None, "hermes")[0][0]["content"] == "ab"
    with_image = [{"type": "image", "image": object()}, {"type": "text", "text": "a"}]
    assert prepare_messages([{"role": "user", "content": with_image}], None, "hermes")[0][0]["content"] == with_image
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(MessageError, match="a user message's content may hold text and image parts only, not image_url"):
        prepare_messages(image, None, "hermes")


def test_malformed_arguments_are_left_as_the_model_wrote_them():
    turn = [dict(TURN[1], tool_calls=[{"id": "x", "function": {"name": "add", "arguments": '{"a": 1,'}}])]
    messages, _ = prepare_messages(turn, TOOLS, "hermes")
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1,'


# The parser, on each family's output

def parse(family, text, pieces=1):
    """Deltas for `text` fed in chunks of `pieces` characters, then finish(); neighbouring Content merged."""
    parser = ToolCallParser(family, NAMES)
    deltas = [d for i in range(0, len(text), pieces) for d in parser.feed(text[i:i + pieces])] + parser.finish()
    merged = []
    for d in deltas:
        if merged and isinstance(d, Content) and isinstance(merged[-1], Content):
            merged[-1] = Content(merged[-1].text + d.text)
        else:
            merged.append(d)
    got = [d.text if isinstance(d, Content) else (d.index, d.name, json.loads(d.arguments)) for d in merged]
    return got, parser


HERMES_TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
PARIS = {"city": "Paris", "unit": "celsius"}

CASES = [
    ("hermes", HERMES_TWO, ["Let me check.\n", (0, "get_weather", PARIS), (1, "add", {"a": 1, "b": 2})]),
    ("generic", "No call needed: 1 < 2 and <b>ok</b>.", ["No call needed: 1 < 2 and <b>ok</b>."]),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call> then',       # bad JSON
     ['<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call> then']),
    ("hermes", '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>',                      # unknown name
     ['<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>']),
    ("hermes", 'x <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}',                   # no end marker
     ['x <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}']),
    ("hermes", '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>\nDone.',
     [(0, "add", {"a": 1, "b": 2}), "Done."]),                                                    # arguments as a string
    ("llama3", ' {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     [(0, "get_weather", PARIS)]),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', [(0, "add", {"a": 1, "b": 2})]),
    ("llama3", '{"answer": 42}', ['{"answer": 42}']),
    ("llama3", "It is {sunny}.", ["It is {sunny}."]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, '
                '"id": "abc123def"}, {"name": "add", "arguments": {"a": 1, "b": 2}}]',
     [(0, "get_weather", PARIS), (1, "add", {"a": 1, "b": 2})]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "add"', ['Sure. [TOOL_CALLS][{"name": "add"']),
]


@pytest.mark.parametrize("family,text,want", CASES, ids=range(len(CASES)))
@pytest.mark.parametrize("pieces", [1, 3, 10_000])
def test_the_parser_gives_the_same_deltas_however_the_text_is_cut(family, text, want, pieces):
    got, parser = parse(family, text, pieces)
    assert got == want
    assert parser.calls == sum(isinstance(w, tuple) for w in want)


def test_content_streams_at_once_but_for_a_possible_marker():
    parser = ToolCallParser("hermes", NAMES)
    assert parser.feed("Hello <tool") == [Content("Hello ")]     # "<tool" may open a call: held
    assert parser.feed("box> there") == [Content("<toolbox> there")]
    assert parser.feed("<tool_call>\n{") == []
    call, = parser.feed('"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert (call.index, call.name, call.arguments) == (0, "add", '{"a": 1, "b": 2}')
    assert len(call.id) == 9 and call.id.isalnum()


def test_llama3_holds_a_reply_that_starts_with_a_brace_until_its_end():
    parser = ToolCallParser("llama3", NAMES)
    assert parser.feed('  {"name": "add", ') == [] and parser.feed('"parameters": {"a": 1, "b": 2}}') == []
    assert [type(d) for d in parser.finish()] == [Call]


def test_a_forced_call_names_a_listed_function():
    with pytest.raises(MessageError, match="tool_choice names the function 'rm', which is not among the tools"):
        forced_call_grammar("hermes", TOOLS, "rm")


@pytest.mark.parametrize("family", ["hermes", "mistral"])
def test_a_forced_grammar_allows_a_second_call_only_when_parallel(tiny, family):
    _, tok = tiny
    one = {"name": "add", "arguments": {"a": 1, "b": 2}}
    text = ("[TOOL_CALLS][" + json.dumps(one) + ", " + json.dumps(one) + "]" if family == "mistral"
            else "<tool_call>\n" + json.dumps(one) + "\n</tool_call>\n<tool_call>\n" + json.dumps(one)
            + "\n</tool_call>")

    def consumed(parallel):
        constraint = forced_call_grammar(family, TOOLS, parallel=parallel).constraint(tok)
        for token in tok.encode(text, add_bos=False):
            try:
                constraint.advance(token)
            except GrammarError:
                return False
        return True

    assert consumed(parallel=True) and not consumed(parallel=False)


# Forced calls on the tiny model: whatever its weights, the reply is a call the parser takes.

@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from nibble.runner import load
    return load(str(tiny_dir))


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral", "generic"])
@pytest.mark.parametrize("name", [None, "add"])
def test_forced_calls_on_the_tiny_model_parse_into_the_tools(tiny, family, name):
    from nibble.runner import stream_generate
    model, tok = tiny
    constraint = forced_call_grammar(family, TOOLS, name).constraint(tok)
    # The prompt without the tools: they would not fit the tiny model's 256 positions
    rs = list(stream_generate(model, tok, tok.prompt("Weather in Paris?"), max_tokens=200, constraint=constraint,
                              sampler=make_sampler(SamplerSettings(temperature=0.8, seed=1))))
    got, parser = parse(family, "".join(r.text for r in rs))
    assert rs[-1].finish_reason == "stop" and parser.calls >= 1 and all(isinstance(g, tuple) for g in got), got
    for _, called, arguments in got:
        assert called == (name or called) and called in NAMES
        schema = (WEATHER if called == "get_weather" else ADD)["function"]["parameters"]
        assert set(arguments) == set(schema["required"])
