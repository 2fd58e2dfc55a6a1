"""The `nibble` command line: thin click commands over the library."""
from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import importlib
import json
import os
import sys
from dataclasses import replace

import click

from nibble.formats.errors import NibbleError, one_line
from nibble.formats.hub import DEFAULT_MODEL, FALLBACK_MODEL

from .embed import embed
from .models import ls, ps, pull, rm
from .presets import create, show
from .rerank import rerank
from nibble.runner.serve import DEFAULT_HOST, DEFAULT_PORT
from nibble.runner.settings import DEFAULT_DRAFT, MAX_TOKENS, SamplerSettings

# At exit, Python's last collection walks every object that imports and a model made (numba's
# types, the kernels' libraries): ~0.25 s after the reply. Frozen, it skips them; they die with
# the process. (Registered before the library's exit handlers, it runs after them.)
atexit.register(gc.freeze)

DEFAULT_CTX = 4096   # -c when not given (or the model's context, if smaller)


class _Group(click.Group):
    """Every error as one line on stderr: the library's (exit code 1) and click's usage errors
    (exit code 2), which click itself prints as three lines (usage, hint, error)."""

    def make_context(self, info_name, args, parent=None, **extra):
        with _one_line_errors():   # nibble's own options: --bogus, --version=x
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx):
        with _one_line_errors():
            try:
                return super().invoke(ctx)
            except NibbleError as e:
                raise click.ClickException(str(e)) from None
            except OSError as e:
                raise click.ClickException(f"{e.strerror or e}: {e.filename}" if e.filename else str(e)) from None
            except KeyboardInterrupt:   # Ctrl-C outside generation (loading, importing): no traceback
                click.echo("\ninterrupted", err=True)
                sys.exit(130)


class _OneLineError(click.ClickException):
    """"Error: <message>" alone, with the exit code of the error it stands for."""

    def __init__(self, e: click.ClickException):
        super().__init__(one_line(e.format_message()))
        self.exit_code = e.exit_code


@contextlib.contextmanager
def _one_line_errors():
    try:
        yield
    except _OneLineError:
        raise
    except click.ClickException as e:
        raise _OneLineError(e) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="nibble")
def main():
    """nibble: run quantized language models on your own computer."""
    if os.environ.get("NIBBLE_CPU"):   # a bad value: one line before anything loads (numba: only when set)
        from nibble.quant import target
        target.choice()


def model_option(f):
    f = click.option("--float", "quant", flag_value="float",
                     help="Run a float model as stored, even one of more than 1B weights.")(f)
    f = click.option("--quant", type=click.Choice(["int8", "int4"]),
                     help="Quantize a float model, once (kept in nibble's cache) [default: int4 for a "
                          "float model of more than 1B weights].")(f)
    return click.option("-m", "--model", envvar="NIBBLE_MODEL", show_default=f"{DEFAULT_MODEL}; offline, {FALLBACK_MODEL}",
                        help="A model directory, .gguf or .safetensors file, hub id (org/name) or alias.")(f)


def _default_model(model: str | None) -> tuple[str, str]:
    """-m's model, or the default one (downloaded once; offline, the fallback), and the line that
    says which ran instead of the default ("" if none)."""
    if model is not None:
        return model, ""
    from nibble.formats.hub import default_model
    return default_model()


def _model_or_default(model: str | None) -> str:
    """_default_model's model, its line on stderr."""
    model, note = _default_model(model)
    _say(note)
    return model


threads_option = click.option("-t", "--threads", type=click.IntRange(min=1),
                              help="CPU threads, at most the cores' [default: all cores, fewer while other "
                                   "programs keep some busy (measured as it runs)].")
kv_cache_option = click.option("--kv-cache", default="f32", show_default=True, type=click.Choice(["f32", "int8"]),
                               help="KV cache precision: int8 keeps a quarter of the memory.")


class ParsedValue(click.ParamType):
    """A value that nibble's function `parse` ("module:function", imported when first used) reads;
    the NibbleError of a wrong one a usage error."""

    def __init__(self, name: str, parse: str):
        self.name, self.parse = name, parse

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        module, function = self.parse.split(":")
        parse = getattr(importlib.import_module(module), function)
        try:
            return parse(value)
        except NibbleError as e:
            self.fail(str(e), param, ctx)


kv_disk_option = click.option("--kv-disk", default="8G", show_default=True, type=ParsedValue("size", "nibble.runner.kv.disk:parse_size"),
                              envvar="NIBBLE_KV_DISK",
                              help="Disk kept for KV cache blocks, every model's together (in nibble's cache "
                                   "folder): a prompt's prefix seen before, even before a restart, is read "
                                   "back instead of prefilled. 0: none.")


