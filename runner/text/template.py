"""Chat templates: a conversation rendered to prompt text exactly as Hugging Face renders it.

The Jinja environment copies transformers' `_compile_jinja_template`: the same sandbox, options,
globals and `tojson`, so a model's template gives the prompt it was trained on. The template is
code from whoever published the model, so it runs within limits (runner/text/sandbox.py), and anything
it does wrong ends in one ChatTemplateError line.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import SecurityError

from nibble.formats.errors import NibbleError
from .sandbox import BoundedEnvironment, Limits, TemplateLimit, render

# Real templates are a few KB; a larger one would take long just to compile.
MAX_SOURCE_CHARS = 1_000_000
# An error's text in one line of at most this many characters (a template may raise a long one).
MAX_MESSAGE_CHARS = 300

# The tokenizer_config.json keys transformers passes to every template (its special_tokens_map).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                      "mask_token")


class ChatTemplateError(NibbleError):
    """A chat template that cannot be compiled, or that refused to render a conversation."""


@dataclass
class ChatTemplate:
    """A compiled chat template and the special tokens its text may refer to."""
    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)  # e.g. {"eos_token": "<|im_end|>"}
    limits: Limits = Limits()
    _template: jinja2.Template = field(init=False, repr=False)

    def __post_init__(self):
        if len(self.source) > MAX_SOURCE_CHARS:
            raise ChatTemplateError(f"the model's chat template is {len(self.source):,} characters long, "
                                    f"more than {MAX_SOURCE_CHARS:,}: pass --raw to skip it")
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(_one_line(f"the model's chat template has a syntax error at line "
                                              f"{e.lineno}: {e.message}; pass --raw to skip it")) from None
        except Exception as e:   # nested too deeply for Python's parser or compiler, say
            raise _failure("could not be compiled", e) from None

    @classmethod
    def from_tokenizer_config(cls, config: dict, name: str = "default") -> ChatTemplate:
        """The template named `name` in a tokenizer_config.json dict; else the one named "default"
        (or the only one). transformers renders a conversation with tools through "tool_use"."""
        source = _pick_template(config.get("chat_template"), name)
        tokens = {key: _token_text(config[key]) for key in SPECIAL_TOKEN_KEYS if config.get(key)}
        return cls(source, tokens)

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, options: dict | None = None) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]).

        With `add_generation_prompt` the text ends with the header that opens the assistant's turn.
        `tools` are OpenAI's function definitions, passed as transformers passes them (see
        runner/text/tools.py: prepare_messages makes a conversation with calls ready for this).
        `options`: more variables the template reads (enable_thinking, say: runner/text/reasoning.py).
        """
        # documents is None, and tools without any, as transformers passes them.
        context = dict(options or {}, messages=messages, tools=tools, documents=None,
                       add_generation_prompt=add_generation_prompt, **self.special_tokens)
        input_chars = sum(len(str(m.get("content", ""))) + len(str(m.get("tool_calls") or ""))
                          + len(str(m.get("reasoning_content") or "")) for m in messages) \
            + len(str(tools or "")) + len(str(options or ""))
        try:
            return render(self._template, self.limits, input_chars, context)
        except ChatTemplateError:
            raise
        except TemplateLimit as e:
            raise _failure(str(e)) from None
        except RecursionError:
            raise _failure("nests too deeply for Python") from None
        except MemoryError:
            raise _failure("ran out of memory") from None
        except SecurityError as e:
            raise _failure("did something its sandbox forbids", e) from None
        except Exception as e:   # whatever the template's code raised: its failure, not nibble's
            raise _failure("failed", e) from None


def build_messages(prompt: str, system: str | None = None, images: Sequence = ()) -> list[dict]:
    """A one-turn conversation: an optional system message, then the user's prompt, after its
    `images` (formats.image.Picture) if any, as llama.cpp's and ollama's one-shot prompts put them."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    if images:
        return messages + [{"role": "user", "content": [*({"type": "image", "image": p} for p in images),
                                                         {"type": "text", "text": prompt}]}]
    return messages + [{"role": "user", "content": prompt}]


def _pick_template(chat_template: str | list | None, name: str) -> str:
    """The template text; tokenizer_config.json may hold several as [{"name", "template"}, ...]."""
    if not chat_template:
        raise ChatTemplateError("This model has no chat template, so it cannot be sent a conversation. "
                                "Pass --raw to send the prompt text as it is.")
    if isinstance(chat_template, str):
        return chat_template
    named = {t["name"]: t["template"] for t in chat_template}
    if name in named:
        return named[name]
    if "default" in named:
        return named["default"]
    if len(named) == 1:
        return next(iter(named.values()))
    raise ChatTemplateError(f"This model has several chat templates ({', '.join(named)}) and none is "
                            "named 'default'. Add one named 'default' to tokenizer_config.json, "
                            "or pass --raw.")


def _token_text(token: str | dict) -> str:
    """A special token's text; tokenizer_config.json may store it as an AddedToken dict."""
    return token["content"] if isinstance(token, dict) else token


def _environment() -> BoundedEnvironment:
    return BoundedEnvironment(filters={"tojson": _tojson},
                              globals={"raise_exception": _raise_exception, "strftime_now": _strftime_now},
                              trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])


def _failure(what: str, error: Exception | None = None) -> ChatTemplateError:
    detail = f": {type(error).__name__}: {str(error).rstrip('.')}" if error is not None else ""
    return ChatTemplateError(_one_line(f"the model's chat template {what}{detail}; pass --raw to skip it"))


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS - 1] + "…"


def _raise_exception(message: str):
    # The template author's words to the user (e.g. "roles must alternate user/assistant"): kept.
    raise ChatTemplateError(_one_line(f"the model's chat template refused the conversation: {message}"))


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' override: Jinja's own tojson escapes HTML characters and takes fewer options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with it to build
    training masks. Rendering just emits the body; without the tag such templates fail to compile."""
    tags = {"generation"}

    def parse(self, parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)
