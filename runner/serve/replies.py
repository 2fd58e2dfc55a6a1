"""Between the wire and the engine, for every API: a parsed body (each API's reads into api's
ChatBody) becomes the engine's Request (the prompt through the chat template with its tools and
thinking, the sampling over the model's defaults, a grammar for a response format or a forced tool
call), and the engine's events become the reply's parts (Thinking, Content, whole Calls), which
each API writes in its own shape."""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass, replace

from nibble.formats.catalog import Details
from nibble.formats.errors import NibbleError
from ..text.template import ChatTemplateError
from ..generation.decoding import Event, Request
from ..embedding.engine import EmbedEngine
from ..embedding.rerank import Reranker
from ..generation.engine import Engine
from ..text.fim import fim_tokens, infill_ids
from ..text.grammar import Grammar, GrammarError
from ..kv.prompt_ids import PromptMemo
from ..text.tokenizer import Tokenizer
from ..text.reasoning import ReasoningSplit, Thinking, ThinkingOptions, chat_prompt, reasoning_family
from ..text.tools import Call, Content, MessageError, ToolCallParser, forced_call_grammar, prepare_messages, tool_family
from ..vision.base import for_template, with_images
from .api import ChatBody, CompletionBody, Options, tool_call
from .errors import ApiError


@dataclass
class Served:
    """The model a server runs, and what its routes need of it."""
    engine: Engine
    tokenizer: Tokenizer
    name: str                  # the model's name in requests and /v1/models (from -m)
    created: int               # when the server started: /v1/models' "created"
    details: Details | None = None   # what the model is, for /api/ps
    thinking: ThinkingOptions = ThinkingOptions()  # the server's thinking defaults (--think, --reasoning-budget)
    draft: int = 0             # --draft: the most tokens a pass guesses ahead while a reply decodes alone

    def __post_init__(self):
        try:
            self.family = tool_family(self.tokenizer.tool_template.source)
            self.reasoning = reasoning_family(self.tokenizer.chat_template.source)
        except ChatTemplateError:   # no chat template: /v1/completions still works
            self.family, self.reasoning = "generic", None
        self.memo, self._memo_lock = PromptMemo(self.tokenizer), threading.Lock()
        self.size = weights_nbytes(self.engine.model)   # for /api/ps
        self.fim = fim_tokens(self.tokenizer.tokenizer)   # a coder model's fill-in-the-middle tokens, or None

    def encode(self, text: str, images: frozenset[str] = frozenset()) -> list[int]:
        """A prompt's ids, starting with those of the longest prompt or prompt and reply seen
        before that it extends (a conversation's earlier turns): the ids the pool holds, so that
        only the rest runs. `images`: the digests of its images (vision.base.with_images)."""
        with self._memo_lock:   # handlers encode on the thread pool
            ids = self.memo.encode(text, images)
            self.memo.remember(text, ids)
        return ids

    def remember(self, turn: Turn, reply: str, reply_ids: list[int]):
        """After a reply: its prompt and text are spelled by its prompt's ids and the ids sampled,
        which a next turn that repeats them finds in the pool (its text tokenized afresh may
        differ). Not when the ids say more than the text (a stop string cut it)."""
        if turn.text is not None and self.tokenizer.decode(reply_ids) == reply:
            with self._memo_lock:
                self.memo.remember(turn.text + reply, turn.request.prompt_ids + reply_ids)


@dataclass
class Embedding:
    """An embedding model or a reranker a server runs (an EmbedEngine's), and what its routes need of it."""
    engine: EmbedEngine
    name: str
    created: int
    details: Details | None = None

    def __post_init__(self):
        self.embedder = self.engine.embedder   # an Embedder, or a Reranker
        self.ranks = isinstance(self.embedder, Reranker)
        self.size = self.embedder.encoder.nbytes   # for /api/ps


def generating(served: Served | Embedding) -> Served:
    """`served`, a model that generates text; a 400 for an embedding model or a reranker."""
    if isinstance(served, Embedding):
        route = ("is a reranker, which generates no text: POST /v1/rerank scores documents with it" if served.ranks
                 else "is an embedding model, which generates no text: POST /v1/embeddings (or ollama's /api/embed) "
                      "computes its vectors")
        raise ApiError(400, f"{served.name} {route}", "model", code="model_not_supported")
    return served