def sampling_options(f):
    """--temp, --top-k, --top-p, --min-p, the penalties, the --dry-* flags and --seed, handed to the
    command as one `sampling` dict: the flags given, by SamplerSettings' names, to lay over the
    model's defaults (tokenizer.sampling). They are checked before the model loads: a bad value is
    one line."""
    d = SamplerSettings()

    def default(value) -> str:
        return f"[default: the model's generation_config.json, else {value}]"
    options = [
        click.option("--temp", "temperature", type=float, help=f"Temperature; 0 is greedy {default(d.temperature)}."),
        click.option("--top-k", "top_k", type=int, help=f"Keep the k likeliest tokens; 0 is off {default(d.top_k)}."),
        click.option("--top-p", "top_p", type=float, help=f"Nucleus sampling; 1 is off {default(d.top_p)}."),
        click.option("--min-p", "min_p", type=float,
                     help=f"Drop tokens below min-p times the likeliest; 0 is off {default(d.min_p)}."),
        click.option("--repeat-penalty", "repetition_penalty", type=float,
                     help=f"Penalise the last {d.repeat_last_n} tokens; 1 is off {default(d.repetition_penalty)}."),
        click.option("--presence-penalty", "presence_penalty", type=float,
                     help=f"Subtract this from the logit of a token the reply holds already; 0 is off "
                          f"{default(d.presence_penalty)}."),
        click.option("--frequency-penalty", "frequency_penalty", type=float,
                     help=f"Subtract this times how often the reply holds a token from its logit; 0 is off "
                          f"{default(d.frequency_penalty)}."),
        click.option("--dry-multiplier", "dry_multiplier", type=float,
                     help="DRY (don't repeat yourself): a token that would extend a repeat of n tokens "
                          "of the text so far loses this times --dry-base ** (n - --dry-allowed-length) "
                          f"from its logit; 0 is off [default: {d.dry_multiplier}]."),
        click.option("--dry-base", "dry_base", type=float, help=f"DRY's base [default: {d.dry_base}]."),
        click.option("--dry-allowed-length", "dry_allowed_length", type=int,
                     help=f"Repeats of up to this many tokens escape DRY [default: {d.dry_allowed_length}]."),
        click.option("--dry-penalty-last-n", "dry_penalty_last_n", type=int,
                     help=f"How many recent tokens DRY looks at; -1 is all of them "
                          f"[default: {d.dry_penalty_last_n}]."),
        click.option("--seed", "seed", type=click.IntRange(min=0), help="Seed for reproducible sampling."),
    ]
    names = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
             "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "seed")

    @functools.wraps(f)
    def command(**kwargs):
        given = {name: value for name in names if (value := kwargs.pop(name)) is not None}
        SamplerSettings(**given)   # raises NibbleError for a bad value, before the model loads
        return f(sampling=given, **kwargs)
    return functools.reduce(lambda g, option: option(g), reversed(options), command)


def generation_options(f):
    """The sampling and runtime flags shared by `run` and `chat`."""
    options = [
        click.option("-n", "--max-tokens", default=MAX_TOKENS, show_default=True, type=click.IntRange(min=1),
                     help="Most tokens to generate."),
        sampling_options,
        threads_option,
        click.option("-c", "--ctx-size", type=click.IntRange(min=1),
                     help=f"Context size in tokens, at most the model's [default: {DEFAULT_CTX}, or the "
                          f"model's if smaller]."),
        kv_cache_option,
        kv_disk_option,
        draft_options,
        lora_option,
    ]
    return functools.reduce(lambda g, option: option(g), reversed(options), f)


def lora_option(f):
    """--lora PATH[:SCALE] (repeatable), handed to the command as `loras`: the adapters read, so
    that a bad one is said before the model loads."""
    @functools.wraps(f)
    def command(loras, **kwargs):
        from nibble.formats.lora import parse_ref, read_lora
        return f(loras=tuple(read_lora(*parse_ref(r)) for r in loras), **kwargs)
    return click.option("--lora", "loras", multiple=True, metavar="PATH[:SCALE]",
                        help="Run with this LoRA adapter (a PEFT folder or a GGUF LoRA file) beside the model's "
                             "weights, not merged, scaled by SCALE (1 if left out); repeatable. CPU only.")(command)


def draft_options(f):
    """--draft N, --no-draft and --draft-model, handed to the command as `draft` (0: none) and
    `draft_model` (a reference, or None: prompt lookup)."""
    @functools.wraps(f)
    def command(no_draft, **kwargs):
        if no_draft:
            kwargs["draft"] = 0
        return f(**kwargs)
    command = click.option("--no-draft", is_flag=True, help="Decode one token a pass: no drafts.")(command)
    command = click.option("--draft-model", metavar="MODEL",
                           help="Draft with this smaller model of the same vocabulary instead of prompt lookup "
                                "(each guess costs it a pass: off unless given).")(command)
    return click.option("--draft", default=DEFAULT_DRAFT, show_default=True, type=click.IntRange(0, 15),
                        help="Guess up to N tokens a pass from the prompt and the reply so far, "
                             "checked in the same pass (the reply is the same, often sooner).")(command)


def thinking_options(f=None, *, off=False):
    """--think/--no-think and --reasoning-budget (`run`, `chat`, `serve`), for models that think
    before they answer, handed to the command as one `thinking` (reasoning.ThinkingOptions).
    `off`: a model that thinks answers without thinking unless a flag asks for it (`run`: a
    question answered at once)."""
    if f is None:
        return functools.partial(thinking_options, off=off)

    @functools.wraps(f)
    def command(think, reasoning_budget, **kwargs):
        from nibble.runner.text.reasoning import ThinkingOptions
        if off and think is None and reasoning_budget is None:
            think = False
        return f(thinking=ThinkingOptions(think, reasoning_budget), **kwargs)
    command = click.option("--reasoning-budget", type=click.IntRange(min=-1), metavar="N",
                           help="Think at most N tokens, then answer (0: do not think; -1: no bound) "
                                "[default: -1].")(command)
    return click.option("--think/--no-think", default=None,
                        help="Let a model that can think before it answers do so, or not "
                             f"[default: {'not' if off else 'as the model does'}].")(command)


