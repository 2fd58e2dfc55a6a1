"""Fuzzing chat templates: hypothesis writes templates from a grammar of Jinja's constructs (loops,
macros, recursion, filters, string methods, arithmetic, lookups on messages, raise_exception, huge
ranges and products, sandbox escapes, unclosed tags) and renders them with realistic and hostile
conversations. Each must end in text, or in one ChatTemplateError line (the sandbox's limits end it)."""
import re

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from nibble.formats.errors import NibbleError
from nibble.runner.text.template import ChatTemplate
from nibble.runner.text.sandbox import Limits

# The mechanism is the same at any size; a smaller step budget than the default's ten million
# keeps a case that loops for ever to milliseconds, so 200 cases take seconds.
LIMITS = Limits(steps=20_000)

FILTERS = ["length", "string", "list", "upper", "title", "trim", "striptags", "e", "pprint", "first", "last",
           "reverse", "sort", "unique", "sum", "min", "max", "int", "float", "abs", "items", "dictsort",
           "tojson", "tojson(indent=1000000)", "join", "join(', ')", "join('x' * 100000)", "default('d')",
           "center(1000000000)", "indent(100000)", "replace('x', 'xxxxxxxxxx')", "replace('', 'ab')",
           "batch(3)", "batch(1000000000, 0)", "slice(1000000000)", "format(1000000000)", "wordwrap(1)",
           "urlize", "truncate(3)", "selectattr('role', 'equalto', 'user')", "map(attribute='content')",
           "map('string')", "attr('__class__')", "select('number')"]
METHODS = ["center", "ljust", "zfill", "expandtabs", "replace", "join", "format", "format_map", "split",
           "strip", "startswith", "get", "items", "append", "pop", "update", "__class__", "mro"]
OPERATORS = ["+", "-", "*", "/", "//", "%", "**", "~", "==", "!=", "<", "in", "not in", "and", "or", "is"]

leaves = st.sampled_from([   # (hypothesis draws the first ones most: the usual, then the odd)
    "m.content", "x", "ns.x", "messages", "i", "m", "m['role']", "ns", "loop.index", "bos_token",
    "0", "1", "2", "-1", "7", "100000", "1000000000", "10 ** 9", "2 ** 64", "1.5", "none", "true",
    "'x'", "''", "'ab'", "'%s'", "'%*s'", "'{}'", "'{0}{0}{0}'", "'{:>100000}'", "'\\n'", "'<|im_start|>'",
    "loop", "add_generation_prompt", "nothing", "messages[0]", "messages[-1]['content']", "m.tool_calls",
    "range(3)", "range(100000)", "range(10 ** 9)", "[]", "{}", "namespace(x=1)", "lipsum(2)",
    "''.__class__", "''.__class__.__mro__", "messages.__class__.__init__.__globals__",
    "raise_exception('the author says no')", "strftime_now('%Y')", "cycler(1, 2)", "f(1)",
])


def _compound(e):
    return st.one_of(
        st.tuples(e, st.sampled_from(OPERATORS), e).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(e, st.sampled_from(FILTERS)).map(lambda t: f"({t[0]}|{t[1]})"),
        st.tuples(e, st.sampled_from(METHODS), e).map(lambda t: f"({t[0]}).{t[1]}({t[2]})"),
        st.tuples(e, e).map(lambda t: f"{t[0]}[{t[1]}]"),
        st.tuples(e, e).map(lambda t: f"[{t[0]}, {t[1]}, {t[0]}]"),
        st.tuples(e, e).map(lambda t: f"{{'content': {t[0]}, 'role': {t[1]}}}"),
        st.tuples(e, e, e).map(lambda t: f"({t[0]} if {t[1]} else {t[2]})"),
        e.map(lambda x: f"f({x})"), e.map(lambda x: f"(not {x})"),
        e.map(lambda x: f"({x}).content"), e.map(lambda x: f"({x} is defined)"),
    )


expressions = st.recursive(leaves, _compound, max_leaves=8)


iterables = st.one_of(st.sampled_from(["messages", "range(100000)", "x", "ns.s", "m.content", "range(3)"]),
                      expressions)


