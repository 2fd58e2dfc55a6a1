"""`nibble chat`: the Textual app. It owns the history database and the model; the chat screen
owns the conversation.

The model loads in a background thread (importing Numba, reading the weights, warming the kernels
up) while the window already takes keys; a message sent meanwhile is answered once it is ready.
"""
from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from textual.app import App
from textual.binding import Binding
from textual.message import Message

from nibble.formats.hub import DEFAULT_MODEL
from nibble.runner.text.reasoning import ThinkingOptions
from nibble.runner.settings import DEFAULT_DRAFT, MAX_TOKENS, SamplerSettings

from .screens.chat import ChatScreen
from .screens.keys import KeysScreen, key_rows
from .screens.models import ModelPicker
from .store import ChatSettings, Store

LOAD_STEPS = 3
# Chats whose KV blocks the app's pool holds at once (contexts' worth): switching back to one of
# the last few chats prefills only its new message.
POOL_CONTEXTS = 4


@dataclass
class LoadProgress(Message):
    ref: str
    step: int
    text: str


@dataclass
class ModelLoaded(Message):
    ref: str
    session: object   # runner.generation.session.ChatSession
    seconds: float


@dataclass
class LoadNote(Message):
    text: str   # what became of the GPU layers, what of the model's sampling defaults was ignored


@dataclass
class LoadFailed(Message):
    ref: str
    error: str


def model_label(ref: str, config, quant: str | None) -> str:
    """"name · quantization" for the status bar, e.g. "smollm2 · f32" or "SmolLM2-q4 · int4"."""
    name = Path(ref).name if Path(ref).expanduser().exists() else ref
    q = config.quantization
    bits = f"int{q['bits']}" if q and "bits" in q else quant or "f32"
    return f"{name} · {bits}"


class ChatApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "nibble chat"
    ENABLE_COMMAND_PALETTE = False   # F1 lists the keys; the footer stays short
    BINDINGS = [
        Binding("ctrl+o", "pick_model", "Model", tooltip="Pick a model"),
        Binding("f1", "show_keys", "Keys", tooltip="Show every key"),
        Binding("ctrl+q", "quit", "Quit", priority=True, tooltip="Quit (a reply being written is kept)"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True,
                tooltip="Quit (a reply being written is kept)"),
    ]

    def __init__(self, model: str | None = DEFAULT_MODEL, *, quant: str | None = None, ctx_size: int = 4096,
                 kv_cache: str = "f32", kv_disk: int = 0, threads: int | None = None, seed: int | None = None,
                 system: str = "", sampling: dict | None = None, max_tokens: int = MAX_TOKENS,
                 store_path: Path | None = None, load: Callable | None = None, gpu_layers: int = 0,
                 require_gpu: bool = False, draft: int = DEFAULT_DRAFT, draft_model: str | None = None,
                 loras: tuple = (),
                 thinking: ThinkingOptions = ThinkingOptions(), note: str = ""):
        """`model` is loaded at start (None: none until one is picked with ctrl+o).
        New chats get `system`, `max_tokens` and the loaded model's sampling defaults with
        `sampling` ({SamplerSettings field: value}, the command line's flags) laid over them.
        `draft`: the most tokens a decode pass guesses ahead (0: none; runner/generation/draft.py),
        by `draft_model` (a reference; None: prompt lookup) where its vocabulary is the model's.
        `kv_disk`: bytes for the KV blocks kept on disk (0: none; runner/kv/disk.py), so that a
        chat reopened after a restart goes on without prefilling what it held.
        `thinking`: what is asked of a model that thinks (--think, --reasoning-budget), in every
        chat whose settings do not say otherwise.
        `load(ref, quant) -> (model, tokenizer)` replaces runner.loader.load (tests share one
        loaded model this way). `note`: a line shown at start (which model runs instead of the
        default, and why)."""
        super().__init__()
        self.requested_model = model
        self.quant, self.ctx_size, self.kv_cache, self.kv_disk = quant, ctx_size, kv_cache, kv_disk
        self.threads, self.seed = threads, seed
        self.gpu_layers, self.require_gpu = gpu_layers, require_gpu
        self.draft, self.draft_model = draft, draft_model
        self.loras = loras   # adapters (formats/lora.py) beside the model -m named, unmerged
        self.thinking = thinking
        self.note = note
        self.system, self.sampling, self.max_tokens = system, dict(sampling or {}), max_tokens
        self.defaults = self.new_chat_settings(SamplerSettings())   # until a model is loaded
        self.store_path = store_path
        self._load_fn = load
        self.store: Store | None = None
        self.session = None                 # runner.generation.session.ChatSession once a model is loaded
        self.model_ref: str | None = None   # the loaded model
        self.loading: str | None = None     # the model being loaded

    async def on_mount(self):
        self.store, warning = Store.open(self.store_path)
        self.chat_screen = ChatScreen(self.defaults)
        await self.push_screen(self.chat_screen)
        if warning:
            self.notify(warning, title="History", severity="warning", markup=False, timeout=20)
        if self.note:
            self.notify(self.note.removeprefix("nibble: "), title="Model", markup=False, timeout=30)
        if self.requested_model:
            self.load_model(self.requested_model)
        else:
            self.chat_screen.status.set_state("no model: ctrl+o picks one")

    def on_unmount(self):
        if self.store is not None:
            self.store.close()

    def new_chat_settings(self, model_sampling: SamplerSettings) -> ChatSettings:
        """New chats' settings on a model with these sampling defaults."""
        return ChatSettings(self.system, replace(model_sampling, **self.sampling), self.max_tokens)

    # The model

    def load_model(self, ref: str):
        """Load `ref` in the background; the current model is let go at once."""
        if self.chat_screen.turn is not None:
            self.chat_screen.turn.stop()   # the reply so far is kept
        self.session, self.model_ref, self.loading = None, None, ref
        self.chat_screen.status.set_model(ref)
        self.chat_screen.status.set_speed(None)
        self.chat_screen.status.set_state("loading: starting", (0, LOAD_STEPS))
        self._load(ref)

    def _load(self, ref: str):
        # A daemon thread rather than a Textual worker: those run in asyncio's executor, whose
        # threads the interpreter waits for on exit, and a load cannot be interrupted. Quitting
        # while a model loads (or downloads) must not wait for it.
        threading.Thread(target=self._load_thread, args=(ref,), name=f"load {ref}", daemon=True).start()

    def _post(self, message: Message):
        try:
            self.post_message(message)
        except RuntimeError:   # the app has closed its event loop: nobody is listening
            pass

    def _load_thread(self, ref: str):
        start = time.perf_counter()
        try:
            self._post(LoadProgress(ref, 0, "starting the runner"))
            # Imported here: Numba's import alone takes a second, and must not hold up the window.
            from nibble.formats import progress
            from nibble.runner.generation.session import ChatSession
            load = self._load_fn
            if load is None:   # the full kernels compile in the background on a first run
                from nibble.runner.loader import load
                load = functools.partial(load, background=True)
            self._post(LoadProgress(ref, 1, "reading the model"))
            gpu = (dict(gpu_layers=self.gpu_layers, require_gpu=self.require_gpu, ctx_size=self.ctx_size)
                   if self.gpu_layers else {})
            if self.loras and ref == self.requested_model:   # the adapters are the model -m named's
                gpu["loras"] = self.loras
            # what importing a GGUF and compiling the kernels say of their progress, in the status bar
            step = 1
            with progress.shown_by(lambda text: self._post(LoadProgress(ref, step, text))):
                model, tokenizer = load(ref, self.quant, **gpu)
                for note in (getattr(model, "offload_note", ""), tokenizer.sampling_note):
                    if note:
                        self._post(LoadNote(note))
                tokenizer.chat_template   # a broken template is a load error, not a first-reply one
                step = 2
                self._post(LoadProgress(ref, step, "preparing the kernels"))
                drafts = None
                if self.draft_model and self.draft:
                    from nibble.runner.loader import load_draft
                    drafts = load_draft(self.draft_model, self.quant, tokenizer, self.ctx_size)
                    drafts.model.threads.pin(self.threads)
                session = ChatSession(model, tokenizer, ctx=self.ctx_size, kv_type=self.kv_cache,
                                      threads=self.threads, pool=self._pool(model), draft=self.draft,
                                      thinking=self.thinking, draft_model=drafts)
                session.warm_up()
        except Exception as e:   # any failure becomes a notification; the app stays usable
            from nibble.formats.errors import NibbleError
            self._post(LoadFailed(ref, str(e) if isinstance(e, NibbleError) else f"{type(e).__name__}: {e}"))
            return
        self._post(ModelLoaded(ref, session, time.perf_counter() - start))

    def _pool(self, model):
        """The app's one pool of KV blocks, shared by its chats (None with GPU layers, whose
        cache is their own)."""
        if model.gpu_stage is not None:
            return None
        from nibble.runner.kv.blocks import BlockPool
        from nibble.runner.kv.cache import blocks_for
        from nibble.runner.kv.disk import open_disk
        ctx = min(self.ctx_size, model.config.max_position_embeddings)
        kv = model.new_pool(POOL_CONTEXTS * blocks_for(ctx), self.kv_cache)
        return BlockPool(kv, open_disk(model.source, kv, self.kv_disk))

    def on_load_progress(self, m: LoadProgress):
        if m.ref == self.loading:
            self.chat_screen.status.set_state(f"loading: {m.text}", (m.step, LOAD_STEPS))

    async def on_model_loaded(self, m: ModelLoaded):
        if m.ref != self.loading:
            return   # another model was picked meanwhile
        self.session, self.model_ref, self.loading = m.session, m.ref, None
        self.defaults = self.new_chat_settings(m.session.tokenizer.sampling)
        self.chat_screen.set_defaults(self.defaults)
        status = self.chat_screen.status
        status.set_model(model_label(m.ref, m.session.model.config, self.quant))
        status.set_state("ready")
        self.chat_screen.update_context()
        await self.chat_screen.maybe_reply()

    def on_load_note(self, m: LoadNote):
        self.notify(m.text, title="Model", markup=False, timeout=10)

    def on_load_failed(self, m: LoadFailed):
        if m.ref != self.loading:
            return
        self.loading = None
        self.chat_screen.status.set_model("no model")
        self.chat_screen.status.set_state("ctrl+o picks a model")
        self.notify(f"Could not load {m.ref}: {m.error}\nPress ctrl+o to pick another model.",
                    title="Model", severity="error", markup=False, timeout=30)

    def action_pick_model(self):
        if isinstance(self.screen, ModelPicker):
            return

        def done(ref: str | None):
            if ref:
                self.load_model(ref)
        self.push_screen(ModelPicker(self.model_ref or self.loading), done)

    # Keys and quitting

    def action_show_keys(self):
        if not isinstance(self.screen, KeysScreen):
            self.push_screen(KeysScreen(key_rows(ChatScreen.BINDINGS, self.BINDINGS)))

    async def action_quit(self):
        """Quit at any time: a reply being written is stopped and kept as it is."""
        if self.store is not None:
            self.chat_screen.save_partial()
        self.exit()