def gpu_options(f):
    """-ngl/--gpu-layers and --require-gpu (`run`, `chat`, `bench`)."""
    f = click.option("--require-gpu", is_flag=True,
                     help="Exit with an error when there is no usable GPU, instead of running on the CPU.")(f)
    return click.option("-ngl", "--gpu-layers", default=0, show_default=True, type=click.IntRange(min=-1),
                        help="Run the last N layers on an NVIDIA GPU (-1: all, and the output head).")(f)


def _load(model: str, quant: str | None, gpu_layers: int, require_gpu: bool, ctx_size: int | None = None,
          background: bool = True, loras=()):
    """load(), saying in one line on stderr what became of the GPU layers (if anything); on a
    first run the full kernels compile in the background (runner/background.py) unless
    `background` is False."""
    from nibble.runner.loader import load
    llm, tokenizer = load(model, quant, gpu_layers, require_gpu, ctx_size, background, loras)
    _say(llm.offload_note)
    return llm, tokenizer


def _draft_model(ref: str | None, quant: str | None, tokenizer, ctx: int, threads: int | None):
    """--draft-model's model, loaded and checked against the model's vocabulary (None: none)."""
    if ref is None:
        return None
    from nibble.runner.loader import load_draft
    drafts = load_draft(ref, quant, tokenizer, ctx)
    drafts.model.threads.pin(threads)
    return drafts


def _say(note: str):
    """A line for the user on stderr, if there is one."""
    if note:
        click.echo(note, err=True)


def _at_most(flag: str, value: int | None, limit: int, what: str) -> int | None:
    """A -c or -t above what can be used, lowered to it and said in one line (ollama lowers a
    context beyond the model's too; llama.cpp runs past it, which nibble's RoPE tables cannot)."""
    if value is not None and value > limit:
        _say(f"{flag} {value} is more than {what}: using {limit}")
        return limit
    return value


def _threads(threads: int | None) -> int | None:
    """-t, at most the threads numba may start (the cores, unless NUMBA_NUM_THREADS says fewer)."""
    import numba
    limit = numba.config.NUMBA_NUM_THREADS
    return _at_most("-t", threads, limit, f"the {limit} CPU threads here")


def _context(flag: str, ctx: int | None, llm) -> int:
    """-c (or perplexity's --ctx), at most the model's context; DEFAULT_CTX or less if not given."""
    limit = llm.config.max_position_embeddings
    if ctx is None:
        return min(DEFAULT_CTX, limit)
    return _at_most(flag, ctx, limit, f"the model's context of {limit} tokens")


def _stdin_is_terminal() -> bool:
    return sys.stdin is None or sys.stdin.isatty()


def _text(data: bytes | str, source: str) -> str:
    """Text with invalid UTF-8 read as U+FFFD, said in one line (see tokenizer.as_text)."""
    from nibble.runner.text.tokenizer import as_text
    text, note = as_text(data, source)
    _say(note)
    return text


def _read_prompt(prompt: str | None) -> str:
    if prompt is None:
        if _stdin_is_terminal():
            raise click.UsageError("no prompt: give one as an argument, with -p, or on stdin")
        prompt = _text(getattr(sys.stdin, "buffer", sys.stdin).read(), "the prompt on stdin")
    else:
        prompt = _text(prompt, "the prompt")
    if not prompt.strip():
        raise NibbleError("the prompt is empty: give some text to answer")
    return prompt


@main.command()
@click.argument("prompt", required=False)
@click.option("-p", "--prompt", "prompt_option", help="The prompt (instead of the argument).")
@model_option
@click.option("-s", "--system", help="System prompt (chat models).")
@generation_options
@gpu_options
@click.option("--stop", multiple=True, help="Stop when this text appears (repeatable).")
@click.option("--raw", is_flag=True, help="Send the prompt as it is, without the chat template.")
@click.option("-i", "--image", "images", multiple=True, metavar="PATH",
              help="An image the prompt asks about (repeatable; a vision-language model's).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the text and stats.")
@click.option("--json-schema", type=click.Path(dir_okay=False),
              help="Reply with JSON that validates against the JSON schema in this file.")
