"""Chat templates rendered as Hugging Face renders them, checked against llama.cpp's SmolLM2 prompts;
hostile templates end in one line, soon."""
import re

import jinja2.sandbox
import pytest
from click.testing import CliRunner

from nibble.formats.errors import NibbleError
from nibble.formats.model_dir import write_model_dir
from nibble.runner.text.template import ChatTemplate, build_messages
from nibble.tui.cli.main import main
from nibble.runner.text.sandbox import Limits
from tests.tiny import tiny_model_dir
from tests.llamacpp import SMOLLM2 as REFERENCE

# llama.cpp's run of SmolLM2-135M-Instruct (tests/data): its GGUF metadata holds the model's chat
# template, and each greedy output the prompt llama.cpp rendered.
SMOLLM2_TEMPLATE = REFERENCE["model_metadata"]["tokenizer.chat_template"]
SMOLLM2_OUTPUTS = REFERENCE["greedy"]["models"]["SmolLM2-135M-Instruct.F32.gguf"]["outputs"]
SMOLLM2_CONFIG = {"chat_template": SMOLLM2_TEMPLATE, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}


@pytest.mark.parametrize("output", SMOLLM2_OUTPUTS, ids=lambda o: o["prompt"][:20])
def test_smollm2_prompt_matches_llamacpp(output):
    template = ChatTemplate.from_tokenizer_config(SMOLLM2_CONFIG)
    assert template.render(build_messages(output["prompt"])) == output["rendered_prompt"]


def test_smollm2_with_a_system_prompt():
    template = ChatTemplate.from_tokenizer_config(SMOLLM2_CONFIG)
    text = template.render(build_messages("Hi", system="Be brief."))
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert not template.render(build_messages("Hi"), add_generation_prompt=False).endswith("assistant\n")


def test_build_messages():
    assert build_messages("q") == [{"role": "user", "content": "q"}]
    assert build_messages("q", system="s") == [{"role": "system", "content": "s"},
                                               {"role": "user", "content": "q"}]


def test_raise_exception_becomes_a_nibble_error():
    template = ChatTemplate("{% if messages[0]['role'] != 'user' %}"
                            "{{ raise_exception('Conversation must start with a user message') }}"
                            "{% endif %}ok")
    assert template.render(build_messages("q")) == "ok"
    with pytest.raises(NibbleError, match="Conversation must start with a user message"):
        template.render(build_messages("q", system="s"))


def test_no_template_says_to_pass_raw():
    with pytest.raises(NibbleError, match="--raw"):
        ChatTemplate.from_tokenizer_config({"eos_token": "</s>"})


def test_syntax_error_is_a_nibble_error():
    with pytest.raises(NibbleError, match="syntax error"):
        ChatTemplate("{% for m in messages %}{{ m.content }}")


def test_named_templates_pick_default_and_added_token_dicts():
    config = {"chat_template": [{"name": "tool_use", "template": "tools"},
                                {"name": "default", "template": "{{ bos_token }}{{ eos_token }}"}],
              "bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>"}
    assert ChatTemplate.from_tokenizer_config(config).render([]) == "<s></s>"
    assert ChatTemplate.from_tokenizer_config(config, "tool_use").render([]) == "tools"   # with tools
    assert ChatTemplate.from_tokenizer_config(config, "nope").render([]) == "<s></s>"
    config["chat_template"] = config["chat_template"][:1] + [{"name": "rag", "template": "x"}]
    with pytest.raises(NibbleError, match="default"):
        ChatTemplate.from_tokenizer_config(config)


def test_tools_reach_the_template_as_transformers_passes_them():
    t = ChatTemplate("{% if tools is none %}none{% else %}{{ tools | map(attribute='function.name') | join(',') }}{% endif %}")
    tools = [{"type": "function", "function": {"name": n}} for n in ("a", "b")]
    assert (t.render([]), t.render([], tools=tools)) == ("none", "a,b")


