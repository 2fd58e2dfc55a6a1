"""Request bodies as pydantic models, as vLLM's and llama-cpp-python's servers declare theirs: the
field types and rules every API's models share, the sampling fields they all take, and `read`,
which reads a body into its model or raises a 400 saying pydantic's first error in one line: the
field, named by its place in the body (`messages[0].role`), and the rule it breaks.

Each model ignores the fields it does not declare, as OpenAI's, Anthropic's and ollama's servers
do, and a field it declares may be null, which is the same as leaving it out. Types are strict, as
JSON's are: "5" is no integer and 1 is no boolean (a float with no fraction is an integer, as some
JSON writers send one).

Images: a body's image (base64, a data: URL, an http(s) URL) is checked where it stands, as an
ImageSource; `Images` reads it into a Picture (formats/image.py) as the body becomes a ChatBody, and
`message_content` gives a message's parts as the templates read them.
"""
from __future__ import annotations

import base64
import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (AfterValidator, AllowInfNan, BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator,
                      Strict, ValidationError, ValidationInfo, WrapValidator)
from pydantic_core import PydanticCustomError

from nibble.formats.errors import NibbleError
from nibble.formats.image import MAX_BYTES, ImageError, Picture, open_image
from nibble.formats.lora import MAX_SCALE
from ..settings import SamplerSettings
from .errors import ApiError


class Body(BaseModel):
    """A request body, or an object in one."""
    model_config = ConfigDict(extra="ignore")


M = TypeVar("M", bound=Body)