@click.option("--json-object", is_flag=True, help="Reply with a JSON object (say in the prompt what it should hold).")
@thinking_options(off=True)
@click.option("--hide-thinking", is_flag=True, help="Do not print what a model that thinks thinks (it still thinks).")
def run(prompt, prompt_option, model, quant, system, max_tokens, sampling, threads, ctx_size, kv_cache, kv_disk,
        draft, draft_model, loras, gpu_layers, require_gpu, stop, raw, images, as_json, json_schema, json_object,
        thinking, hide_thinking):
    """Answer PROMPT (or -p, or stdin), about the --image files if any, and stream the reply to
    stdout (a model's thinking, dimmed, to stderr)."""
    text = _read_prompt(prompt_option if prompt_option is not None else prompt)
    system = _text(system, "the system prompt") if system is not None else None
    grammar = _grammar(json_schema, json_object)   # a bad schema is refused before the model loads
    if images and raw:
        raise click.UsageError("--raw sends the prompt as it is: an image needs the chat template")
    from nibble.formats.image import open_image
    pictures = [open_image(path) for path in images]   # a bad image is refused before the model loads
    threads = _threads(threads)
    model = _model_or_default(model)
    from nibble.runner.text.template import build_messages
    from nibble.runner.generation.generate import stream_generate
    from nibble.runner.text.reasoning import chat_prompt
    from nibble.runner.generation.sample import make_sampler
    from nibble.runner.vision.base import for_template, with_images
    llm, tokenizer = _load(model, quant, gpu_layers, require_gpu, ctx_size or DEFAULT_CTX, loras=loras)
    llm.threads.pin(threads)
    ctx_size = _context("-c", ctx_size, llm)
    drafts = _draft_model(draft_model, quant, tokenizer, ctx_size or DEFAULT_CTX, threads) if draft else None
    _say(tokenizer.sampling_note)
    sampling = replace(tokenizer.sampling, **sampling)   # the flags given, over the model's defaults
    if raw:
        ids, split = tokenizer.encode(text), None
    else:
        messages = build_messages(text, system, pictures)
        messages, pictures = for_template(llm.vision, messages)   # a text model refuses images before its template
        prompt_text, split = chat_prompt(tokenizer, messages, thinking, forced=grammar is not None)
        prompt_text, digests = with_images(llm.vision, prompt_text, pictures)
        ids = tokenizer.encode(prompt_text, images=digests)
    cache, pool = _prompt_cache(llm, ids, ctx_size, kv_cache, kv_disk)
    cached = cache.pos
    constraint = grammar.constraint(tokenizer) if grammar else None
    shown = PrintedReply(as_json, hide_thinking)
    last = None
    try:
        for last in stream_generate(llm, tokenizer, ids, sampler=make_sampler(sampling, tokenizer),
                                    max_tokens=max_tokens, stop=stop, cache=cache, constraint=constraint,
                                    draft=draft, reasoning=split, draft_model=drafts):
            shown.add(last.thinking, last.text)
    except KeyboardInterrupt:
        # Ctrl-C: keep what was printed, report, and exit as interrupted programs do.
        shown.end()
        _report(last, shown, as_json, cached, interrupted=True)
        sys.exit(130)
    finally:   # what ran is kept on disk for the next run with the same prefix
        if pool is not None:
            pool.commit(cache)
    shown.end()
    if grammar and last and last.finish_reason != "stop":
        _say(f"the reply ended ({last.finish_reason}) before its JSON was complete: raise -n or -c")
    _report(last, shown, as_json, cached)


def _prompt_cache(llm, ids: list[int], ctx_size: int, kv_type: str, kv_disk: int):
    """-> (the cache run's reply goes on, holding what the disk tier has of `ids`; the pool to keep
    its blocks on disk once it ran, or None where there is no disk tier)."""
    from nibble.runner.kv.blocks import BlockPool
    from nibble.runner.kv.cache import KVCache, blocks_for
    from nibble.runner.kv.disk import open_disk
    if llm.gpu_stage is not None:   # a pool of blocks lives on the CPU only
        return llm.new_cache(ctx_size, kv_type), None
    kv = llm.new_pool(blocks_for(ctx_size), kv_type)
    disk = open_disk(llm.source, kv, kv_disk)
    if disk is None:
        return llm.new_cache(ctx_size, kv_type), None
    pool, cache = BlockPool(kv, disk), KVCache.on_pool(kv, ctx_size)
    pool.admit(cache, ids, ctx_size, llm.prefix_root())   # as the engine admits a request
    return cache, pool


class PrintedReply:
    """A reply as `run` prints it: the answer to stdout as it streams, the thinking before it
    dimmed to stderr (apart from what a pipe reads), or all kept for --json."""

    def __init__(self, as_json: bool, hide_thinking: bool):
        self.as_json, self.hide_thinking = as_json, hide_thinking
        self.thinking, self.text = [], []

    def add(self, thinking: str, text: str):
        if thinking and not self.as_json and not self.hide_thinking:
            click.secho(thinking, dim=True, nl=False, err=True)
            sys.stderr.flush()
        if text and self.thinking and not self.text and not self.as_json and not self.hide_thinking:
            click.echo(err=True)   # the thinking's last line ends before the answer starts
        self.thinking.append(thinking)
        self.text.append(text)
        if text and not self.as_json:
            click.echo(text, nl=False)
            sys.stdout.flush()

    def end(self):
        if not self.as_json:
            click.echo()


def _grammar(json_schema: str | None, json_object: bool):
    """--json-schema FILE or --json-object as a Grammar (None without either)."""
    if json_schema is None and not json_object:
        return None
    if json_schema is not None and json_object:
        raise click.UsageError("give --json-schema or --json-object, not both")
    from nibble.runner.text.grammar import Grammar, GrammarError
    if json_object:
        return Grammar.json_object()
    with open(json_schema, "rb") as f:
        source = _text(f.read(), json_schema)
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as e:
        raise GrammarError(f"{json_schema} is not JSON: {e}") from None
    try:
        return Grammar.json_schema(schema)
    except GrammarError as e:
        raise GrammarError(f"{json_schema}: {e}") from None


def _report(r, shown: PrintedReply, as_json: bool, cached: int, interrupted: bool = False):
    """The stats line (or --json's object); `cached`: the prompt's tokens read back from the disk
    tier rather than prefilled (prompt_tps counts the others)."""
    finish = "interrupted" if interrupted else (r.finish_reason if r else None)
    stats = dict(prompt_tokens=cached + (r.prompt_tokens if r else 0), cached_tokens=cached,
                 prompt_tps=r.prompt_tps if r else 0.0,
                 generation_tokens=r.generation_tokens if r else 0,
                 generation_tps=r.generation_tps if r else 0.0,
                 ttft=r.ttft if r and r.generation_tokens else None)   # None: stopped in the prefill
    if as_json:
        thinking = {"thinking": "".join(shown.thinking)} if any(shown.thinking) else {}
        click.echo(json.dumps({"text": "".join(shown.text), **thinking, "finish_reason": finish, **stats},
                              ensure_ascii=False))
        return
    sys.stdout.flush()   # the reply's last newline before the stats line
    ttft = f"{stats['ttft']:.2f} s" if stats["ttft"] is not None else "-"
    from_disk = f" ({cached} from the disk cache)" if cached else ""
    click.echo(f"prompt {stats['prompt_tokens']} tokens{from_disk}, {stats['prompt_tps']:.1f} tok/s | "
               f"reply {stats['generation_tokens']} tokens, {stats['generation_tps']:.1f} tok/s | "
               f"first token {ttft} | {finish}", err=True)


