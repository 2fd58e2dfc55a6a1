"""ollama's API, its models: /api/tags (every model the server can serve), /api/show (what one is,
from memory or its files, without loading it), /api/create (a preset: formats/presets.py),
/api/ps (those loaded), /api/version, and the heartbeat at / that the ollama command line sends
before each command.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import re
from dataclasses import dataclass
from datetime import datetime, timezone

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from pydantic import Field

from nibble.formats import catalog, hub, presets
from nibble.formats.catalog import Details
from nibble.formats.errors import NibbleError
from nibble.formats.sentence_transformers import embeds, read_pipeline
from ..text.template import ChatTemplateError
from ..text.reasoning import reasoning_family
from ..settings import SamplerSettings
from .bodies import Body, Flag, JsonObject, Text, read
from .errors import ApiError
from .models import Models
from .ollama import served_name
from .pending import read_json
from .replies import Embedding, Served


async def tags(models: Models, request: Request) -> Response:
    """Every model the server can serve, loaded or not, as ollama lists those it has pulled."""
    loaded = {served.name: served.details for served, _ in models.loaded()}
    refs = list(models.refs.items())   # here: /api/create may add one meanwhile
    entries = await run_in_threadpool(lambda: [tag(name, ref, loaded.get(name)) for name, ref in refs])
    return JSONResponse({"models": entries})


def tag(name: str, ref: str, details: Details | None) -> dict:
    """One model as /api/tags lists it: what its files and headers say (a loaded model's details
    as it runs); zeros and "" where they cannot say (its files gone since the server started)."""
    try:
        path = hub.resolve(ref, record=False)   # served models are on disk: no network
        size, modified = catalog.size_on_disk(path), _time(path.stat().st_mtime)
        digest = hashlib.sha256(catalog.identity(path).encode()).hexdigest()
        details = details or catalog.describe(path)
    except (NibbleError, OSError, ValueError):
        size, modified, digest = 0, _time(0), ""
    return {"name": name, "model": name, "modified_at": modified, "size": size, "digest": digest,
            "details": model_details(details)}


def model_details(details: Details | None) -> dict:
    """ollama's `details` of a model, "" where nibble cannot say."""
    if details is None:
        return {"parent_model": "", "format": "", "family": "", "families": [], "parameter_size": "",
                "quantization_level": ""}
    family = "" if details.family == "?" else details.family
    size = catalog.parameter_size(details.parameters)
    return {"parent_model": "", "format": details.format, "family": family, "families": [family] if family else [],
            "parameter_size": "" if size == "?" else size, "quantization_level": details.quantization}


def _time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class About:
    """What /api/show says of a model."""
    details: Details | None
    template: str               # its chat template's source; "" if it has none
    sampling: SamplerSettings   # its sampling defaults
    context: int                # the context a request gets: the server's --ctx-size, at most the model's
    embedding: bool = False     # an embedding model (its context: the tokens a text is cut to)

    @classmethod
    def of_served(cls, served: Served | Embedding) -> About:
        if isinstance(served, Embedding):
            return cls(served.details, "", SamplerSettings(), served.engine.ctx, embedding=True)
        return cls(served.details, _template_source(served.tokenizer), served.tokenizer.sampling, served.engine.ctx)

    @classmethod
    def on_disk(cls, ref: str, ctx: int) -> About:
        """From the model's files, without loading it: its headers, config and tokenizer."""
        path = hub.resolve(ref, record=False)
        details = catalog.describe(path)
        if embeds(path, details.family):
            from nibble.formats.model_dir import read_model_dir
            longest = read_model_dir(path).config.max_position_embeddings   # weights mapped, not read
            return cls(details, "", SamplerSettings(), min(read_pipeline(path).max_length or longest, longest),
                       embedding=True)
        if path.suffix == ".gguf":
            from nibble.formats.gguf_header import read_gguf_header
            meta = read_gguf_header(path).metadata
            template, sampling = meta.get("tokenizer.chat_template") or "", SamplerSettings()
            longest = meta.get(f"{details.family}.context_length")
        else:
            from nibble.formats.model_dir import read_model_dir
            from ..text.tokenizer import Tokenizer
            model_dir = read_model_dir(path)   # weights mapped, not read
            tokenizer = Tokenizer(model_dir)
            template, sampling = _template_source(tokenizer), tokenizer.sampling
            longest = model_dir.config.max_position_embeddings
        if preset := presets.find(ref):   # its settings over the model's, its template
            sampling = dataclasses.replace(sampling, **{k: v for k, v in preset.parameters.items()})
            template = preset.template if preset.template is not None else template
        return cls(details, template if isinstance(template, str) else "", sampling,
                   min(ctx, longest) if isinstance(longest, int) and longest > 0 else ctx)


def _template_source(tokenizer) -> str:
    try:
        return tokenizer.chat_template.source
    except ChatTemplateError:
        return ""


def capabilities(template: str, embedding: bool = False) -> list[str]:
    """What a model's chat template says it can do, in ollama's words."""
    if embedding:
        return ["embedding"]
    out = ["completion"]
    if re.search(r"\btools\b", template):
        out.append("tools")
    if reasoning_family(template):
        out.append("thinking")
    return out


class ShowRequest(Body):
    model: Text | None = None
    name: Text | None = None   # older clients'