def read(model: type[M], body) -> M:
    """`body` (parsed JSON) as `model`, or ApiError (400) naming the first field that is wrong, and why."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        place, rule = first_problem(e)
        param = place or "the request body"
        raise ApiError(400, f"{param} {rule}", param) from None


# pydantic's error types -> the rule, in words (the others are said by the rules below)
WORDS = {"missing": "is missing", "model_type": "must be a JSON object", "dict_type": "must be a JSON object",
         "list_type": "must be a list", "string_type": "must be a string", "bool_type": "must be true or false",
         "int_type": "must be an integer", "float_type": "must be a number", "finite_number": "must be a number",
         "string_too_short": "must not be empty", "too_short": "must not be empty"}


def first_problem(e: ValidationError) -> tuple[str, str]:
    """-> (the place of pydantic's first error, as the APIs name fields ("": the value itself);
    its rule)."""
    error = e.errors(include_url=False)[0]
    ctx = error.get("ctx", {})
    at = [*error["loc"], *([ctx["field"]] if "field" in ctx else [])]
    place = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in at).removeprefix(".")
    return place, WORDS.get(error["type"], error["msg"])


def refused(rule: str, field: str | None = None) -> PydanticCustomError:
    """The error a validator raises: `rule` broken by the value, or by its part at `field` (in a
    model's validator, for a rule across its fields: one of them)."""
    return PydanticCustomError("rule", "{rule}", {"rule": rule, **({"field": field} if field else {})})


def said(rule: str, keep: tuple[str, ...] = ()) -> WrapValidator:
    """Whatever is wrong in the value said as one rule, at the value (over any rule said inside
    it); but errors at `keep` (a place in the value) as they are."""
    def check(value, handler):
        try:
            return handler(value)
        except ValidationError as e:
            if keep and e.errors()[0]["loc"][:len(keep)] == keep:
                raise
            raise refused(rule) from None
    return WrapValidator(check)


def listed(rule: str | None = None, item: Callable[[str], object] = lambda s: s) -> BeforeValidator:
    """A list, or a string as a list of one (`item` of it); anything else breaks `rule` (None:
    the list's own)."""
    def as_list(value):
        if isinstance(value, str):
            return [item(value)]
        if rule is not None and not isinstance(value, list):
            raise refused(rule)
        return value
    return BeforeValidator(as_list)


def by(key: str, kinds: dict[str | None, type[Body]], otherwise: str | Callable[[object], str]) -> PlainValidator:
    """An object read as the model its `key` names in `kinds` (kinds[None]: the key left out or
    null), that model's first error said as the object's, at its place in it; one of a kind not
    there breaks `otherwise` (a rule, or one made from the kind) at its `key`."""
    def pick(value):
        if not isinstance(value, dict):
            raise refused("must be a JSON object")
        kind = value.get(key)
        model = kinds.get(kind) if kind is None or isinstance(kind, str) else None
        if model is None:
            raise refused(otherwise(kind) if callable(otherwise) else otherwise, key)
        try:
            return model.model_validate(value)
        except ValidationError as e:   # pydantic's docs: a validator raises no ValidationError
            place, rule = first_problem(e)
            raise refused(rule, place or None) from None
    return PlainValidator(pick)


def one_of(*values: str):
    """One of these strings."""
    return Annotated[Literal[values], said(f"must be {either(values)}")]


def either(values: tuple[str, ...]) -> str:
    """'"a", "b" or "c"'"""
    quoted = [json.dumps(v) for v in values]
    return f"{', '.join(quoted[:-1])} or {quoted[-1]}" if len(quoted) > 1 else quoted[0]


def integer(lo: int | None = None, hi: int | None = None):
    """An integer of at least `lo` (and at most `hi`, with a `lo`)."""
    span = f" from {lo} to {hi}" if hi is not None else f" of at least {lo}" if lo is not None else ""
    return Annotated[int, Strict(), Field(ge=lo, le=hi), BeforeValidator(_whole), said(f"must be an integer{span}")]


def _whole(value):
    """A float with no fraction: that integer."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def unsupported(why: str = "") -> AfterValidator:
    """A field nibble refuses when it is given: anything but null, false, 0 or empty."""
    def refuse(value):
        if value:
            raise refused("is not supported" + (f": {why}" if why else ""))
        return value
    return AfterValidator(refuse)


def stops(most: int):
    """Stop strings: one, or a list of at most `most`."""
    return Annotated[list[Text], Field(max_length=most), listed(),
                     said(f"must be a string or a list of at most {most} strings")]


Flag = Annotated[bool, Strict()]
Text = Annotated[str, Strict()]
Name = Annotated[str, Strict(), Field(min_length=1), said("must be a non-empty string")]
Number = Annotated[float, Strict(), AllowInfNan(False)]   # an integer is one too
JsonObject = dict[str, Any]


# ---- sampling ----

# The sampling fields -> SamplerSettings' names.
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repeat_penalty": "repetition_penalty", "repetition_penalty": "repetition_penalty",
                   "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                   "dry_multiplier": "dry_multiplier", "dry_base": "dry_base",
                   "dry_allowed_length": "dry_allowed_length", "dry_penalty_last_n": "dry_penalty_last_n",
                   "seed": "seed"}


def _sampler_takes(value, info: ValidationInfo):
    """A sampling field's value, checked by SamplerSettings' own rule for it."""
    try:
        SamplerSettings(**{SAMPLING_FIELDS[info.field_name]: value})
    except NibbleError as e:
        raise refused(f"is out of range: {e}") from None
    return value


SamplingNumber = Annotated[Number, AfterValidator(_sampler_takes)]
SamplingInteger = Annotated[integer(), AfterValidator(_sampler_takes)]


class Sampling(Body):
    """The sampling fields every API takes."""
    temperature: SamplingNumber | None = None
    top_p: SamplingNumber | None = None
    top_k: SamplingInteger | None = None

    def sampling(self) -> dict:
        """The SamplerSettings fields the body sets, to lay over the model's."""
        given = ((SAMPLING_FIELDS[name], getattr(self, name)) for name in type(self).model_fields
                 if name in SAMPLING_FIELDS)
        return {name: value for name, value in given if value is not None}


class FullSampling(Sampling):
    """And the others: OpenAI's penalties and seed; llama.cpp's server's min_p, repeat_penalty and
    DRY fields, which OpenAI's clients send in `extra_body` (repetition_penalty is vLLM's
    spelling) and ollama's in `options`."""
    min_p: SamplingNumber | None = None
    repeat_penalty: SamplingNumber | None = None
    repetition_penalty: SamplingNumber | None = None
    presence_penalty: SamplingNumber | None = None
    frequency_penalty: SamplingNumber | None = None
    dry_multiplier: SamplingNumber | None = None
    dry_base: SamplingNumber | None = None
    dry_allowed_length: SamplingInteger | None = None
    dry_penalty_last_n: SamplingInteger | None = None
    seed: SamplingInteger | None = None


class AdapterScale(Body):
    """One of llama.cpp's `lora` entries: a loaded adapter (its index in GET /lora-adapters) and its scale."""
    id: integer(0)
    scale: Annotated[Number, Field(ge=-MAX_SCALE, le=MAX_SCALE), said(f"must be a number from -{MAX_SCALE:g} to {MAX_SCALE:g}")]


# llama.cpp's `lora`, on a request or POST /lora-adapters: the adapters named run at their scales, the others not
Adapters = Annotated[list[AdapterScale], Field(max_length=256)]


# ---- images ----

FETCH_SECONDS = 10   # an image URL's whole fetch, connecting included


@dataclass(frozen=True)
class ImageSource:
    """An image as a body gives it, not yet read: its file's bytes, or the http(s) URL to fetch them from."""
    data: bytes = b""
    url: str | None = None


def _base64(text: str) -> bytes:
    """Standard base64, line breaks and spaces allowed (some clients wrap it)."""
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except ValueError as e:   # binascii.Error, or text that is not ASCII
        raise refused(f"is not valid base64 ({e})") from None


def _image_location(text: str) -> ImageSource:
    """A data: URL's bytes, or an http(s) URL to fetch; any other scheme (file:, ftp:) is refused,
    since the server would read what the caller names."""
    scheme = text.partition(":")[0].strip().lower() if ":" in text else ""
    if scheme == "data":
        return ImageSource(_data_url(text))
    if scheme in ("http", "https"):
        return ImageSource(url=text)
    which = f", not a {scheme}: URL" if scheme and len(scheme) <= 10 and scheme.isalnum() else ""
    raise refused(f"must be a data: URL (data:image/png;base64,...) or an http(s) URL{which}")


def _data_url(text: str) -> bytes:
    """data:image/png;base64,... (RFC 2397): an image's media type; base64 or percent-encoded bytes."""
    head, comma, data = text.partition(",")
    if not comma:
        raise refused("is a data: URL without the comma before its data")
    kind, *params = head[len("data:"):].split(";")
    kind = kind.strip().lower()
    if not kind.startswith("image/"):
        kind = kind if 0 < len(kind) <= 40 else "text/plain" if not kind else kind[:37] + "..."
        raise refused(f"is a data: URL of {kind}, which is no image: send image/png, image/jpeg, image/webp or "
                      "image/gif")
    if "base64" in (p.strip().lower() for p in params):
        return _base64(data)
    return urllib.parse.unquote_to_bytes(data)


Base64 = Annotated[Text, AfterValidator(_base64)]                   # -> bytes
ImageLocation = Annotated[Text, AfterValidator(_image_location)]    # -> ImageSource


@dataclass(frozen=True)
class Images:
    """How a request's images are read: each decoded once, within formats/image.py's bounds; an
    http(s) URL fetched first only where the server allows it (`allow_urls`, --allow-image-urls),
    since the server then fetches whatever a caller names, on its own network too."""
    allow_urls: bool = False
    seconds: float = FETCH_SECONDS

    def open(self, source: ImageSource, place: str) -> Picture:
        """The image at `place` in the body (its name in errors), or ApiError (400) saying why not."""
        data = source.data if source.url is None else self.fetch(source.url, place)
        try:
            return open_image(data, place)
        except ImageError as e:
            raise ApiError(400, str(e), place) from None

    def fetch(self, url: str, place: str) -> bytes:
        """The bytes at an http(s) URL: at most formats.image.MAX_BYTES (reading stops past them),
        within `seconds`."""
        shown = url if len(url) <= 80 else url[:77] + "..."
        if not self.allow_urls:
            raise ApiError(400, f"{place} is an image URL, which this server fetches only when it runs with "
                                "--allow-image-urls: send the image's bytes instead (a data: URL, base64)", place)
        deadline = time.monotonic() + self.seconds
        too_large = ApiError(400, f"{place}: {shown} is more than {MAX_BYTES // 2**20} MB: images of at most "
                                  f"{MAX_BYTES // 2**20} MB are read", place)
        try:
            request = urllib.request.Request(url, headers={"User-Agent": "nibble", "Accept": "image/*"})
            with urllib.request.build_opener(_WebRedirects).open(request, timeout=self.seconds) as reply:
                length = reply.headers.get("Content-Length", "")
                if length.isdigit() and int(length) > MAX_BYTES:
                    raise too_large
                data = bytearray()
                while chunk := reply.read1(1 << 16):
                    data += chunk
                    if len(data) > MAX_BYTES:
                        raise too_large
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"not read within {self.seconds:g} s")
                return bytes(data)
        except urllib.error.HTTPError as e:
            raise ApiError(400, f"{place}: {shown} answered {e.code} {e.reason}", place) from None
        except urllib.error.URLError as e:
            raise ApiError(400, f"{place}: cannot fetch {shown}: {e.reason}", place) from None
        except (OSError, http.client.HTTPException, ValueError) as e:   # timeouts, resets, a malformed reply or URL
            raise ApiError(400, f"{place}: cannot fetch {shown}: {e or type(e).__name__}", place) from None


class _WebRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects to http(s) only (urllib's own refuses file:, not ftp:)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        scheme = urllib.parse.urlsplit(newurl).scheme.lower()
        if scheme not in ("http", "https"):
            raise urllib.error.HTTPError(newurl, code, f"redirected to {scheme}:, which nibble does not fetch",
                                         headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def message_content(parts: list[str | tuple[str, ImageSource]], images: Images,
                    joined_by: str = "") -> str | list[dict]:
    """A message's parts (text, or an image: (its place in the body, its source)) as the
    templates read them: without images, the text joined as it always was; with them, each in
    order, {"type": "text", "text": ...} or {"type": "image", "image": Picture} (empty text left out)."""
    if all(isinstance(p, str) for p in parts):
        return joined_by.join(parts)
    return [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": images.open(p[1], p[0])}
            for p in parts if p != ""]