@main.command()
@model_option
@click.option("-s", "--system", default="", help="System prompt of new chats (editable per chat).")
@generation_options
@thinking_options
@gpu_options
def chat(model, quant, system, max_tokens, sampling, threads, ctx_size, kv_cache, kv_disk, draft, draft_model,
         loras, thinking, gpu_layers, require_gpu):
    """Chat with MODEL in a terminal app; conversations are kept (see README: Chat)."""
    if not _in_terminal():
        raise click.UsageError("nibble chat runs in a terminal; for a pipe or a script, use nibble run")
    threads = _threads(threads)
    model, note = _default_model(model)
    _fetch_if_needed(model)
    from nibble.tui.app import ChatApp
    # The seed is the app's, for every chat; the other flags lie over each model's defaults in new chats;
    # the thinking flags hold in every chat whose settings leave thinking at its default.
    # -c above a model's context: each session is as long as its model's (runner.generation.session).
    seed = sampling.pop("seed", None)
    ChatApp(model, quant=quant, ctx_size=ctx_size or DEFAULT_CTX, kv_cache=kv_cache, kv_disk=kv_disk,
            threads=threads, seed=seed,
            system=system, sampling=sampling, max_tokens=max_tokens, gpu_layers=gpu_layers,
            require_gpu=require_gpu, draft=draft, draft_model=draft_model, loras=loras, thinking=thinking,
            note=note).run()


def _in_terminal() -> bool:
    return _stdin_is_terminal() and sys.stdout.isatty()


def _fetch_if_needed(ref: str):
    """Download an alias's model before the app starts: pip writes its progress to the terminal,
    which the app would paint over. Failures are left to the app, which says why and offers others."""
    from nibble.formats import hub
    if ref in hub.ALIASES and not hub.is_fetched(ref):
        try:
            hub.resolve(ref)
        except NibbleError:
            pass


@main.command()
@model_option
@click.option("--host", default=DEFAULT_HOST, show_default=True,
              help="The address to listen on: 0.0.0.0 opens the server to other machines.")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=click.IntRange(0, 65535),
              help="The port to listen on; 0 picks a free one.")
@click.option("--parallel", default=4, show_default=True, type=click.IntRange(min=1),
              help="Replies decoded together; more requests wait in the queue.")
@click.option("--queue", default=16, show_default=True, type=click.IntRange(min=0),
              help="Requests that may wait for a free slot; past them the server answers 503.")
@click.option("--api-key", envvar="NIBBLE_API_KEY",
              help="Ask clients for this key (Authorization: Bearer KEY, or x-api-key: KEY); /health stays open.")
@threads_option
@click.option("-c", "--ctx-size", type=click.IntRange(min=1),
              help=f"Each reply's context in tokens, at most the model's [default: {DEFAULT_CTX}, or the "
                   f"model's if smaller].")
@kv_cache_option
@kv_disk_option
@click.option("--cache-tokens", type=click.IntRange(min=1),
              help="KV cache positions kept for all replies, finished conversations included "
                   "[default: --parallel times the context].")
@click.option("--models", "only", metavar="A,B,...",
              help="Serve only these models (names as nibble ls prints them) [default: every model in "
                   "nibble's and the Hugging Face cache, loaded when a request names it].")
@click.option("--max-models", default=3, show_default=True, type=click.IntRange(min=1),
              help="Models kept loaded at once; loading one more unloads the least recently used idle one.")
@click.option("--keep-alive", default="5m", show_default=True, metavar="DURATION",
              type=ParsedValue("duration", "nibble.runner.serve.models:parse_keep_alive"),
              help="Unload a model idle this long: 30s, 5m, 1h, 0 (once its replies end) or -1 (never).")
@click.option("--allowed-hosts", metavar="A,B,...",
              help="Host names served beside localhost's while listening on loopback (a name this "
                   "machine is reached by); other Host headers get 403, as a page rebinding its DNS "
                   "name to 127.0.0.1 sends.")
@click.option("--cors-origins", envvar="NIBBLE_ORIGINS", metavar="A,B,...",
              help="Web origins whose pages may call the server (http://host:port; * for any), "
                   "beside pages on localhost; other origins get 403.")
@click.option("--allow-image-urls", is_flag=True,
              help="Fetch the http(s) URLs of the images in requests (off: only images sent as base64 are "
                   "read, since the server would fetch whatever a caller names, on its own network too).")
@click.option("--metrics", is_flag=True,
              help="Serve GET /metrics in Prometheus' format (requests, tokens, speeds, latencies, queue, KV "
                   "blocks), behind --api-key when one is set.")
