"""Thinking kept apart from the answer, as a reply streams, and bounded by a budget.

Two families of markers, told apart by the chat template's source:

    think    `<think>`…`</think>` before the answer (Qwen3, SmolLM3, QwQ, DeepSeek-R1 and its
             distills). A template may open the block itself (DeepSeek-R1's ends the prompt
             with "<think>\\n"): the reply then starts inside it.
    harmony  gpt-oss's channels, each message `<|channel|>NAME<|message|>…<|end|>`: `analysis`
             is thinking, `final` the answer, `commentary` addressed `to=functions.NAME` a tool
             call (rewritten in hermes' `<tool_call>` form for runner/text/tools.py's parser), without
             an address a preamble the user reads.

A template's `enable_thinking` (`reasoning_effort` for gpt-oss) turns thinking off or down where
the template has the switch; where it opens the block regardless, an empty block is closed in the
prompt. Past the budget, the ids of the marker that ends thinking are forced, and the answer
follows.
"""
from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

FAMILIES = ("think", "harmony")
EFFORTS = ("low", "medium", "high")   # gpt-oss's reasoning efforts
# Effort names past "high" that newer OpenAI and Anthropic models, and ollama, take: gpt-oss's highest
STRONGER = ("xhigh", "max")


def template_effort(name: str | None) -> str | None:
    """An API's effort name as gpt-oss's template knows it."""
    return "high" if name in STRONGER else name

OPEN, CLOSE = "<think>", "</think>"
# what ends a thinking block a budget cut, and what follows it before the answer
THINK_END = "\n</think>\n\n"
HARMONY_END = "<|end|><|start|>assistant<|channel|>final<|message|>"
HARMONY_MARKERS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>", "<|return|>",
                   "<|constrain|>")


@dataclass(frozen=True)
class ThinkingOptions:
    """What is asked of a model's thinking, from the command line or a request (every API's knobs
    in one form); a request's laid over the server's (`over`)."""
    think: bool | None = None          # on, off, or (None) as the model does
    budget: int | None = None          # the most tokens it may think: 0 is off, -1 no bound (None: unsaid)
    effort: str | None = None          # gpt-oss's reasoning_effort: "low", "medium" or "high"
    template: dict = field(default_factory=dict)   # chat_template_kwargs, passed to the template

    def over(self, defaults: ThinkingOptions) -> ThinkingOptions:
        """These options, `defaults` where these leave one unsaid."""
        return ThinkingOptions(self.think if self.think is not None else defaults.think,
                               self.budget if self.budget is not None else defaults.budget,
                               self.effort or defaults.effort, {**defaults.template, **self.template})


@dataclass(frozen=True)
class Thinking:
    """Reply text that is the model's thinking, not its answer."""
    text: str


def reasoning_family(template_source: str) -> str | None:
    """The markers a chat template's model thinks in (see the module's docstring), or None."""
    if "<|channel|>" in template_source:
        return "harmony"
    if CLOSE in template_source:
        return "think"
    return None


def chat_prompt(tokenizer: Tokenizer, messages: list[dict], asked: ThinkingOptions = ThinkingOptions(),
                tools: list[dict] | None = None, forced: bool = False) -> tuple[str, ReasoningSplit | None]:
    """A conversation's prompt through the model's chat template (the tool template with `tools`),
    its thinking as `asked`, and the split of its reply (None: the template's model does not
    think). A budget of 0 is thinking off; a `forced` reply (a grammar's: a format, a call) does
    not think, which its grammar would not allow."""
    family = reasoning_family(tokenizer.chat_template.source)
    messages = tokenizer.started(messages)
    think = False if asked.budget == 0 or forced else asked.think
    budget = asked.budget if asked.budget is not None and asked.budget > 0 else None
    if family == "harmony":   # gpt-oss's template reads an earlier turn's thinking under this name
        messages = [{**m, "thinking": m["reasoning_content"]} if "reasoning_content" in m else m for m in messages]
    template = tokenizer.tool_template if tools else tokenizer.chat_template
    text = template.render(messages, tools=tools,
                           options={**template_options(family, think, asked.effort), **asked.template})
    text, inside = prompt_state(family, text, think)
    if family is None:
        return text, None
    end = tokenizer.encode(THINK_END if family == "think" else HARMONY_END, add_bos=False)
    return text, ReasoningSplit(family, inside, budget, end)


def template_options(family: str | None, think: bool | None, effort: str | None) -> dict:
    """What a template of `family` is told about thinking: `think` on, off or (None) as the model
    prefers; gpt-oss's `effort` (None: its default, or "low" when thinking is turned off, which
    Harmony cannot do)."""
    if family == "think":
        return {"enable_thinking": think is not False}
    if family == "harmony" and (effort or think is False):
        return {"reasoning_effort": effort or "low"}
    return {}


def prompt_state(family: str | None, prompt: str, think: bool | None) -> tuple[str, bool]:
    """-> (the prompt, whether its reply starts inside thinking). A think-family template that
    opens the block whatever it is told gets it closed when thinking is off."""
    if family != "think":
        return prompt, False
    inside = prompt.rfind(OPEN) > prompt.rfind(CLOSE)
    if inside and think is False:
        return prompt + THINK_END.lstrip("\n"), False
    return prompt, inside


