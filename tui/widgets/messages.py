"""The conversation: one widget per message; a reply streams in as Markdown.

Textual lays the whole screen out again whenever a widget changes size, at a cost that grows with
the number of widgets; its Markdown widget makes several per paragraph or list item. So a message
here is a few Statics holding Rich Markdown, and a streaming reply re-renders only its last,
unfinished block: finished blocks are frozen into Statics of their own as they complete.

A reply's thinking (a model that thinks) goes above its answer, dimmed, in a Collapsible: open
while the model thinks, folded once the answer starts; its title toggles it (a click, or Enter).
"""
from __future__ import annotations

import re

from markdown_it import MarkdownIt
from rich.markdown import Markdown as RichMarkdown
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Collapsible, Label, Static

from ..store import Message

ROLES = {"user": "You", "assistant": "nibble", "system": "System"}
FINISH = {"stop": "", "length": "max tokens reached", "context": "context full", "stopped": "stopped",
          "error": "failed", "interrupted": "interrupted"}
WELCOME = ("Ask anything: Enter sends, Shift+Enter or Ctrl+J starts a new line, Esc stops a reply.\n"
           "F1 shows every key.")
# Messages shown when a chat opens; older ones stay in the history (and in what the model sees).
SHOWN = 60
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def describe(stats: dict, finish: str | None) -> str:
    """The line under a reply: tokens and speed, what the prompt cost, and why it ended."""
    parts = []
    if n := stats.get("generation_tokens"):
        parts.append(f"{n} tokens")
    if tps := stats.get("generation_tps"):
        parts.append(f"{tps:.1f} tok/s")
    if "prefilled" in stats:
        disk = f" ({stats['from_disk']} from disk)" if stats.get("from_disk") else ""
        reused = f", {stats['reused']} reused{disk}" if stats.get("reused") else ""
        parts.append(f"prefill {stats['prefilled']} tokens{reused}")
    if stats.get("dropped"):
        parts.append(f"{stats['dropped']} oldest messages left out")
    if why := FINISH.get(finish, finish or ""):
        parts.append(why)
    return " · ".join(parts)


def image_line(picture, session) -> str:
    """An attached image as the chat shows it: name, pixels, file size, and the tokens it takes
    with the loaded model (when one that reads images is)."""
    vision = session.model.vision if session is not None else None
    tokens = f", {vision.count(picture)} tokens" if vision is not None else ""
    return picture.describe()[:-1] + tokens + ")"


def code_blocks(markdown: str) -> list[str]:
    """The fenced and indented code blocks of a Markdown text, in order."""
    tokens = MarkdownIt("commonmark").parse(markdown)
    return [t.content.rstrip("\n") for t in tokens if t.type in ("fence", "code_block")]


def frozen_length(source: str, start: int) -> int:
    """How much of `source` (from `start`, a block boundary) holds only finished blocks: up to the
    last blank line outside a code fence, or the end of a closed fence, that more text follows."""
    end, fence = start, None
    pos = start
    for line in source[start:].splitlines(keepends=True):
        pos += len(line)
        if not line.endswith("\n"):
            break   # the line being written
        if fence is not None:
            if line.strip().startswith(fence) and line.strip().strip(fence[0]) == "":
                fence, end = None, pos
        elif m := _FENCE.match(line):
            fence = m[1]
        elif not line.strip():
            end = pos
    return end


class MarkdownBody(Vertical):
    """A reply's Markdown: finished blocks in frozen Statics, the last one re-rendered per update."""

    def __init__(self, source: str, streaming: bool = False):
        super().__init__(classes="body")
        self.source = source
        self.streaming = streaming
        self._frozen = 0          # source[:_frozen] is in frozen Statics

    def compose(self) -> ComposeResult:
        yield Static(self._markdown(self.source), classes="tail")

    def _markdown(self, text: str):
        theme = "monokai" if self.app.current_theme.dark else "friendly"
        return RichMarkdown(text, code_theme=theme, hyperlinks=False)

    async def append(self, text: str):
        self.source += text
        tails = self.query(".tail")
        if not tails:   # mounted but not composed yet (a ThinkingView's, inside its Collapsible): compose shows it all
            return
        tail = tails.first(Static)
        end = frozen_length(self.source, self._frozen)
        if end > self._frozen:
            await self.mount(Static(self._markdown(self.source[self._frozen:end]), classes="frozen"),
                             before=tail)
            self._frozen = end
        tail.update(self._markdown(self.source[self._frozen:]))

    async def finish(self):
        """One Static for the whole reply, rendered as one document."""
        self.streaming = False
        await self.query(".frozen").remove()
        self._frozen = 0
        for tail in self.query(".tail"):   # none before compose, which shows it all
            tail.update(self._markdown(self.source))


