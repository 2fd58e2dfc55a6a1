"""Chat templates: a conversation rendered to prompt text exactly as Hugging Face renders it.

The Jinja environment copies transformers' `_compile_jinja_template`: the same sandbox, options,
globals and `tojson`, so a model's template gives the prompt it was trained on.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nibble.formats.errors import NibbleError

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
    _template: jinja2.Template = field(init=False, repr=False)

    def __post_init__(self):
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"The model's chat template has a syntax error (line {e.lineno}: {e.message}). "
                "Fix chat_template in tokenizer_config.json, or pass --raw to skip the template."
            ) from e

    @classmethod
    def from_tokenizer_config(cls, config: dict) -> ChatTemplate:
        """The template named "default" (or the only one) in a tokenizer_config.json dict."""
        source = _pick_template(config.get("chat_template"))
        tokens = {key: _token_text(config[key]) for key in SPECIAL_TOKEN_KEYS if config.get(key)}
        return cls(source, tokens)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]).

        With `add_generation_prompt` the text ends with the header that opens the assistant's turn.
        """
        try:
            # tools and documents are None, as transformers passes them, for templates that test them.
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"The model's chat template failed to render: {e}. "
                                    "Pass --raw to skip the template.") from e


def build_messages(prompt: str, system: str | None = None) -> list[dict]:
    """A one-turn conversation: an optional system message, then the user's prompt."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    return messages + [{"role": "user", "content": prompt}]


def _pick_template(chat_template: str | list | None) -> str:
    """The template text; tokenizer_config.json may hold several as [{"name", "template"}, ...]."""
    if not chat_template:
        raise ChatTemplateError("This model has no chat template, so it cannot be sent a conversation. "
                                "Pass --raw to send the prompt text as it is.")
    if isinstance(chat_template, str):
        return chat_template
    named = {t["name"]: t["template"] for t in chat_template}
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


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _raise_exception(message: str):
    raise ChatTemplateError(f"The model's chat template rejected the conversation: {message}")


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