@thinking_options
@draft_options
@lora_option
@gpu_options
def serve(model, quant, host, port, parallel, queue, api_key, threads, ctx_size, kv_cache, kv_disk, cache_tokens,
          only, max_models, keep_alive, allowed_hosts, cors_origins, allow_image_urls, metrics, thinking, draft,
          draft_model, loras, gpu_layers, require_gpu):
    """Serve models over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/embeddings,
    /v1/models) and Anthropic's and ollama's: MODEL loaded at start, the others when a request
    names them."""
    if gpu_layers or require_gpu:
        raise click.UsageError("nibble serve runs on the CPU for now (the GPU has no paged KV cache yet): "
                               "drop -ngl and --require-gpu")
    names = _comma_list(only, "--models", "models")
    if names and model is None:
        model = names[0]   # the first of --models, not the default model, is loaded at start
    from nibble.runner.serve.guard import Callers
    from nibble.runner.serve.models import EngineOptions, Models, servable
    from nibble.runner.serve.server import listen, serve as run_server
    callers = Callers.of(host, _comma_list(allowed_hosts, "--allowed-hosts", "host names") or (),
                         _comma_list(cors_origins, "--cors-origins", "origins") or ())
    sock = listen(host, port)   # a port in use, and a name --models gives that is not there,
    model = _model_or_default(model)           # are said before the model loads
    refs, default = servable(model, names)
    log = functools.partial(click.echo, err=True)
    options = EngineOptions(parallel, queue, ctx_size or DEFAULT_CTX, kv_cache, _threads(threads), cache_tokens,
                            quant, thinking, draft, kv_disk, draft_model, loras)
    models = Models(refs, default, options, max_models=max_models, keep_alive=keep_alive, log=log)
    if models.encodes(default):   # an embedding model or a reranker: /v1/embeddings, /v1/rerank
        models.load_now(default)
    else:
        llm, tokenizer = _load(model, quant, 0, False, ctx_size or DEFAULT_CTX, loras=loras)
        _context("-c", ctx_size, llm)   # says so if -c is past this model's context (each engine keeps to its model's)
        models.add(default, llm, tokenizer)
    if len(refs) > 1:
        log(f"{len(refs) - 1} more model{'s' * (len(refs) > 2)} loaded on request (GET /v1/models lists them)")
    run_server(models, sock, api_key=api_key, say=lambda line: click.echo(line) or sys.stdout.flush(), warn=log,
               callers=callers, allow_image_urls=allow_image_urls, metrics=metrics)


def _comma_list(text: str | None, option: str, what: str) -> list[str] | None:
    """An option's comma-separated names, or None when it is not given."""
    names = None if text is None else [n.strip() for n in text.split(",")]
    if names is not None and not all(names):
        raise click.BadParameter(f"name {what} separated by commas, none empty", param_hint=option)
    return names


@main.command("import")
@click.argument("gguf_file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False),
              help="The model directory to write.")
@click.option("--float", "keep_float", is_flag=True,
              help="Dequantize every quantized tensor to float32, not keeping the quantization.")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
def import_(gguf_file, output, keep_float, force):
    """Convert a GGUF file into a Hugging Face-style model directory (safetensors), quantized in
    MLX's layout as the GGUF was (exactly where the block type allows), or float with --float."""
    from nibble.formats.model_dir import write_model_dir
    from nibble.quant.gguf_import import import_gguf_model
    report = import_gguf_model(gguf_file, keep_float)
    out = write_model_dir(report.model, output, force=force)
    for o in report.outcomes:
        click.echo(str(o), err=True)
    for name, why in report.kept_float.items():
        click.echo(f"kept in float: {name} ({why})", err=True)
    click.echo(f"wrote {out} ({len(report.model.tensors)} tensors, {report.nbytes / 1e6:.1f} MB, "
               f"{report.bits_per_weight:.2f} bits per weight)", err=True)


@main.command()
@click.argument("model")
@click.option("--lora", "adapters", multiple=True, required=True, metavar="PATH[:SCALE]",
              help="A LoRA adapter (a PEFT folder or a GGUF LoRA file), scaled by SCALE (1 if left out); repeatable.")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="The model directory to write.")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
def merge(model, adapters, output, force):
    """Merge LoRA adapters into MODEL's weights and write the result: each module an adapter
    targets in float32 (W + scale * B @ A), every other tensor as stored (quantized ones stay so;
    nibble quantize OUTPUT requantizes it all)."""
    from nibble.formats.lora import parse_ref, read_lora
    from nibble.formats.model_dir import write_model_dir
    from nibble.formats.sentence_transformers import pipeline_files
    from nibble.quant.open_model import open_model
    from nibble.runner.convert.merge import merged
    loras = [read_lora(*parse_ref(a)) for a in adapters]   # a bad adapter is said before the model is read
    base = open_model(model)
    out = write_model_dir(merged(base, loras), output, force=force,
                          files=pipeline_files(base.path) if base.path and base.path.is_dir() else None)
    modules = len({m for lora in loras for m in lora.pairs})
    click.echo(f"wrote {out}: {modules} modules merged from {len(loras)} adapter{'s' * (len(loras) > 1)}", err=True)


@main.command()
@click.argument("text_file", type=click.Path(exists=True, dir_okay=False))
@model_option
@click.option("--ctx", default=512, show_default=True, type=click.IntRange(min=2),
              help="Window length, at most the model's context.")
@click.option("--chunks", type=click.IntRange(min=1), help="Evaluate only the first N windows.")
@threads_option
@click.option("--save-logits", type=click.Path(dir_okay=False),
              help="Keep this run's next-token distributions in a file, for --kl-base.")
@click.option("--kl-base", type=click.Path(exists=True, dir_okay=False),
              help="Compare against distributions saved by --save-logits: mean KL divergence, top-1 agreement.")