class ReasoningSplit:
    """One reply's text, fed as it streams, split into Thinking and answer text (str), and its
    thinking counted in tokens against a budget.

        split = ReasoningSplit("think", inside=False, budget=256, end_ids=tokenizer.encode(THINK_END))
        for each token:  token = forced if (forced := split.forced()) is not None else sample()
                         split.count(token); parts = split.feed(text)
    """

    def __init__(self, family: str, inside: bool = False, budget: int | None = None,
                 end_ids: list[int] = ()):
        if family not in FAMILIES:
            raise ValueError(f"reasoning family must be one of {FAMILIES}, got {family!r}")
        self.family, self.budget = family, budget
        self.end_ids = list(end_ids)
        self.thinking_tokens = 0
        self._forced: deque[int] = deque()
        self._buffer = ""
        if family == "think":
            # "start": no answer text yet (a block may open); "inside": thinking; "answer"
            self._mode = "inside" if inside else "start"
            self._strip = inside   # the whitespace after a marker is not part of what follows
        else:
            self._mode, self._channel, self._header = "header", "", ""
            self._strip = False

    @property
    def thinking(self) -> bool:
        """Whether the next token is thinking."""
        if self.family == "think":
            return self._mode == "inside"
        return self._mode == "body" and self._channel == "analysis"

    def forced(self) -> int | None:
        """The next id to emit in place of a sampled one: the end of thinking, once the budget
        is spent."""
        if not self._forced and self.budget is not None and self.thinking \
                and self.thinking_tokens >= self.budget and self.end_ids:
            self._forced.extend(self.end_ids)
            self.end_ids = []   # forced once
        return self._forced[0] if self._forced else None

    def count(self, token: int):
        """Note the reply's next token (before its text is fed): a forced one, or one more of
        thinking while the reply thinks."""
        if self._forced and self._forced[0] == token:
            self._forced.popleft()
        elif self.thinking:
            self.thinking_tokens += 1

    def feed(self, text: str) -> list[Thinking | str]:
        """The parts that `text`, the reply's next piece, completes."""
        self._buffer += text
        return self._split(final=False)

    def finish(self) -> list[Thinking | str]:
        """What is left when the reply ends."""
        return self._split(final=True)

    # <think>…</think>

    def _split(self, final: bool) -> list[Thinking | str]:
        out: list[Thinking | str] = []
        if self.family == "harmony":
            self._harmony(out, final)
        else:
            self._think(out, final)
        return [p for p in out if (p.text if isinstance(p, Thinking) else p)]

    def _think(self, out: list, final: bool):
        while True:
            if self._strip:
                self._buffer = self._buffer.lstrip()
                if not self._buffer and not final:
                    return
                self._strip = False
            if self._mode == "start":
                head = self._buffer.lstrip()
                if head.startswith(OPEN):
                    self._buffer, self._mode, self._strip = head[len(OPEN):], "inside", True
                    continue
                if (not head or OPEN.startswith(head)) and not final:
                    return   # maybe the start of the marker
                self._mode = "answer"
            if self._mode == "answer":
                out.append(self._buffer)
                self._buffer = ""
                return
            i = self._buffer.find(CLOSE)
            if i >= 0:
                out.append(Thinking(self._buffer[:i].rstrip()))
                self._buffer, self._mode, self._strip = self._buffer[i + len(CLOSE):], "answer", True
                continue
            # hold back a possible marker's start, and trailing whitespace (it may end the block)
            marker = max((k for k in range(1, len(CLOSE)) if self._buffer.endswith(CLOSE[:k])), default=0)
            sent = len(self._buffer[:len(self._buffer) - marker].rstrip()) if not final else len(self._buffer)
            out.append(Thinking(self._buffer[:sent]))
            self._buffer = self._buffer[sent:]
            return

    # Harmony's channels

    def _harmony(self, out: list, final: bool):
        while True:
            if self._mode == "header":   # up to <|message|>: the channel and an address
                i = self._buffer.find("<|message|>")
                if i < 0:
                    if final and self._buffer.strip():   # no message follows: the text as it is
                        out.append(self._buffer)
                        self._buffer = ""
                    return
                self._header += self._buffer[:i]
                self._buffer = self._buffer[i + len("<|message|>"):]
                channel = re.search(r"<\|channel\|>\s*(\w+)", self._header)
                self._channel = channel.group(1) if channel else "final"
                to = re.search(r"to=(?:functions\.)?([^\s<]+)", self._header)
                self._to = to.group(1) if to and self._channel == "commentary" else None
                self._mode, self._header = "body", ""
                continue
            end = [(self._buffer.find(m), m) for m in ("<|end|>", "<|call|>", "<|return|>", "<|start|>")]
            end = min(((i, m) for i, m in end if i >= 0), default=None)
            if end is None and not final:
                if self._to is not None:
                    return   # a call's arguments are sent whole
                keep = max((k for m in HARMONY_MARKERS for k in range(1, len(m)) if self._buffer.endswith(m[:k])),
                           default=0)
                self._emit(out, self._buffer[:len(self._buffer) - keep], done=False)
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return
            i, marker = end if end is not None else (len(self._buffer), "")
            self._emit(out, self._buffer[:i], done=True)
            rest = self._buffer[i + len(marker):]
            self._buffer, self._mode = (marker + rest if marker == "<|start|>" else rest), "header"
            if self._buffer.startswith("<|start|>"):
                self._buffer = self._buffer[len("<|start|>"):]
            if not self._buffer:
                return

    def _emit(self, out: list, text: str, done: bool):
        if self._channel == "analysis":
            out.append(Thinking(text))
        elif self._to is None:
            out.append(text)
        elif done:
            out.append(f'<tool_call>{{"name": {json.dumps(self._to)}, "arguments": {text.strip() or "{}"}}}</tool_call>')