def _tags(body):
    e = expressions
    return st.one_of(
        st.tuples(iterables, body).map(lambda t: f"{{% for x in {t[0]} %}}{t[1]}{{% endfor %}}"),
        st.tuples(iterables, body, e).map(
            lambda t: f"{{% for x in {t[0]} %}}{t[1]}{{% if {t[2]} %}}{{% break %}}{{% else %}}{{% continue %}}{{% endif %}}{{% endfor %}}"),
        body.map(lambda b: f"{{% for m in messages %}}{b}{{% else %}}empty{{% endfor %}}"),
        st.tuples(iterables, body, e).map(lambda t: f"{{% for x in {t[0]} recursive %}}{t[1]}{{{{ loop({t[2]}) }}}}{{% endfor %}}"),
        st.tuples(e, body, body).map(lambda t: f"{{% if {t[0]} %}}{t[1]}{{% else %}}{t[2]}{{% endif %}}"),
        body.map(lambda b: f"{{% macro f(n) %}}{b}{{% endmacro %}}"),
        body.map(lambda b: f"{{% filter upper %}}{b}{{% endfilter %}}"),
        body.map(lambda b: f"{{% set x %}}{b}{{% endset %}}"),
        body.map(lambda b: f"{{% call f(1) %}}{b}{{% endcall %}}"),
        body.map(lambda b: f"{{% generation %}}{b}{{% endgeneration %}}"),
    )


outputs = expressions.map(lambda x: f"{{{{ {x} }}}}")
statements = st.recursive(
    st.one_of(   # (outputs twice: as often as all the rest)
        outputs, outputs,
        expressions.map(lambda x: f"{{% set x = {x} %}}"),
        expressions.map(lambda x: f"{{% set ns.x = {x} %}}"),
        st.sampled_from(["hi ", "<|im_start|>", "\n", "{# note #}"]),
    ),
    lambda s: _tags(st.lists(s, max_size=3).map("".join)),
    max_leaves=10,
)

# What every template starts with: a namespace to grow, a macro that calls itself, and the names
# the expressions use (undefined names would end most cases before they do anything).
PRELUDE = ("{% set ns = namespace(x=1, s='ab') %}{% set x = 'ab' %}{% set i = 3 %}"
           "{% set m = messages|last|default({'role': 'user', 'content': 'hi'}) %}"
           "{% macro f(n) %}{{ n }}{% if n is number and n < 1000 %}{{ f(n * 2) }}{% endif %}{% endmacro %}")
# Unclosed, unopened and mangled tags, in a third of the templates (at the end: they hide nothing).
MANGLED = ["{% for x in", "{{ x", "{% endif %}", "{% endfor %}", "{% macro %}", "{#", "}}", "{%%}", "{% break %}"]
templates = st.tuples(st.lists(statements, min_size=1, max_size=4),
                      st.sampled_from([""] * 2 * len(MANGLED) + MANGLED)).map(lambda t: PRELUDE + "".join(t[0]) + t[1])

contents = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["{{ 7 * 7 }}", "{% for x in range(10 ** 9) %}", "<|im_end|>", "x" * 100_000,
                     "\x00\x1b[31m", "{{ raise_exception('from a user') }}"]),
    st.none(),
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}), max_size=2),
)
messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "ipython"]), "content": contents},
    optional={"tool_calls": st.just([{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}])})
conversations = st.lists(messages, max_size=5)


def _kind(message: str) -> str:
    """The class of an error line: "failed: TypeError", "took more than N steps (...)", ..."""
    what = message.removeprefix("the model's chat template ").split(";")[0]
    if what.startswith(("failed", "could not be compiled", "did something")):
        return ":".join(what.split(":")[:2])
    return re.sub(r"\d[\d,.]*", "N", what.split(":")[0])


@pytest.mark.fuzz
@given(source=templates, conversation=conversations)
def test_a_template_ends_in_text_or_one_line(source, conversation):
    try:
        text = ChatTemplate(source, {"bos_token": "<s>"}, limits=LIMITS).render(conversation)
    except NibbleError as e:
        message = str(e)
        assert "\n" not in message and message.startswith("the model's chat template "), message
        event(f"outcome: {_kind(message)}")
    else:
        assert isinstance(text, str)
        event("outcome: text")
