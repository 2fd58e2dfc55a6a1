"""A Jinja sandbox with limits: a chat template is code from whoever published the model, and
rendering it must end, soon, in text of a sane size.

Jinja's own sandbox stops a template from touching Python's internals but not from looping 10^10
times, writing `'x' * 10**9`, or nesting a macro until Python's stack gives out. Here every loop
turn, call, lookup and operator is a step that checks the render's `Budget` (steps, a deadline,
call depth), every string, list and dict a template makes is measured before it is made, and all
the text it writes, its macros' included, is counted as it is written. Going past a limit raises
`TemplateLimit` from inside the render: no thread is left running.
"""
from __future__ import annotations

import math
import re
import string
import time
import types
from contextvars import ContextVar
from copy import copy
from dataclasses import dataclass, field
from functools import wraps

# Jinja's internals (its compiler's visitors, _PassArg, a Namespace's private attributes):
# pyproject.toml holds jinja2 to the minor version they were written against.
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, _PassArg


class TemplateLimit(Exception):
    """A template that went past one of its limits; the message completes "the template ..."."""


@dataclass(frozen=True)
class Limits:
    # Real templates render a chat in milliseconds, but some redo work for every message:
    # llama-guard3's takes 5 s in plain Jinja for a chat of 2,000 messages.
    seconds: float = 10.0
    # Loop turns, calls, lookups and operators (about 3 s of Python here): the heaviest real
    # templates take about 500 per message, so this is a chat of 20,000. Unlike the deadline it
    # is the same on a busy machine, so a template fails (or not) the same way every time.
    steps: int = 10_000_000
    # Calls inside calls: recursive macros in real templates (JSON schemas) go a few levels deep,
    # and 64 stays well inside Python's own stack.
    depth: int = 64
    # Text written, and the size of any value made, in characters, beyond the conversation's own
    # text (counted four times: templates may write a message more than once). A million-token
    # context is about 4 MB of text.
    chars: int = 4_000_000
    # Integers: real templates count messages; a 4096-bit product is still instant.
    int_bits: int = 4096


@dataclass
class Budget:
    """What is left of one render's limits."""
    limits: Limits
    max_chars: int                   # text the render may write, and the largest value it may make
    chars: int = field(init=False)   # text it may still write
    steps: int = 0
    depth: int = 0
    deadline: float = field(init=False)
    _sizes: dict = field(default_factory=dict)   # id -> (value, size) of the values measured

    def __post_init__(self):
        self.chars = self.max_chars
        self.deadline = time.monotonic() + self.limits.seconds

    def tick(self):
        self.steps += 1
        if self.steps > self.limits.steps:
            raise TemplateLimit(f"took more than {self.limits.steps:,} steps (an endless loop?)")
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"ran longer than {self.limits.seconds:g} s (an endless loop?)")

    def write(self, n: int):
        self.chars -= n
        if self.chars < 0:
            raise TemplateLimit(f"wrote more than {self.max_chars:,} characters")

    def check(self, chars: int):
        """Refuses to make a value of about `chars` characters if that is too large."""
        if chars > self.max_chars:
            raise TemplateLimit(f"made a value of more than {self.max_chars:,} characters")

    def made(self, value):
        self.check(self.size(value))
        return value

    def size(self, value) -> int:
        """About how many characters `value` takes as text, a container's items counted each time
        they appear (a list holding one string a thousand times is a thousand strings long)."""
        return self._measure(value, (), {})[0]

    def _measure(self, value, inside: tuple, now: dict) -> tuple[int, bool]:
        """-> (size, whether it can change): a value is measured once, unless it holds a
        namespace, the one container a template can change (then once per `size` call, in `now`)."""
        if isinstance(value, (str, bytes)):
            return len(value), False
        if isinstance(value, int):
            return value.bit_length() // 3 + 1, False
        if not isinstance(value, (list, tuple, dict, set, frozenset, Namespace)):
            return 8, False   # a number, None, a macro, a loop: a short text
        key = id(value)
        if key in self._sizes:
            return self._sizes[key][1], False
        if key in now:
            return now[key], True
        self.tick()   # measuring takes time too
        changes = isinstance(value, Namespace)
        if changes:
            if key in inside:
                return 8, True   # a namespace holding itself: Python's repr writes it as "..."
            inside += (key,)
            value = object.__getattribute__(value, "_Namespace__attrs")
        parts = (part for item in value.items() for part in item) if isinstance(value, dict) else value
        n = 2
        for part in parts:
            size, part_changes = self._measure(part, inside, now)
            n, changes = n + 2 + size, changes or part_changes
            if n > self.max_chars:
                break   # too large already: no need to walk the rest
        if changes:
            now[key] = n
        else:
            self._sizes[key] = (value, n)   # holding the value keeps its id from being reused
        return n, changes


_budget: ContextVar[Budget] = ContextVar("template_budget")