def weights_nbytes(model) -> int:
    """Bytes of a model's weights, each counted once (a tied head is the embedding)."""
    weights = [model.embed, model.norm, model.lm_head, *(w for layer in model.layers for w in layer)]
    return sum({id(w): w.nbytes for w in weights}.values())


@dataclass
class Turn:
    """What a request becomes: the engine's Request, and what the server keeps to read its reply."""
    request: Request
    text: str | None                   # the prompt as text (the memo's key); None: ids no text spells (FIM's)
    tool_names: tuple[str, ...] = ()   # the tools whose calls are parsed out of the reply (none: plain text)


def chat_turn(served: Served, body: ChatBody) -> Turn:
    """The engine request for a chat body: ApiError (400) for what the model cannot take."""
    tools = body.tools if body.tool_choice != "none" else []
    text, split, images = chat_text(served, body)
    if tools and body.tool_choice == "required":
        grammar = _grammar(lambda: forced_call_grammar(served.family, tools, body.tool_name,
                                                               body.parallel_tool_calls), "tools")
    elif body.response_format == "json_schema":
        grammar = _grammar(lambda: Grammar.json_schema(body.schema), "response_format.json_schema.schema")
    elif body.response_format == "json_object":
        grammar = Grammar.json_object()
    else:
        grammar = None
    request = replace(_request(served, served.encode(text, images), body.options, "messages", grammar), reasoning=split)
    if tools or split:   # the markers may be special tokens, which plain decoding drops
        request = replace(request, skip_special=False)
    return Turn(request, text, tuple(t["function"]["name"] for t in tools))


def chat_text(served: Served, body: ChatBody) -> tuple[str, ReasoningSplit | None, frozenset[str]]:
    """A chat body's prompt text, through the template with its tools and thinking, its images'
    tags placed; its reply's split (None: the model does not think); the digests of its images
    (Tokenizer.encode's). ApiError (400) for what the template refuses."""
    reads_images(served, body.messages)
    vision = served.engine.model.vision
    tools = body.tools if body.tool_choice != "none" else []
    forced = bool(tools and body.tool_choice == "required") or body.response_format != "text"
    try:   # a generic template gets the tools in a system message, and no `tools`
        messages, template_tools = prepare_messages(body.messages, tools or None, served.family)
        messages, pictures = for_template(vision, messages)
        text, split = chat_prompt(served.tokenizer, messages, body.thinking.over(served.thinking), template_tools, forced)
        text, images = with_images(vision, text, pictures)
        return text, split, images
    except MessageError as e:
        raise ApiError(400, str(e), "messages") from None
    except ChatTemplateError as e:
        raise ApiError(400, _server_words(str(e)), "messages") from None
    except NibbleError as e:   # the template wrote its image markers otherwise than the images
        raise ApiError(400, str(e), "messages") from None


def reads_images(served: Served, messages: list[dict]):
    """A 400 for a conversation with an image (api.ChatBody's image parts) when the model has no
    vision tower, naming the first image."""
    if served.engine.model.vision is not None:
        return
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            if part.get("type") == "image":
                name = part["image"].name
                raise ApiError(400, f"{served.name} reads no images: {name} is one; send text only, or ask a "
                                    "model that reads images", name, code="model_not_supported")


def completion_turn(served: Served, body: CompletionBody) -> Turn:
    """A completion of `prompt`, or with a `suffix`, of the middle between them (fill_turn)."""
    if body.suffix is not None:
        return fill_turn(served, body.prompt, body.suffix, (), "", body.options, "suffix")
    return Turn(_request(served, served.encode(body.prompt), body.options, "prompt"), body.prompt)


def fill_turn(served: Served, prefix: str, suffix: str, extra, typed: str, options: Options, param: str) -> Turn:
    """Fill-in-the-middle (runner/text/fim.py): the text between `prefix` (and what is `typed`
    after it) and `suffix`, other files' (name, text) chunks before them; a 400 naming `param`
    for a model without FIM tokens. The reply ends at the model's end of text or its FIM pad or
    file separator, as llama.cpp's does."""
    fim = served.fim
    if fim is None:
        raise ApiError(400, f"{served.name} has no fill-in-the-middle tokens (<|fim_prefix|>, <fim_prefix>, <PRE> "
                            "...): choose a coder model trained for it (Qwen2.5-Coder, StarCoder2, CodeLlama)", param)
    tokenizer = served.tokenizer
    ids = infill_ids(lambda text: tokenizer.encode(text, add_bos=False), fim, prefix, suffix, list(extra), typed,
                     served.engine.ctx, options.max_tokens,
                     tokenizer.bos_id if tokenizer.config.get("add_bos_token") else None)
    request = _request(served, ids, replace(options, stop=options.stop + fim.ends), "input_prefix and input_suffix")
    return Turn(replace(request, skip_special=False), None)   # its end tokens' text meets the stops