def test_hugging_face_environment():
    """trim_blocks/lstrip_blocks, loop controls, HF's tojson, strftime_now, {% generation %}."""
    template = ChatTemplate(
        "{% for m in messages %}\n"
        "  {% if loop.index > 1 %}{% break %}{% endif %}\n"
        "{{ m | tojson }}|{{ strftime_now('%Y') | length }}|"
        "{% generation %}{{ m.content }}{% endgeneration %}\n"
        "{% endfor %}")
    text = template.render([{"role": "user", "content": "café <b>"}, {"role": "user", "content": "x"}])
    assert text == '{"role": "user", "content": "café <b>"}|4|café <b>'


# Jinja constructs whose code the bounded sandbox compiles its own way (loops, `~`, literals,
# the buffers of macros, blocks and filters) or checks (calls, operators, filters, formats).
CONSTRUCTS = [
    "{% set x %}{{ 'a' ~ messages[0].content }}{% endset %}{{ x }}",
    "{% filter upper %}{{ 'a' ~ messages[-1].content }}{% endfilter %}",
    "{% macro m(a) %}[{{ a ~ caller() }}]{% endmacro %}{% call m('x') %}c{% endcall %}",
    "{% autoescape true %}{{ '<b>' ~ messages[0].content }}{% endautoescape %}",
    "{% block b %}{{ messages|length }}{% endblock %}{{ self.b() }}",
    "{% for m in messages if m.role != 'system' %}{{ loop.index }}/{{ loop.length }}{{ m.role }}{% else %}-{% endfor %}",
    "{% for m in [messages, [messages[0]]] recursive %}{% if m is mapping %}{{ m.role }}{% else %}({{ loop(m) }}){% endif %}{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + loop.index %}{% endfor %}{{ ns.n }}",
    "{{ ['a', 'b']|join(', ') }}{{ '%s-%05d' % ('a', 1) }}{{ '{}:{:>4}'.format(1, 2) }}{{ 2 ** 10 }}{{ 'ab' * 3 }}",
    "{{ messages[0]|dictsort }}{{ messages|map(attribute='role')|list }}{{ {'k': [1, (2, 3)]} }}",
    "{{ 'x'|center(9) }}{{ 'a\nb'|indent(2, true) }}{{ 'abc'|replace('b', 'xx') }}{{ [1, 2, 3]|batch(2)|list }}",
    "{{ 'a\tb'.expandtabs(4) }}{{ 'ab'.ljust(5, '.') }}{{ ('-' * 3).join('xyz') }}{{ (7).to_bytes(2, 'big') }}",
]


@pytest.mark.parametrize("source", CONSTRUCTS)
def test_the_limits_change_nothing_jinja_renders(source):
    plain = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    messages = build_messages("hi <you>", system="s")
    want = plain.from_string(source).render(messages=messages)
    assert ChatTemplate(source).render(messages) == want


# The limits but the deadline: which limit a template meets first then does not depend on how
# busy the machine is.
NO_DEADLINE = Limits(seconds=float("inf"))


def refused(source: str, messages=None, limits=NO_DEADLINE) -> str:
    """The one line that rendering `source` ends in."""
    with pytest.raises(NibbleError) as e:
        ChatTemplate(source, limits=limits).render(messages or build_messages("q", system="s"))
    message = str(e.value)
    assert "\n" not in message and message.startswith("the model's chat template "), message
    return message


def test_the_sandbox_refuses_mutation():
    assert "sandbox forbids" in refused("{{ messages.append(1) }}")