def _current() -> Budget:
    budget = _budget.get(None)
    if budget is None:
        # Jinja folds constant expressions while compiling; leave them to the render, where
        # limits apply.
        raise nodes.Impossible()
    return budget


def render(template, limits: Limits, input_chars: int, context: dict) -> str:
    """`template` (compiled by a BoundedEnvironment) rendered with `context` within `limits`."""
    budget = Budget(limits, max_chars=limits.chars + 4 * input_chars)
    token = _budget.set(budget)
    try:
        parts = []
        for part in template.generate(context):
            budget.write(len(part))
            parts.append(part)
        return "".join(parts)
    finally:
        _budget.reset(token)


# -- sizes of what the operations that can grow text far beyond their arguments would make ----

_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?([-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?)[hlL]?[a-zA-Z%]")


def _format_size(budget: Budget, fmt: str, args, percent: bool) -> int:
    """Of `fmt % args` or `fmt.format(*args)`: each field at most all the arguments, padded to
    the widest width in a spec (one taken from the arguments too, for `*` or a nested field)."""
    fmt = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    if percent:
        specs = _PERCENT_SPEC.findall(fmt)
    else:
        specs = [spec or "" for _, name, spec, _ in string.Formatter().parse(fmt) if name is not None]
    widths = [int(n) for spec in specs for n in re.findall(r"\d+", spec)]
    if any("*" in spec or "{" in spec for spec in specs):
        widths += [abs(a) for a in _flat(args) if isinstance(a, int)]
    return len(fmt) + len(specs) * (budget.size(args) + max(widths, default=0))


def _flat(args):
    for a in args:
        yield from (a.values() if isinstance(a, dict) else a if isinstance(a, (list, tuple)) else (a,))


def _width(w) -> int:
    return len(w) if isinstance(w, str) else w if isinstance(w, int) else 0


def _lines(s) -> int:
    return str(s).count("\n") + 1 if isinstance(s, str) else 1


# name -> size(budget, *args, **kwargs) of the result, for filters and built-in types' methods
# alike (a filter's first argument is the value it filters, as a method's is the object it is
# called on): every other result is at most a small multiple of its arguments.
_GROWS = {
    "center": lambda b, s, width=80, *a, **k: b.size(s) + _width(width),
    "ljust": lambda b, s, width=0, *a, **k: b.size(s) + _width(width),
    "rjust": lambda b, s, width=0, *a, **k: b.size(s) + _width(width),
    "zfill": lambda b, s, width=0, *a, **k: b.size(s) + _width(width),
    "expandtabs": lambda b, s, tabsize=8, *a, **k: b.size(s) * (1 + max(_width(tabsize), 0)),
    "indent": lambda b, s, width=4, *a, **k: b.size(s) + _lines(s) * _width(width),
    "replace": lambda b, s, old="", new="", count=None, *a, **k:
        b.size(s) + (str(s).count(str(old)) if count is None or count < 0 else _width(count)) * b.size(new),
    "join": lambda b, items, d="", *a, **k: (1 + b.size(items)) * (1 + b.size(d)),
    "translate": lambda b, s, table=None, *a, **k: b.size(s) * (1 + b.size(table)),
    "wordwrap": lambda b, s, width=79, break_long_words=True, wrapstring=None, *a, **k:
        b.size(s) * (1 + b.size(wrapstring)),
    "urlize": lambda b, s, *a, **k: b.size(s) * (20 + b.size(a) + b.size(k)),
    "batch": lambda b, items, linecount=1, fill_with=None, *a, **k:
        2 * b.size(items) + _width(linecount) * (2 + b.size(fill_with)),
    "slice": lambda b, items, slices=1, fill_with=None, *a, **k:
        2 * b.size(items) + _width(slices) * (4 + b.size(fill_with)),
    "tojson": lambda b, x, ensure_ascii=False, indent=None, *a, **k:
        b.size(x) * (2 + _width(indent) + b.size(a) + b.size(k)),   # (separators among a, k)
    "format": lambda b, s, *a, **k: _format_size(b, str(s), a or (k,), percent=True),
    "lipsum": lambda b, n=5, html=True, min=20, max=100, *a, **k: 20 * _width(n) * _width(max),
    "to_bytes": lambda b, i, length=1, *a, **k: _width(length),
}


def _method(obj) -> tuple[object, str] | None:
    """(its object, its name) for a method of a built-in type (str, bytes, int, ...), the
    sandbox's str.format included, whose result _GROWS may know the size of."""
    func = getattr(obj, "__wrapped__", obj)
    if not isinstance(func, types.BuiltinMethodType) or isinstance(func.__self__, types.ModuleType):
        return None
    return func.__self__, func.__name__


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with every loop, call, lookup, operator, filter and output
    counted against the current render's Budget (set by `render`)."""
    intercepted_binops = frozenset(("+", "*", "%", "**"))

    def __init__(self, filters: dict, globals: dict, **options):
        super().__init__(finalize=_finalize, **options)
        self.code_generator_class = _BoundedCodeGenerator
        self.filters |= filters
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals |= globals
        self.globals["lipsum"] = _bounded_filter("lipsum", self.globals["lipsum"])

    def call(self, context, obj, /, *args, **kwargs):
        budget = _current()
        budget.tick()
        if isinstance(obj, LoopContext) and args:   # a recursive loop's next level: its turns count too
            args = (self.loop_items(args[0]),) + args[1:]
        owner, name = _method(obj) or (None, None)
        budget.check(budget.size(args) + budget.size(kwargs) + budget.size(owner))
        if isinstance(owner, str) and name in ("format", "format_map"):
            budget.check(_format_size(budget, owner, args + tuple(kwargs.values()), percent=False))
        elif name in _GROWS:
            budget.check(_GROWS[name](budget, owner, *args, **kwargs))
        budget.depth += 1
        try:
            if budget.depth > budget.limits.depth:
                raise TemplateLimit(f"nests calls deeper than {budget.limits.depth} (a macro calling itself?)")
            return budget.made(super().call(context, obj, *args, **kwargs))
        finally:
            budget.depth -= 1

    def getattr(self, obj, attribute):
        _current().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _current().tick()
        return super().getitem(obj, argument)

    def call_binop(self, context, operator, left, right):
        budget = _current()
        budget.tick()
        if operator in ("*", "**") and isinstance(left, int) and isinstance(right, int):
            bits = (left.bit_length() + right.bit_length() if operator == "*"
                    else math.log2(abs(left)) * right if abs(left) > 1 and right > 0 else 0)
            if bits > budget.limits.int_bits:
                raise TemplateLimit(f"made a number of more than {budget.limits.int_bits} bits")
        elif operator == "*":
            budget.check(budget.size(left) * right if isinstance(right, int) else
                         budget.size(right) * left if isinstance(left, int) else 0)
        elif operator == "%" and isinstance(left, (str, bytes)):
            budget.check(_format_size(budget, left, right if isinstance(right, tuple) else (right,),
                                      percent=True))
        elif operator == "+":
            budget.check(budget.size(left) + budget.size(right))
        return budget.made(super().call_binop(context, operator, left, right))

    def join_parts(self, join, parts) -> str:
        """`a ~ b`: measured before it is joined (by Jinja's str_join, or markup_join when escaping)."""
        budget = _current()
        budget.check(sum(budget.size(p) for p in parts))
        return join(parts)

    def loop_items(self, iterable):
        budget = _current()
        for item in iterable:
            budget.tick()
            yield item

    def output_buffer(self) -> _Output:
        return _Output(_current())

    def literal(self, value):
        """A list, tuple or dict written in the template, which may hold big values many times."""
        return _current().made(value)


def _finalize(value):
    """Every `{{ value }}`: measured before it becomes text."""
    budget = _current()
    budget.check(budget.size(value))
    return value


def _bounded_filter(name: str, f):
    skip = 1 if _PassArg.from_obj(f) else 0   # context or environment first, then the value
    grows = _GROWS.get(name)

    @wraps(f)
    def bounded(*args, **kwargs):
        budget = _current()
        budget.tick()
        given = args[skip:]
        budget.check(budget.size(given) + budget.size(kwargs))
        if grows is not None:
            budget.check(grows(budget, *given, **kwargs))
        return budget.made(f(*args, **kwargs))
    return bounded


class _Output(list):
    """A macro's or block's text as it is written, counted against the render's limit."""

    def __init__(self, budget: Budget):
        super().__init__()
        self.budget = budget

    def append(self, text: str):
        self.budget.write(len(text))
        super().append(text)

    def extend(self, texts):
        texts = tuple(texts)
        self.budget.write(sum(map(len, texts)))
        super().extend(texts)


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's compiler, with the hooks that Jinja's sandbox lacks: loop turns, `~`, literals and
    the buffers of macros and blocks go through the environment."""

    def buffer(self, frame):
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.output_buffer()")

    def visit_For(self, node, frame):
        node = copy(node)   # iterating environment.loop_items(iterable)
        node.iter = nodes.Call(nodes.EnvironmentAttribute("loop_items"), [node.iter], [], None, None,
                               lineno=node.iter.lineno)
        super().visit_For(node, frame)

    def visit_Concat(self, node, frame):
        # Jinja's own choice of join, as CodeGenerator.visit_Concat makes it
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        else:
            join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
        self.write(f"environment.join_parts({join}, (")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")

    def _literal(visit):
        def visit_literal(self, node, frame):
            if getattr(node, "ctx", "load") != "load":
                return visit(self, node, frame)   # a tuple being assigned to: `{% set a, b = ... %}`
            self.write("environment.literal(")
            visit(self, node, frame)
            self.write(")")
        return visit_literal

    visit_List = _literal(CodeGenerator.visit_List)
    visit_Tuple = _literal(CodeGenerator.visit_Tuple)
    visit_Dict = _literal(CodeGenerator.visit_Dict)
    del _literal
