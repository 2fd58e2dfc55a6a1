"""The chat screen: past chats, the conversation, the message box and the status bar.

A reply is generated in one thread worker at a time (tui/turn.py), and stored as it grows; Esc
cancels the worker, which stops iterating over the reply after the current token, and what was
written is kept, marked "stopped" (as on quitting; "interrupted" is for a reply whose app died).
A model's thinking is shown and stored apart from its answer, and sent back with it as the
message's "reasoning_content" (the chat template keeps or drops it, as the model's does).
"""
from __future__ import annotations

import shlex
import sqlite3
from dataclasses import replace
from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Label, Static

from nibble.formats.image import ImageError, Picture, open_image
from ..store import Chat, ChatSettings, Message
from ..turn import Turn, TurnFailed, TurnUpdate, run_turn, stored_stats
from ..widgets.messages import ChatView, MessageView, image_line
from ..widgets.prompt import PromptInput
from ..widgets.sidebar import ChatList
from ..widgets.status import KeyHints, StatusBar
from .dialogs import ConfirmDialog, PathDialog, RenameDialog
from .settings import SettingsScreen

TITLE_LENGTH = 40
IMAGE_COMMAND = "/image"


def unquoted(path: str) -> str:
    """A path as typed or dropped into the terminal: quoted, or its spaces escaped, as a shell has it."""
    try:
        words = shlex.split(path)
    except ValueError:   # an unclosed quote: as typed
        return path
    return words[0] if len(words) == 1 else path


def kept(text: str, finish: str, thinking: str = "") -> bool:
    """Whether a reply is kept: one stopped or failed before its first word (of thinking or
    answer) is not."""
    return bool(text or thinking) or finish not in ("stopped", "error")


def sent(message: Message) -> dict:
    """A stored message as the model is given it: a reply's thinking apart from its answer; a
    message's images before its text."""
    out = {"role": message.role, "content": message.content}
    if message.images:
        out["content"] = [*({"type": "image", "image": p} for p in message.images),
                          {"type": "text", "text": message.content}]
    if message.thinking:
        out["reasoning_content"] = message.thinking
    return out