@pytest.mark.parametrize("source, says", [
    # Loops that would run for hours: 10^10 turns, the range made once or each time.
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    ("{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}", "steps"),
    ("{% for x in [1] recursive %}{{ loop([1, 2]) }}{% endfor %}", "deeper than 64"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(1) }}", "deeper than 64"),
    # Text of gigabytes, made at once or grown.
    ("{{ 'x' * 1000000000 }}", "value of more than"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "value of more than"),
    ("{% set s = 'x' * 1000 %}{% for i in range(100000) %}{{ s }}{% endfor %}", "wrote more than"),
    ("{% macro m() %}{% for i in range(10000) %}{{ 'x' * 1000 }}{% endfor %}{% endmacro %}"
     "{% for i in range(100) %}{% set t = m() %}{% endfor %}", "wrote more than"),
    ("{% set a = ['x' * 10000] * 10000 %}{{ a }}", "value of more than"),
    ("{% set a = ['x' * 1000] * 1000 %}{% set b = [a, a, a, a, a, a, a, a] %}{{ b|length }}", "value of more than"),
    ("{{ 'x'|center(1000000000) }}", "value of more than"),
    ("{{ ('\n' * 100000)|indent(100000) }}", "value of more than"),
    ("{{ ('x' * 100000)|replace('x', 'y' * 100000) }}", "value of more than"),
    ("{{ ','.join(['x' * 100000] * 100) * 1 }}", "value of more than"),
    ("{{ '%1000000000s'|format('x') }}", "value of more than"),
    ("{{ '%*s' % (1000000000, 'x') }}", "value of more than"),
    ("{{ '{:>1000000000}'.format('x') }}", "value of more than"),
    ("{{ '{0}{0}{0}{0}{0}{0}{0}{0}'.format('x' * 1000000) }}", "value of more than"),
    ("{{ ('\t' * 100000).expandtabs(100000) }}", "value of more than"),
    ("{{ lipsum(1000000000) }}", "value of more than"),
    ("{{ [1]|batch(1000000000, 0)|list }}", "value of more than"),
    ("{% set ns = namespace(x=1) %}{% set l = [namespace(a=ns, b=ns)] * 100000 %}{% set ns.x = 'y' * 100 %}"
     "{{ l }}", "value of more than"),
    # Numbers of gigabits.
    ("{{ 9 ** 999999999 }}", "4096 bits"),
    ("{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}", "4096 bits"),
    # The sandbox's own refusals and Python's errors, raised by the template's code.
    ("{{ range(10 ** 9)|list }}", "OverflowError: Range too big"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "sandbox forbids: SecurityError"),
    ("{{ messages.__class__.__name__ }}", "sandbox forbids"),
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{{ 1 + 'a' }}", "TypeError"),
    ("{{ 10.0 ** 400 }}", "OverflowError"),
    ("{{ {}['a']['b'] }}", "UndefinedError"),
    ("{% include 'other.jinja' %}", "failed"),
    # Too deep for Python's parser, and plain syntax errors.
    ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "could not be compiled: RecursionError"),
    ("{% for m in messages %}{{ m.content }}", "syntax error at line 1"),
    ("{{ 'unclosed }}", "syntax error"),
    ("{% endif %}", "syntax error"),
])
def test_hostile_templates_end_in_one_line(source, says):
    assert says in refused(source)


def test_the_deadline_ends_a_template_whose_steps_are_slow():
    source = "{% set l = range(100000)|list %}{% for i in range(100000) %}{{ (l|sort|reverse|list)[0] }}{% endfor %}"
    assert "ran longer than 0.5 s" in refused(source, limits=Limits(seconds=0.5))


def test_raise_exception_keeps_the_author_s_words_in_one_line():
    message = refused("{{ raise_exception('Roles must alternate\nuser/assistant ' * 100) }}")
    assert message.startswith("the model's chat template refused the conversation: Roles must alternate "
                              "user/assistant") and len(message) <= 300


def test_a_huge_template_is_refused_before_compiling():
    assert "1,000,001 characters long" in refused("x" * 1_000_001)


def test_the_limits_leave_long_chats_alone():
    """2,000 messages through SmolLM2's template: text as long as the chat, well within every limit."""
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"message {i} " * 100} for i in range(2000)]
    text = ChatTemplate.from_tokenizer_config(SMOLLM2_CONFIG).render(messages)
    assert text.count("<|im_start|>") == 2002 and len(text) > 2000 * 1000   # and its own system message


def test_nibble_run_says_what_the_template_did_in_one_line(tmp_path):
    model = tiny_model_dir()
    model.tokenizer_config["chat_template"] = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    path = write_model_dir(model, tmp_path / "hostile")
    result = CliRunner().invoke(main, ["run", "-m", str(path), "-n", "2", "hi"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    # the steps' limit, or on a busy machine the deadline's, whichever comes first
    [line] = result.stderr.strip().splitlines()
    assert re.fullmatch(r"Error: the model's chat template (took more than 10,000,000 steps|ran longer than 10 s) "
                        r"\(an endless loop\?\); pass --raw to skip it", line), line