def _request(served: Served, ids: list[int], options: Options, what: str, grammar: Grammar | None = None) -> Request:
    ctx = served.engine.ctx
    asked = options.max_tokens
    if len(ids) >= ctx or (asked is not None and len(ids) + asked > ctx):
        also = f" and max_tokens asks for {asked}" if asked is not None else ""
        raise ApiError(400, f"this model's context is {ctx} tokens; the {what} take {len(ids)}{also}: "
                            "shorten them or ask for fewer tokens", what, code="context_length_exceeded")
    settings = replace(served.tokenizer.sampling, **options.sampling)
    constraint = grammar.constraint(served.tokenizer) if grammar else None
    return Request(ids, settings, asked if asked is not None else ctx - len(ids), options.stop,
                   constraint=constraint, logprobs=options.logprobs, draft=served.draft,
                   adapters=adapter_scales(served, options.lora))


def adapter_scales(served: Served, lora: tuple[tuple[int, float], ...]) -> tuple[float, ...] | None:
    """A request's `lora` as llama.cpp reads it: the adapters it names at its scales, every other
    one off; none named: the server's scales (None). A 400 for an adapter the model has not loaded."""
    if not lora:
        return None
    loaded = len(served.engine.model.adapters)
    if not loaded:
        raise ApiError(400, f"lora: {served.name} runs no LoRA adapters (nibble serve --lora PATH loads them)", "lora")
    return tuple(named_scales(loaded, lora, "lora: "))


def named_scales(loaded: int, lora, prefix: str = "") -> list[float]:
    """The scales of `loaded` adapters that (id, scale) pairs give: those named at theirs, the
    others 0 (llama.cpp's construct_lora_list); a 400 for an id no adapter has."""
    scales = [0.0] * loaded
    for i, scale in lora:
        if i >= loaded:
            raise ApiError(400, f"{prefix}no adapter has id {i}; GET /lora-adapters lists the {loaded} loaded",
                           prefix.rstrip(": ") or "id")
        scales[i] = scale
    return scales


def _grammar(compile, param: str) -> Grammar:
    """A grammar compiled from the body's schemas: what llguidance refuses is a 400 naming it."""
    try:
        return compile()
    except GrammarError as e:
        raise ApiError(400, f"{param}: {e}", param) from None


def _server_words(message: str) -> str:
    """A chat template's error without its hint for the command line (--raw), with the server's."""
    message = re.sub(r"[;,.]?\s*(or )?[Pp]ass --raw.*$", "", message)
    return f"{message}; /v1/completions takes a prompt as it is, without the template"


class ReplyParts:
    """Engine events -> the reply's parts: Thinking, then Content, and with tools whole Calls
    parsed out of the text as they complete."""

    def __init__(self, tool_names: tuple[str, ...], family: str):
        self.parser = ToolCallParser(family, tool_names) if tool_names else None

    def feed(self, event: Event) -> list[Thinking | Content | Call]:
        """The parts of one event; the last event's include what the parser still held."""
        out = [Thinking(event.thinking)] if event.thinking else []
        if self.parser is None:
            return out + ([Content(event.text)] if event.text else [])
        items = self.parser.feed(event.text) if event.text else []
        if event.finish_reason:
            items += self.parser.finish()
        return out + [item for item in items if isinstance(item, Call) or item.text]

    def finish_reason(self, reason: str) -> str:
        """"tool_calls" when a call parsed and the reply ended on its own."""
        return "tool_calls" if self.parser and self.parser.calls and reason == "stop" else reason


def chat_delta(part: Thinking | Content | Call) -> dict:
    """A part as OpenAI chat's delta: thinking as llama-server's `reasoning_content` and as LM
    Studio's and mlx-lm's `reasoning`."""
    if isinstance(part, Call):
        return {"tool_calls": [tool_call(part.index, part.id, part.name, part.arguments)]}
    if isinstance(part, Thinking):
        return {"reasoning_content": part.text, "reasoning": part.text}
    return {"content": part.text}