class ChatScreen(Screen):
    # Short descriptions for the footer; the tooltips are the longer text of the keys screen (F1).
    BINDINGS = [
        Binding("escape", "stop", "Stop", tooltip="Stop the reply (what it wrote is kept); cancel an edit"),
        Binding("ctrl+n", "new_chat", "New", tooltip="Start a new chat"),
        Binding("ctrl+r", "regenerate", "Regenerate", tooltip="Write the last reply again"),
        Binding("ctrl+l", "edit_last", "Edit", tooltip="Edit your last message and send it again"),
        Binding("ctrl+s", "settings", "Settings", tooltip="This chat's system prompt, sampling and thinking"),
        Binding("ctrl+t", "copy_reply", "Copy reply", show=False, tooltip="Copy the last reply"),
        Binding("ctrl+f", "copy_code", "Copy code", show=False,
                tooltip="Copy the last code block of the last reply"),
        Binding("f3", "toggle_thinking", "Thinking", show=False,
                tooltip="Show or hide the last reply's thinking"),
        Binding("f4", "attach_image", "Image", tooltip="Attach an image to your next message (or type /image PATH)"),
        Binding("f2", "rename_chat", "Rename", show=False, tooltip="Rename this chat"),
        Binding("f8", "delete_chat", "Delete", show=False, tooltip="Delete this chat"),
    ]

    def __init__(self, defaults: ChatSettings):
        super().__init__()
        self.defaults = defaults
        self.chat: Chat | None = None        # None: a new chat, stored with its first message
        self.settings = defaults
        self.history: list[Message] = []     # the chat's messages, oldest first
        self.turn: Turn | None = None
        self.want_reply = False              # a reply is due as soon as a model is ready
        self.editing: Message | None = None  # the user message being edited, if any
        self._code_key, self._code_index = None, 0   # which code block ctrl+f copied last
        self._queued: str | None = None      # sent while the stopped reply was being stored
        self.attached: list[Picture] = []    # images that go with the next message

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            with Vertical(id="sidebar"):
                yield Label("Chats", id="sidebar-title")
                yield ChatList(id="chats")
            with Vertical(id="chat-pane"):
                yield ChatView(id="chat")
                yield Static("", id="attached", markup=False)
                yield PromptInput(id="prompt")
        yield StatusBar(id="status")
        yield KeyHints(self.BINDINGS, self.app.BINDINGS, id="keys")

    async def on_mount(self):
        await self.refresh_sidebar()
        await self.chat_view.show([])
        self.prompt.focus()

    @property
    def chat_view(self) -> ChatView:
        return self.query_one(ChatView)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def store(self):
        return self.app.store

    def conversation(self) -> list[dict]:
        """The messages to send: the chat's system prompt, then the turns."""
        system = [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        return system + [sent(m) for m in self.history]

    def _save(self, write, what: str) -> bool:
        try:
            write()
            return True
        except sqlite3.Error as e:
            self.notify(f"Could not save {what}: {e}", severity="error", markup=False, timeout=10)
            return False

    # Sending and replying

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted):
        text = event.text.strip()
        if text == IMAGE_COMMAND or text.startswith(IMAGE_COMMAND + " "):
            if self.attach(text[len(IMAGE_COMMAND):].strip()):
                self.prompt.clear()
            return
        if not text and not self.attached:
            return
        if self.turn is not None:
            if not self.turn.stopping:
                self.notify("A reply is being written: Esc stops it.", severity="warning")
                return
            if self.chat is not None and self.turn.chat_id == self.chat.id:
                # A stopped reply is stored when its thread lets go, a token later at most: this
                # message goes after it.
                self._queued = text
                self.prompt.clear()
                return
        if await self._send(text):
            self.prompt.clear()

    async def _send(self, text: str) -> bool:
        """Store and show the user's message, and ask for a reply. False if it could not be saved."""
        if self.editing is not None:
            await self._drop_from(self.editing)
            self.editing = None
        if self.chat is None:
            title = text.splitlines()[0][:TITLE_LENGTH] if text else Path(self.attached[0].name).name
            model = self.app.model_ref or self.app.loading or ""
            try:
                self.chat = self.store.create_chat(title, model, self.settings)
            except sqlite3.Error as e:
                self.notify(f"Could not save the chat: {e}", severity="error", markup=False)
                return False
            await self.refresh_sidebar()
        message = Message(None, "user", text, images=self.attached)
        self.attached = []
        self._show_attached()
        chat_id = self.chat.id
        self._save(lambda: self.store.add_message(chat_id, message), "your message")
        self.history.append(message)
        await self.chat_view.add(message)
        self.want_reply = True
        await self.maybe_reply()
        return True

    async def maybe_reply(self):
        """Start the due reply if a model is ready and no other reply runs."""
        if not self.want_reply or self.turn is not None or self.chat is None:
            return
        session = self.app.session
        if session is None:
            if self.app.loading:
                self.notify("The reply starts as soon as the model is loaded.", timeout=3)
            else:
                self.notify("No model is loaded: press ctrl+o to pick one.", severity="warning")
            return
        self.want_reply = False
        chat_id = self.chat.id
        # Stored at once, empty and as this process's, then as it grows (from the worker).
        message = Message(None, "assistant", "", writer=self.store.writer)
        self._save(lambda: self.store.add_message(chat_id, message), "the reply")
        stream = self.store.reply_stream(message.id) if message.id is not None else None
        # The turn is set before the view is mounted: meanwhile, no other reply may start.
        self.turn = Turn(chat_id, MessageView(message))
        await self.chat_view.add(message, self.turn.view)
        self.turn.view.set_meta("…")
        self.status.set_state("generating")
        sampling = replace(self.settings.sampling, seed=self.app.seed)
        self.turn.worker = self._generate(self.turn, session, self.conversation(), sampling,
                                          self.settings.max_tokens, stream, self.settings.thinking)

    @work(thread=True, exclusive=True, group="generate", exit_on_error=False)
    def _generate(self, turn: Turn, session, messages, sampling, max_tokens: int, stream, thinking):
        run_turn(self.post_message, turn, session, messages, sampling, max_tokens, stream, thinking)

    async def on_turn_update(self, m: TurnUpdate):
        turn, stats = m.turn, m.stats
        turn.stats = stored_stats(stats, m.thinking_tokens)
        if m.thinking:
            turn.thinking += m.thinking
            if turn.view.is_attached:
                await turn.view.think(m.thinking, m.thinking_tokens)
        if m.text:
            turn.text += m.text
            if turn.view.is_attached:
                await turn.view.append(m.text)
        if stats.dropped and not turn.noticed and turn.view.is_attached:
            turn.noticed = True
            await self.chat_view.notice(
                f"The conversation no longer fits the context ({stats.ctx_size} tokens): the "
                f"{stats.dropped} oldest messages are left out of this reply (the system prompt is kept).",
                before=turn.view)
        if turn is self.turn:
            self.status.set_speed(stats.generation_tps)
            self.status.set_context(stats.ctx_used, stats.ctx_size)
            if not stats.finish_reason and not turn.stopping:
                turn.view.set_meta(
                    f"{stats.generation_tokens} tokens · {stats.generation_tps:.1f} tok/s…"
                    if stats.generation_tokens else
                    f"prefilling {stats.prefilled} tokens ({stats.reused} reused"
                    f"{f', {stats.from_disk} from disk' if stats.from_disk else ''})…")
        if stats.finish_reason:
            await self._end_turn(turn, stats.finish_reason)

    async def on_turn_failed(self, m: TurnFailed):
        e = m.error
        self.notify(f"The reply failed: {e}" if isinstance(e, Exception) and str(e) else repr(e),
                    severity="error", markup=False, timeout=15)
        await self._end_turn(m.turn, "error")

    async def _end_turn(self, turn: Turn, finish: str):
        if not turn.saved:
            turn.saved = True
            self._store_reply(turn, finish)
        if turn.view.is_attached:
            if not kept(turn.text, finish, turn.thinking):
                await turn.view.remove()
            else:
                await turn.view.finish(turn.stats, finish)
        if self.turn is turn:
            self.turn = None
            self.status.set_state("ready" if self.app.session else "no model")
        if self._queued is not None and self.turn is None:
            text, self._queued = self._queued, None
            await self._send(text)
        await self.maybe_reply()

    def _store_reply(self, turn: Turn, finish: str):
        """Keep a finished or stopped reply: in the database, and in the history if shown."""
        message, chat_id = turn.view.message, turn.chat_id
        if not kept(turn.text, finish, turn.thinking):
            if message.id is not None:
                self._save(lambda: self.store.delete_messages_from(chat_id, message.id), "the reply")
            return
        message.content, message.thinking = turn.text, turn.thinking
        message.finish, message.stats = finish, turn.stats
        if message.id is None:   # could not be stored when it started
            message.writer = None
            self._save(lambda: self.store.add_message(chat_id, message), "the reply")
        else:
            self._save(lambda: self.store.end_reply(message), "the reply")
        if self.chat is not None and chat_id == self.chat.id:
            self.history.append(message)

    def save_partial(self):
        """On quit: stop the reply and store what has arrived, now."""
        if self.turn is not None and not self.turn.saved:
            self.turn.stop()
            self.turn.saved = True
            self._store_reply(self.turn, "stopped")

    def action_stop(self):
        if self.turn is not None and not self.turn.stopping:
            self.turn.stop()
            self.turn.view.set_meta("stopping…")
        elif self.editing is not None:
            self._cancel_edit()
        elif self.want_reply:
            self.want_reply = False
            self.notify("No reply will be written to that message.", timeout=3)

    async def action_regenerate(self):
        if self.turn is not None:
            self.notify("Wait for the reply, or stop it with Esc.", severity="warning")
            return
        if not self.history:
            self.notify("Nothing to regenerate yet.", timeout=3)
            return
        if self.history[-1].role == "assistant":
            await self._drop_from(self.history[-1])
        self.want_reply = True
        await self.maybe_reply()

    # Images

    def action_attach_image(self):
        def done(path: str | None):
            if path:
                self.attach(path)
        self.app.push_screen(PathDialog("Attach an image", "The image file's path (PNG, JPEG, WebP, GIF, ...)"), done)

    def attach(self, path: str) -> bool:
        """Attach the image at `path` to the next message ("clear": drop those attached); False,
        with a notification saying why, if it cannot go with it."""
        if path == "clear":
            self.attached = []
            self._show_attached()
            return True
        if not path:
            self.notify(f"{IMAGE_COMMAND} PATH attaches an image to your next message; "
                        f"{IMAGE_COMMAND} clear drops those attached.", timeout=5)
            return False
        session = self.app.session
        if session is not None and session.model.vision is None:
            self.notify("This model reads no images: pick a vision-language model (ctrl+o) to ask about one.",
                        severity="warning")
            return False
        try:
            picture = open_image(Path(unquoted(path)).expanduser())
        except ImageError as e:
            self.notify(str(e), severity="error", markup=False)
            return False
        self.attached.append(picture)
        self._show_attached()
        return True

    def _show_attached(self):
        line = self.query_one("#attached", Static)
        line.update("Attached: " + ", ".join(image_line(p, self.app.session) for p in self.attached) +
                    f" (with your next message; {IMAGE_COMMAND} clear drops them)" if self.attached else "")
        line.display = bool(self.attached)

    def on_prompt_input_edit_last(self, _):
        self.action_edit_last()

    def action_edit_last(self):
        if self.turn is not None:
            self.notify("Wait for the reply, or stop it with Esc.", severity="warning")
            return
        last = next((m for m in reversed(self.history) if m.role == "user"), None)
        if last is None:
            self.notify("No message to edit yet.", timeout=3)
            return
        self._cancel_edit()
        self.editing = last
        for view in self.chat_view.views():
            view.set_class(view.message is last, "editing")
        self.prompt.text = last.content
        self.attached = list(last.images)   # sent again with the edited text
        self._show_attached()
        self.prompt.move_cursor(self.prompt.document.end)
        self.prompt.focus()
        self.notify("Editing your last message: Enter sends it again and replaces what followed, "
                    "Esc cancels.", timeout=5)

    def _cancel_edit(self):
        if self.editing is not None:
            self.editing = None
            self.prompt.clear()
            self.attached = []
            self._show_attached()
        for view in self.chat_view.views():
            view.remove_class("editing")

    async def _drop_from(self, message: Message):
        """Delete `message` and everything after it (regenerate, edit and resend)."""
        i = next(i for i, m in enumerate(self.history) if m is message)
        if message.id is not None and self.chat is not None:
            chat_id, message_id = self.chat.id, message.id
            self._save(lambda: self.store.delete_messages_from(chat_id, message_id), "the change")
        del self.history[i:]
        children = list(self.chat_view.children)
        first = next((k for k, w in enumerate(children)
                      if isinstance(w, MessageView) and w.message is message), len(children))
        for widget in children[first:]:
            await widget.remove()

    def action_toggle_thinking(self):
        view = self._last_reply()
        if view is None or not view.toggle_thinking():
            self.notify("The last reply has no thinking.", timeout=3)

    # Copying

    def _last_reply(self) -> MessageView | None:
        return next((v for v in reversed(self.chat_view.views()) if v.message.role == "assistant"), None)

    def action_copy_reply(self):
        view = self._last_reply()
        text = (self.turn.text if self.turn is not None and view is self.turn.view
                else view.message.content if view else "")
        if not text:
            self.notify("No reply to copy yet.", timeout=3)
            return
        self.app.copy_to_clipboard(text)
        self.notify("Reply copied.", timeout=2)

    def action_copy_code(self):
        """Copy the last code block of the last reply; pressed again, the one before, and so on."""
        view = self._last_reply()
        blocks = view.code_blocks() if view else []
        if not blocks:
            self.notify("The last reply has no code block.", timeout=3)
            return
        key = (id(view), len(blocks))
        i = self._code_index - 1 if self._code_key == key else len(blocks) - 1
        self._code_key, self._code_index = key, i % len(blocks)
        self.app.copy_to_clipboard(blocks[self._code_index])
        more = " (ctrl+f again: the one before)" if len(blocks) > 1 else ""
        self.notify(f"Code block {self._code_index + 1} of {len(blocks)} copied{more}.", timeout=3)

    # Chats: new, resume, rename, delete, settings

    async def refresh_sidebar(self):
        try:
            chats = self.store.chats()
        except sqlite3.Error as e:
            chats = []
            self.notify(f"Could not read the chats: {e}", severity="error", markup=False)
        await self.query_one(ChatList).show(chats, self.chat.id if self.chat else None)

    def _leave_chat(self):
        if self.turn is not None:
            self.turn.stop()    # the reply is kept in its chat when the worker stops
        self.want_reply = False
        if self._queued is not None:   # not sent yet: back in the box, to send in the next chat
            self.prompt.text, self._queued = self._queued, None
        self._cancel_edit()

    def set_defaults(self, defaults: ChatSettings):
        """New chats' settings (a model was loaded). The chat on screen takes them too if nothing
        has answered it yet and its settings are the old defaults (it was sent while loading)."""
        old, self.defaults = self.defaults, defaults
        if self.settings != old or any(m.role == "assistant" for m in self.history):
            return
        self.settings = defaults
        if self.chat is not None:
            chat = self.chat
            chat.settings = defaults
            self._save(lambda: self.store.update_settings(chat.id, defaults), "the settings")

    async def action_new_chat(self):
        self._leave_chat()
        self.chat, self.settings, self.history = None, self.defaults, []
        await self.chat_view.show([])
        await self.refresh_sidebar()
        self.update_context()
        self.prompt.focus()

    async def on_chat_list_open(self, event: ChatList.Open):
        await self.open_chat(event.chat_id)

    async def open_chat(self, chat_id: int):
        if self.chat is not None and self.chat.id == chat_id:
            self.prompt.focus()
            return
        try:
            chat, history = self.store.chat(chat_id), self.store.messages(chat_id)
        except sqlite3.Error as e:
            self.notify(f"Could not read the chat: {e}", severity="error", markup=False)
            return
        if chat is None:
            return
        self._leave_chat()
        self.chat, self.settings, self.history = chat, chat.settings, history
        await self.chat_view.show(history)
        await self.refresh_sidebar()
        self.update_context()
        self.prompt.focus()

    def update_context(self):
        """The status bar's context figure for the conversation on screen."""
        session = self.app.session
        if session is not None:
            try:
                used = session.count(self.conversation(), self.settings.thinking)
            except Exception:   # a template that refuses this conversation: say so when sending
                used = 0
            self.status.set_context(used, session.ctx_size)

    def action_rename_chat(self):
        if self.chat is None:
            self.notify("Send a message first: a new chat is saved with it.", timeout=3)
            return
        chat = self.chat

        async def done(title: str | None):
            if title and self._save(lambda: self.store.rename_chat(chat.id, title), "the title"):
                chat.title = title
                await self.refresh_sidebar()
        self.app.push_screen(RenameDialog(chat.title), done)

    def on_chat_list_delete(self, event: ChatList.Delete):
        self.delete_chat(event.chat_id)

    def action_delete_chat(self):
        if self.chat is None:
            self.notify("This chat is not saved yet: nothing to delete.", timeout=3)
            return
        self.delete_chat(self.chat.id)

    def delete_chat(self, chat_id: int):
        chat = self.store.chat(chat_id)
        if chat is None:
            return

        async def done(yes: bool):
            if not yes:
                return
            if self.turn is not None and self.turn.chat_id == chat_id:
                self.turn.saved = True    # nothing to store into a deleted chat
                self.turn.stop()
            if self._save(lambda: self.store.delete_chat(chat_id), "the deletion"):
                if self.chat is not None and self.chat.id == chat_id:
                    await self.action_new_chat()
                else:
                    await self.refresh_sidebar()
                self.notify(f"Deleted “{chat.title}”.", markup=False, timeout=3)
        self.app.push_screen(ConfirmDialog(f"Delete “{chat.title}” and all its messages?"), done)

    def action_settings(self):
        title = self.chat.title if self.chat else "the new chat"

        def done(settings: ChatSettings | None):
            if settings is None:
                return
            self.settings = settings
            if self.chat is not None:
                chat = self.chat
                chat.settings = settings
                self._save(lambda: self.store.update_settings(chat.id, settings), "the settings")
            self.update_context()
            self.notify("Settings saved.", timeout=2)
        self.app.push_screen(SettingsScreen(self.settings, title), done)
