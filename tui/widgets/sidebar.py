"""The sidebar: past chats, newest first; Enter (or a click) resumes one."""
from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message
from textual.widgets import Label, ListItem, ListView

from ..store import Chat


class ChatItem(ListItem):
    def __init__(self, chat: Chat):
        super().__init__(Label(chat.title, markup=False, shrink=True), id=f"chat-{chat.id}")
        self.chat = chat


class ChatList(ListView):
    """Past chats; posts Open when one is chosen."""

    BINDINGS = [("delete", "delete", "Delete chat")]

    @dataclass
    class Open(Message):
        chat_id: int

    @dataclass
    class Delete(Message):
        chat_id: int

    async def show(self, chats: list[Chat], current: int | None):
        await self.clear()
        await self.extend([ChatItem(c) for c in chats])
        ids = [c.id for c in chats]
        self.index = ids.index(current) if current in ids else None

    def on_focus(self):
        if self.index is None and self.children:
            self.index = 0   # Tab into the list: Enter then opens the newest chat

    def action_select_cursor(self):
        if self.index is None and self.children:
            self.index = 0   # Enter right after Tab, before the focus event was handled
        super().action_select_cursor()

    def on_list_view_selected(self, event: ListView.Selected):
        event.stop()
        if isinstance(event.item, ChatItem):
            self.post_message(self.Open(event.item.chat.id))

    def action_delete(self):
        if isinstance(self.highlighted_child, ChatItem):
            self.post_message(self.Delete(self.highlighted_child.chat.id))