def thinking_title(tokens: int, thinking: bool = False) -> str:
    if thinking:
        return "Thinking…"
    return f"Thought for {tokens} token{'s' if tokens != 1 else ''}" if tokens else "Thought"


class ThinkingView(Collapsible):
    """A reply's thinking, dimmed: open while it streams, folded once the answer starts."""

    def __init__(self, source: str, tokens: int = 0, streaming: bool = False, collapsed: bool = True):
        body = MarkdownBody(source, streaming)
        super().__init__(body, title=thinking_title(tokens, streaming), collapsed=collapsed and not streaming)
        self.body, self.tokens = body, tokens

    def on_mount(self):
        # A click folds or unfolds it and leaves the focus where the user types; Tab reaches the
        # title for Enter.
        self.query_one("CollapsibleTitle").FOCUS_ON_CLICK = False

    @property
    def streaming(self) -> bool:
        return self.body.streaming

    async def append(self, text: str, tokens: int):
        self.tokens = tokens
        await self.body.append(text)

    async def finish(self, fold: bool):
        """The thinking is over: the answer starts (`fold`), or the reply ended without one."""
        if self.body.streaming:
            await self.body.finish()
        self.title = thinking_title(self.tokens)
        if fold:
            self.collapsed = True


class MessageView(Vertical):
    """A message: who, the text (Markdown for replies, after their thinking if any), and a line
    of stats under replies."""

    def __init__(self, message: Message):
        super().__init__(classes=f"message {message.role}")
        self.set_class(message.finish == "interrupted", "interrupted")
        self.message = message
        self.body: MarkdownBody | None = None        # a reply's answer
        self.thinking: ThinkingView | None = None    # a reply's thinking, once there is some

    def compose(self) -> ComposeResult:
        m = self.message
        yield Label(ROLES.get(m.role, m.role), classes="role")
        if m.role == "assistant":
            if m.thinking:   # folded, but where no answer followed
                self.thinking = ThinkingView(m.thinking, m.stats.get("thinking_tokens", 0),
                                             collapsed=bool(m.content))
                yield self.thinking
            self.body = MarkdownBody(m.content)
            yield self.body
        else:
            for picture in m.images:
                yield Static("🖼 " + image_line(picture, self.app.session), markup=False, classes="image")
            yield Static(m.content, markup=False, classes="body")
        yield Static(describe(m.stats, m.finish), classes="meta", markup=False)

    async def think(self, text: str, tokens: int):
        """More of the reply's thinking, `tokens` into the reply."""
        if self.thinking is None:
            self.thinking = ThinkingView("", streaming=True)
            await self.mount(self.thinking, before=self.body)
        await self.thinking.append(text, tokens)

    async def append(self, text: str):
        """More of the reply's answer: its first folds the thinking."""
        if self.thinking is not None and self.thinking.streaming:
            await self.thinking.finish(fold=True)
        await self.body.append(text)

    async def finish(self, stats: dict, finish: str | None):
        if self.thinking is not None and self.thinking.streaming:
            await self.thinking.finish(fold=False)   # stopped while thinking: the thinking is all there is
        await self.body.finish()
        self.set_meta(describe(stats, finish))

    def toggle_thinking(self) -> bool:
        """Fold or unfold the thinking; False if there is none."""
        if self.thinking is None:
            return False
        self.thinking.collapsed = not self.thinking.collapsed
        return True

    def set_meta(self, text: str):
        self.query_one(".meta", Static).update(text, layout=False)   # one line, always

    @property
    def source(self) -> str:
        """The answer's Markdown (a user's message: its text)."""
        return self.body.source if self.body is not None else self.message.content

    def code_blocks(self) -> list[str]:
        return code_blocks(self.source)


class ChatView(VerticalScroll):
    """The messages of one chat, kept scrolled to the newest unless the user scrolls up."""

    async def show(self, messages: list[Message]):
        await self.remove_children()
        if messages:
            hidden = max(0, len(messages) - SHOWN)
            if hidden:
                await self.mount(Static(f"{hidden} earlier messages are not shown here.",
                                        classes="notice"))
            await self.mount_all([MessageView(m) for m in messages[hidden:]])
        else:
            await self.mount(Static(WELCOME, classes="notice welcome"))
        self.anchor()

    async def add(self, message: Message, view: MessageView | None = None) -> MessageView:
        """Show `message` last, in `view` if given."""
        await self.query(".welcome").remove()
        view = view or MessageView(message)
        await self.mount(view)
        self.anchor()
        return view

    async def notice(self, text: str, before: MessageView | None = None):
        await self.mount(Static(text, classes="notice", markup=False), before=before)
        self.anchor()

    def views(self) -> list[MessageView]:
        return list(self.query(MessageView))