@kv_cache_option
@click.option("--decode", is_flag=True,
              help="Score one token at a time, through the kernels generation uses (slower).")
@lora_option
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def perplexity(text_file, model, quant, ctx, chunks, threads, save_logits, kl_base, kv_cache, decode, loras, as_json):
    """Perplexity of MODEL over TEXT_FILE in non-overlapping windows of --ctx tokens."""
    from nibble.runner.loader import load
    from nibble.runner.measure.perplexity import evaluate
    threads = _threads(threads)
    llm, tokenizer = load(_model_or_default(model), quant, loras=loras)
    llm.threads.pin(threads)
    ctx = _context("--ctx", ctx, llm)
    with open(text_file, "rb") as f:
        tokens = tokenizer.encode(_text(f.read(), text_file), add_bos=False)
    result = evaluate(llm, tokens, ctx=ctx, chunks=chunks, kv_type=kv_cache, save_logits=save_logits,
                      kl_base=kl_base, decode=decode, progress=lambda done, total: click.echo(
                          f"\r[{done}/{total}]", nl=False, err=True))
    click.echo(err=True)
    if as_json:
        click.echo(json.dumps(result.as_dict()))
    else:
        click.echo(result.summary())


@main.command()
@model_option
@click.option("-p", "--prompt-tokens", default=128, show_default=True, type=click.IntRange(min=1),
              help="Prompt length, prefilled as one batch.")
@click.option("-n", "--gen-tokens", default=128, show_default=True, type=click.IntRange(min=1),
              help="Tokens to decode (greedy; the end-of-text token is ignored).")