async def show(models: Models, request: Request) -> Response:
    body = read(ShowRequest, await read_json(request))
    name = served_name(models, body.model or body.name)
    served = next((s for s, _ in models.loaded() if s.name == name), None)
    about = About.of_served(served) if served else \
        await run_in_threadpool(About.on_disk, models.refs[name], models.options.ctx)
    reply = show_reply(name, models.refs[name], about)
    if (preset := presets.read(models.refs[name])) is not None:   # its Presetfile, as ollama shows a Modelfile
        reply |= {"modelfile": f"# Presetfile of {name}\n{presets.dump(preset)}", "system": preset.system or ""}
    return JSONResponse(reply)


class CreateMessage(Body):
    role: Text
    content: Text


class CreateRequest(Body):
    """ollama's /api/create: the preset's fields, or (older clients) a Modelfile's text."""
    model: Text | None = None
    name: Text | None = None           # older clients'
    source: Text | None = Field(None, alias="from")
    modelfile: Text | None = None      # older clients'
    system: Text | None = None
    template: Text | None = None
    parameters: JsonObject | None = None
    messages: list[CreateMessage] | None = None
    license: Text | list[Text] | None = None
    adapters: JsonObject | None = None
    files: JsonObject | None = None
    quantize: Text | None = None
    stream: Flag | None = None


async def create(models: Models, request: Request) -> Response:
    """A preset kept under the body's name and served from then on; ollama's progress lines (one
    JSON object a line unless `stream` is false), which here are two."""
    body = read(CreateRequest, await read_json(request))
    name = body.model or body.name
    if name is None:
        raise ApiError(400, "model is missing: the preset's name", "model")
    for field, why in (("adapters", "takes no uploaded adapters: a Presetfile's ADAPTER names one on this machine "
                        "(nibble create)"), ("files", "creates presets of the models it "
                       "has, named by from, not of uploaded files"), ("quantize", "quantizes with nibble quantize")):
        if getattr(body, field) is not None:
            raise ApiError(400, f"{field}: nibble {why}", field)
    preset = presets.parse(body.modelfile, "modelfile") if body.modelfile else presets.Preset("")
    if preset.adapters:   # no request makes the server read a path it names
        raise ApiError(400, "modelfile: ADAPTER: the server reads no path a request names; nibble create "
                            "makes a preset with an adapter", "modelfile")
    preset.source = body.source or preset.source
    if not preset.source:
        raise ApiError(400, "from is missing: the model the preset runs", "from")
    preset.source = models.refs.get(preset.source, preset.source)   # a name served here: its files
    preset.system = body.system if body.system is not None else preset.system
    preset.template = body.template if body.template is not None else preset.template
    for key, value in (body.parameters or {}).items():
        preset.parameters.update([presets.parameter(key, str(value), f"parameters.{key}")])
    preset.messages += [{"role": m.role, "content": m.content} for m in body.messages or []]
    if body.license is not None:
        preset.license = body.license if isinstance(body.license, str) else "\n".join(body.license)
    from ..loader import check_preset   # the model's files resolved: off the event loop
    await run_in_threadpool(check_preset, name, preset)
    presets.save(name, preset)
    models.serve_also(name)
    if body.stream is False:
        return JSONResponse({"status": "success"})
    return Response('{"status":"writing the preset"}\n{"status":"success"}\n', media_type="application/x-ndjson")


def show_reply(name: str, ref: str, about: About) -> dict:
    s = about.sampling
    parameters = {"num_ctx": about.context, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                  "min_p": s.min_p, "repeat_penalty": s.repetition_penalty, "repeat_last_n": s.repeat_last_n}
    lines = "\n".join(f"{k:<30} {v}" for k, v in parameters.items())
    modelfile = "\n".join([f"# Modelfile of {name}, as nibble serves it", f"FROM {ref}",
                           *([f'TEMPLATE """{about.template}"""'] if about.template else []),
                           *(f"PARAMETER {k} {v}" for k, v in parameters.items())])
    details = about.details
    family = details.family if details and details.family != "?" else ""
    info = {"general.architecture": family, "general.parameter_count": details.parameters if details else None,
            **({f"{family}.context_length": about.context} if family else {})}
    return {"modelfile": modelfile, "parameters": lines, "template": about.template,
            "details": model_details(details), "model_info": info,
            "capabilities": capabilities(about.template, about.embedding)}


async def running(models: Models, request: Request) -> Response:
    """The models loaded (`ollama ps`, `nibble ps`)."""
    return JSONResponse({"models": [running_model(s.name, s.details, s.size, s.engine.ctx, until)
                                    for s, until in models.loaded()]})


# A model kept until the server stops (--keep-alive -1): an expiry no clock reaches, which ollama's
# clients show as "Forever".
NEVER = "9999-12-31T23:59:59Z"


def running_model(name: str, details: Details | None, size: int, ctx: int, until: float | None) -> dict:
    """One loaded model as `GET /api/ps` lists it, on the CPU (no VRAM); `until`: when the
    keep-alive unloads it (time.time(); None: never)."""
    expires = NEVER if until is None else \
        datetime.fromtimestamp(until, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
    return {"name": name, "model": name, "size": size, "digest": "", "details": model_details(details),
            "expires_at": expires, "size_vram": 0, "context_length": ctx}


async def heartbeat(models: Models, request: Request) -> Response:
    """`HEAD /`: the ollama command line's check that a server is there before each command."""
    return PlainTextResponse("nibble is running")


async def version(models: Models, request: Request) -> Response:
    return JSONResponse({"version": nibble_version()})


def nibble_version() -> str:
    try:
        return importlib.metadata.version("nibble")
    except importlib.metadata.PackageNotFoundError:   # run from a checkout that was never installed
        return "0.0.0"