@click.option("-r", "--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@threads_option
@kv_cache_option
@gpu_options
@click.option("--shapes", metavar="NAME",
              help="Instead of a model: random weights with the shapes of NAME (llama-3.2-1b, "
                   "llama-3.2-3b, llama-2-7b, llama-3-8b, qwen3-8b, qwen3-30b-a3b, gpt-oss-20b), quantized "
                   "as --quant says [default: int4]; gpt-oss-20b's experts in MXFP4, as OpenAI stores "
                   "them. Speed only.")
@click.option("--write-checkpoint", metavar="DIR", type=click.Path(file_okay=False),
              help="With --shapes: instead of measuring, write a model directory of those shapes with "
                   "random bf16 weights, for nibble quantize and run at that size.")
@click.option("--parallel", default=1, show_default=True, type=click.IntRange(min=1),
              help="Decode N streams together (one forward pass a step, as `nibble serve` does) and "
                   "compare their tokens/s with one stream's, measured in turn.")
@click.option("--matrices", is_flag=True,
              help="Instead: each kind of matrix's share of a decoded token, its bytes read from memory and "
                   "from cache, against the memory bandwidth (where decode's time goes).")
@click.option("-i", "--image", metavar="PATH",
              help="Instead: how long a vision-language model's tower and projector take over this image.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def bench(model, quant, prompt_tokens, gen_tokens, repeats, threads, kv_cache, gpu_layers, require_gpu,
          shapes, write_checkpoint, parallel, matrices, image, as_json):
    """Measure prefill and decode speed, and decode's share of the memory bandwidth; for an embedding
    model, texts per second (batches of --parallel texts of -p tokens); with --image, the vision
    tower's time over an image."""
    if write_checkpoint:
        if not shapes:
            raise click.UsageError("--write-checkpoint writes random weights of --shapes NAME: give one")
        from nibble.runner.measure.synthetic import write_random_checkpoint
        click.echo(f"wrote {write_random_checkpoint(shapes, write_checkpoint)}", err=True)
        return
    from nibble.formats import catalog, hub
    from nibble.runner.measure.bench import PROMPT_TEXT, run_bench, run_parallel_bench
    threads = _threads(threads)
    if not shapes:
        model = _model_or_default(model)
    if not shapes and catalog.encodes(hub.resolve(model)):
        if matrices:
            raise click.UsageError("--matrices profiles a language model's decode; this one embeds or reranks")
        return _bench_embedding(model, quant, prompt_tokens, parallel, repeats, threads, as_json)
    if image:
        return _bench_image(model, quant, image, repeats, threads, as_json)
    if matrices and (parallel > 1 or gpu_layers):
        raise click.UsageError("--matrices times the CPU's kernels one product at a time: without --parallel "
                               "or --gpu-layers")
    ctx = prompt_tokens + gen_tokens + 1
    if shapes:
        from nibble.runner.loader import QUANT_BITS
        from nibble.runner.measure.synthetic import random_model
        llm = random_model(shapes, QUANT_BITS[quant or "int4"])
        _say(llm.offload_layers(gpu_layers, ctx, require_gpu))
    else:
        llm, tokenizer = _load(model, quant, gpu_layers, require_gpu, ctx, background=False)   # the full kernels' speed
    llm.threads.pin(threads)
    if matrices:
        from nibble.runner.measure.matrices import run_matrix_bench
        result = run_matrix_bench(llm, repeats)
        click.echo(json.dumps(result.as_dict()) if as_json else result.summary())
        return
    if prompt_tokens + gen_tokens >= llm.config.max_position_embeddings:
        raise NibbleError(f"{prompt_tokens} + {gen_tokens} tokens do not fit in the model's context "
                          f"of {llm.config.max_position_embeddings}")
    if shapes:
        ids = list(range(1, prompt_tokens + 1))       # the speed does not depend on which tokens
    else:
        ids = tokenizer.encode(PROMPT_TEXT, add_bos=False)
        ids = (ids * (prompt_tokens // len(ids) + 1))[:prompt_tokens]
    if parallel > 1:
        result = run_parallel_bench(llm, ids, parallel, gen_tokens, repeats, kv_cache)
    else:
        result = run_bench(llm, ids, gen_tokens, repeats, kv_cache)
    click.echo(json.dumps(result.as_dict()) if as_json else result.summary())


def _bench_image(model, quant, path, repeats, threads, as_json):
    """A vision-language model's bench: its tower and projector over one image."""
    from nibble.formats.image import open_image
    from nibble.runner.measure.bench import run_image_bench
    picture = open_image(path)
    llm, _ = _load(model, quant, 0, False, None, background=False)
    if llm.vision is None:
        raise NibbleError(f"{model} reads no images: --image measures a vision-language model's tower")
    llm.vision.threads.pin(threads)
    result = run_image_bench(llm.vision, picture, repeats)
    click.echo(json.dumps(result.as_dict()) if as_json else result.summary())


def _bench_embedding(model, quant, tokens, texts, repeats, threads, as_json):
    """An embedding model's bench: batches of `texts` (--parallel) texts of `tokens` (-p) tokens (a
    reranker's: pairs)."""
    from nibble.formats.cross_encoder import ranks
    from nibble.runner.measure.bench import PROMPT_TEXT, run_embed_bench
    from nibble.runner.embedding.embed import Embedder
    from nibble.runner.embedding.rerank import Reranker
    from nibble.quant.open_model import open_model
    from nibble.runner.loader import as_quantized
    from nibble.formats.hub import resolve
    source, model_dir = resolve(model), as_quantized(model, open_model(model), quant)
    embedder = Reranker(model_dir, model, source) if ranks(source) else Embedder(model_dir, model)
    embedder.encoder.threads.pin(threads)
    ids = embedder.tokenizer.encode(PROMPT_TEXT * (tokens // 40 + 1)).ids   # cut to the model's length
    if tokens > len(ids):
        raise NibbleError(f"-p {tokens}: this model takes at most {embedder.max_length} tokens a text")
    result = run_embed_bench(embedder, ids[:tokens - 1] + ids[-1:], texts, max(repeats, 5))
    click.echo(json.dumps(result.as_dict()) if as_json else result.summary())


@main.command()
@click.argument("model")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="The directory to write.")
@click.option("--bits", required=True, type=click.Choice(["4", "8"]), help="Bits per weight.")
@click.option("--group-size", default=64, show_default=True, type=click.Choice(["32", "64", "128"]),
              help="Weights sharing one scale and bias.")
@click.option("--embed-bits", type=click.Choice(["4", "8"]),
              help="Bits of the embedding and output head [default: 8].")
@click.option("--calib", type=click.Path(exists=True, dir_okay=False),
              help="Calibration text [default: nibble's own].")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
@click.option("--allow-requantize", is_flag=True, help="Quantize an already quantized model again.")
@click.option("--for", "engine", type=click.Choice(["nibble", "vllm"]), default="nibble", show_default=True,
              help="vllm: zero points that are integers, as vLLM's and SGLang's asymmetric integers hold them "
                   "(nibble export --to compressed-tensors writes it exactly).")
@click.option("--vision", is_flag=True,
              help="Quantize a vision-language model's tower too (by default it is written as stored).")
def quantize(model, output, bits, group_size, embed_bits, calib, force, allow_requantize, engine, vision):
    """Quantize MODEL (directory, .gguf, hub id or alias) to int8 or int4 in OUTPUT."""
    from nibble.runner.convert.quantize import quantize as run_quantize, read_calibration_file
    calib_text = read_calibration_file(calib) if calib else None
    report = run_quantize(model, output, int(bits), int(group_size),
                          embed_bits=int(embed_bits or 8), calib_text=calib_text, force=force,
                          allow_requantize=allow_requantize, progress=_progress_bar,
                          integer_zeros=engine == "vllm", vision=vision)
    click.echo(err=True)
    for name, why in report.kept_float.items():
        click.echo(f"kept in float: {name} ({why})", err=True)
    if report.plain_experts:
        click.echo(f"{report.plain_experts} experts' matrices were quantized without importances: the "
                   f"calibration text reached those experts too rarely (--calib with more text reaches more)",
                   err=True)
    click.echo(f"wrote {output}: {report.bytes_before / 1e6:.1f} MB -> {report.bytes_after / 1e6:.1f} MB, "
               f"{report.bits_per_weight:.2f} bits per weight", err=True)


@main.command()
@click.argument("model")
@click.option("--to", "target", required=True, type=click.Choice(["gguf", "compressed-tensors"]),
              help="gguf: a file for llama.cpp, ollama and LM Studio; compressed-tensors: a directory for "
                   "vLLM and SGLang.")
@click.option("-o", "--output", required=True, type=click.Path(), help="The file (.gguf) or directory to write.")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
def export(model, target, output, force):
    """Write MODEL (directory, .gguf, hub id or alias) for another engine, its weights as nibble
    runs them where the format holds them; what it rounds again, it says, with the KL."""
    from nibble.runner.export import export_compressed, export_gguf
    write = export_gguf if target == "gguf" else export_compressed
    click.echo(str(write(model, output, force=force)), err=True)


def _progress_bar(stage: str, done: int, total: int, width: int = 30):
    filled = width * done // total
    click.echo(f"\r{stage:<12} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}", nl=False, err=True)


for command in (pull, ls, rm, ps, embed, rerank, create, show):
    main.add_command(command)

if __name__ == "__main__":
    main()
