"""Images in the server's request bodies, for every API: read into the neutral message parts (text,
then each image as a Picture, in order, with its pixels and its place in the body as its name); a
text model's 400 in the API's own shape; each hostile image (not an image, cut short, a
decompression bomb, bad base64, a data URL of no image, an http URL without --allow-image-urls, a
file: URL) one line of 400; with the flag, an image fetched from a local http.server, and one past
the bound refused; a fuzz of chat's content parts."""
import base64
import contextlib
import functools
import http.server
import io
import json
import struct
import threading
import zlib
from pathlib import Path
from types import SimpleNamespace

import anthropic
import numpy as np
import ollama
import openai
import pytest
from hypothesis import event, example, given, strategies as st
from PIL import Image

import tests.serving
from nibble.formats.image import Picture
from nibble.formats.model_dir import write_model_dir
from nibble.runner.serve import anthropic as messages_api, api, bodies, ollama as ollama_api, replies, responses
from nibble.runner.serve.api import ChatBody
from nibble.runner.serve.bodies import Images
from nibble.runner.serve.errors import ApiError
from nibble.runner.serve.server import Server
from nibble.runner.text.reasoning import ThinkingOptions
from tests.serving import KEY, serving, with_context
from tests.tiny import tiny_model_dir

rng = np.random.default_rng(0)
RED, BLUE = rng.integers(0, 256, (4, 5, 3), dtype=np.uint8), rng.integers(0, 256, (3, 2, 3), dtype=np.uint8)


def png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


@functools.cache
def bomb() -> bytes:
    """A whole PNG of 20000 x 20000 zeros (1 bit a pixel: 50 MB decoded to bits, 1.2 GB to RGB) in
    about 50 KB."""
    rows = 20000 * (1 + 20000 // 8)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(bytes(rows), 9)) + chunk(b"IEND", b""))


# ---- each API's body with images: (path, body, the places of its images) ----

QUESTION = "What is in these?"


def openai_chat(urls: list[str]):
    parts = [{"type": "text", "text": QUESTION},
             *({"type": "image_url", "image_url": {"url": url, "detail": "auto"}} for url in urls)]
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": parts}]}
    return "/v1/chat/completions", body, [f"messages[0].content[{j + 1}]" for j in range(len(urls))]


def anthropic_source(url: str) -> dict:
    """A data: URL as Anthropic's base64 source, any other URL as its url source."""
    if url.startswith("data:"):
        head, _, data = url.partition(",")
        return {"type": "base64", "media_type": head[len("data:"):].split(";")[0], "data": data}
    return {"type": "url", "url": url}


def anthropic_messages(urls: list[str], path="/v1/messages"):
    blocks = [{"type": "text", "text": QUESTION}, *({"type": "image", "source": anthropic_source(u)} for u in urls)]
    return (path, {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": blocks}]},
            [f"messages[0].content[{j + 1}]" for j in range(len(urls))])


def ollama_images(urls: list[str]) -> list[str]:
    """ollama's images are base64 alone: a data: URL's data, anything else as it is."""
    return [url.partition(",")[2] if url.startswith("data:") else url for url in urls]


def ollama_chat(urls: list[str]):
    return ("/api/chat", {"model": "tiny", "stream": False, "options": {"num_predict": 2},
                          "messages": [{"role": "user", "content": QUESTION, "images": ollama_images(urls)}]},
            [f"messages[0].images[{j}]" for j in range(len(urls))])


def ollama_generate(urls: list[str]):
    return ("/api/generate", {"model": "tiny", "stream": False, "options": {"num_predict": 2}, "prompt": QUESTION,
                              "images": ollama_images(urls)},
            [f"images[{j}]" for j in range(len(urls))])


def responses_input(urls: list[str]):
    parts = [{"type": "input_text", "text": QUESTION},
             *({"type": "input_image", "image_url": url, "detail": "low"} for url in urls)]
    return ("/v1/responses", {"model": "tiny", "max_output_tokens": 2, "input": [{"role": "user", "content": parts}]},
            [f"input[0].content[{j + 1}]" for j in range(len(urls))])


def count_tokens(urls: list[str]):
    return anthropic_messages(urls, "/v1/messages/count_tokens")


APIS = [openai_chat, anthropic_messages, count_tokens, ollama_chat, ollama_generate, responses_input]
PARSERS = {"/v1/chat/completions": api.parse_chat, "/v1/messages": messages_api.parse_messages,
           "/v1/messages/count_tokens": functools.partial(messages_api.parse_messages, counting=True),
           "/api/chat": ollama_api.parse_chat, "/api/generate": ollama_api.parse_generate,
           "/v1/responses": lambda body, images=Images(): responses.parse(body, images).chat}


def parsed(body_of, urls: list[str], images: Images = Images()) -> tuple[ChatBody, list[str]]:
    path, body, places = body_of(urls)
    return PARSERS[path](body, images=images), places


def parts(message: dict) -> list:
    """A message's parts: text, or (the image's name, its pixels)."""
    return [p["text"] if p["type"] == "text" else (p["image"].name, p["image"].pixels) for p in message["content"]]


def assert_parts(message: dict, places: list[str], *pixels: np.ndarray):
    """The question, then each image in order, named by its place, with its pixels."""
    got = parts(message)
    assert got[0] == QUESTION and [name for name, _ in got[1:]] == places
    for (_, decoded), expected in zip(got[1:], pixels, strict=True):
        np.testing.assert_array_equal(decoded, expected)


@pytest.mark.parametrize("body_of", APIS)
def test_each_apis_images_read_into_the_neutral_parts_in_order(body_of):
    body, places = parsed(body_of, [data_url(png(RED)), data_url(png(BLUE))])
    [message] = [m for m in body.messages if m["role"] == "user"]
    assert_parts(message, places, RED, BLUE)
    picture = message["content"][1]["image"]
    assert isinstance(picture, Picture) and picture.nbytes == len(png(RED)) and picture.size == (5, 4)


def test_text_stays_a_string_and_parts_keep_their_order_where_the_api_orders_them():
    text = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert api.parse_chat({"messages": [{"role": "user", "content": text}]}).messages[0]["content"] == "ab"
    image = {"type": "image_url", "image_url": data_url(png(BLUE))}   # the URL alone, as some clients send it
    body = api.parse_chat({"messages": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": [image, *text, image]}]})
    assert body.messages[0]["content"] == "Be brief."
    assert [p if isinstance(p, str) else p[0] for p in parts(body.messages[1])] == \
        ["messages[1].content[0]", "a", "b", "messages[1].content[3]"]
    alone = [{"role": "user", "images": [base64.b64encode(png(RED)).decode()]}]
    ollama_body = ollama_api.parse_chat({"messages": alone})
    assert [p[0] for p in parts(ollama_body.messages[0])] == ["messages[0].images[0]"]   # no empty text part


def test_an_anthropic_tool_result_may_hold_images():
    """As Claude Code's Read tool answers for an image file: the tool message holds the parts."""
    body = messages_api.parse_messages({"max_tokens": 5, "messages": [
        {"role": "user", "content": "Look at cat.png"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True, "content": [
            {"type": "image", "source": anthropic_source(data_url(png(RED)))}, {"type": "text", "text": "done"}]}]}]})
    tool = body.messages[-1]
    assert tool["role"] == "tool" and tool["tool_call_id"] == "toolu_1"
    assert [p if isinstance(p, str) else p[0] for p in parts(tool)] == \
        ["Error: ", "messages[2].content[0].content[0]", "done"]


def test_a_text_model_refuses_before_its_template():
    """replies.chat_text's first step: the template of a model that reads no images never sees them."""
    body, places = parsed(openai_chat, [data_url(png(RED))])
    served = SimpleNamespace(name="tiny", engine=SimpleNamespace(model=SimpleNamespace(vision=None)),
                             family="generic", tokenizer=None, thinking=ThinkingOptions())
    with pytest.raises(ApiError) as e:
        replies.chat_text(served, body)
    assert (e.value.status, e.value.param) == (400, "messages[0].content[1]")
    assert str(e.value).startswith("tiny reads no images: messages[0].content[1] is one")


# ---- over HTTP: a text model, and hostile images ----

@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_model_dir(with_context(tiny_model_dir()), tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def server(model_path):
    with serving(model_path) as running:
        yield running


@pytest.fixture(scope="module")
def fetching(model_path):
    """The same model served with --allow-image-urls."""
    with contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as patch:   # only while the server starts
            patch.setattr(tests.serving, "Server", functools.partial(Server, allow_image_urls=True))
            running = stack.enter_context(serving(model_path))
        yield running


def refusal(path: str, status: int, raw: bytes) -> str:
    """A 400 in the API's own shape: its message, one line."""
    assert status == 400, raw
    body = json.loads(raw)
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        message = body["error"]["message"]
    elif path.startswith("/api/"):
        assert list(body) == ["error"], body
        message = body["error"]
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        message = body["error"]["message"]
    assert isinstance(message, str) and "\n" not in message and "Traceback" not in message
    return message


@pytest.mark.parametrize("body_of", APIS)
def test_a_text_model_refuses_an_image_in_each_apis_shape(server, body_of):
    path, body, places = body_of([data_url(png(RED))])
    message = refusal(path, *server.post(path, body)[::2])
    assert message.startswith(f"tiny reads no images: {places[0]} is one"), message


def test_the_official_clients_raise_the_text_models_refusal(server):
    port, url = server.port, data_url(png(RED))
    with pytest.raises(openai.BadRequestError, match="tiny reads no images"):
        server.client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}]}])
    with pytest.raises(openai.BadRequestError, match="tiny reads no images"):
        server.client.responses.create(model="tiny", max_output_tokens=2, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": url, "detail": "auto"}]}])
    claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="tiny reads no images"):
        claude.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": anthropic_source(url)}]}])
    local = ollama.Client(host=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {KEY}"})
    for call in (lambda: local.chat(model="tiny", messages=[{"role": "user", "content": "hi", "images": [png(RED)]}]),
                 lambda: local.generate(model="tiny", prompt="hi", images=[png(RED)])):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 400 and "tiny reads no images" in e.value.error


def cut_short() -> bytes:
    whole = png(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    return whole[:len(whole) // 2]


# (the image as a URL, what the refusal says: "*" for every API, or an API's own words)
HOSTILE = {
    "not an image": (data_url(b"hello, world"), {"*": "is not an image"}),
    "cut short": (data_url(cut_short()), {"*": "cannot be decoded"}),
    "bomb": (data_url(bomb()), {"*": "megapixels"}),
    "bad base64": ("data:image/png;base64,not*base64", {"*": "is not valid base64"}),
    "a data URL of text": ("data:text/plain;base64,aGVsbG8=", {"*": "text/plain, which is no image",
                                                               "anthropic": "must be \"image/jpeg\"",
                                                               "ollama": "is not an image"}),
    "http without the flag": ("http://127.0.0.1:9/cat.png", {"*": "--allow-image-urls", "ollama": "base64"}),
    "file URL": ("file:///etc/passwd", {"*": "not a file: URL", "ollama": "base64"}),
}


@pytest.mark.parametrize("case", HOSTILE)
@pytest.mark.parametrize("body_of", APIS)
def test_a_hostile_image_is_one_line_of_400_naming_it_in_each_api(server, body_of, case):
    url, words = HOSTILE[case]
    path, body, places = body_of([data_url(png(BLUE)), url])
    message = refusal(path, *server.post(path, body)[::2])
    family = "anthropic" if path.startswith("/v1/messages") else "ollama" if path.startswith("/api/") else "*"
    assert places[1] in message and words.get(family, words["*"]) in message, message


def test_raw_generate_takes_no_images(server):
    body = {"model": "tiny", "prompt": "hi", "raw": True, "images": [base64.b64encode(png(RED)).decode()]}
    assert refusal("/api/generate", *server.post("/api/generate", body)[::2]).startswith("images cannot be combined")


def test_what_stays_refused_says_so():
    for parse, body, words in [
            (api.parse_chat, {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
             "nibble reads no audio"),
            (messages_api.parse_messages, {"max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "document", "source": {}}]}]}, "read no documents"),
            (messages_api.parse_messages, {"max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "file", "file_id": "file_1"}}]}]}, "keeps no files"),
            (responses.parse, {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
             "keeps no files"),
            (responses.parse, {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
             "'input_file' is not supported")]:
        with pytest.raises(ApiError, match=words) as e:
            parse(body)
        assert e.value.status == 400


# ---- --allow-image-urls: a local http.server ----

BOUND = 10_000   # bytes: the bound formats.image.MAX_BYTES sets, made small


class Files(http.server.BaseHTTPRequestHandler):
    """/red.png; /big.png past BOUND, said by its Content-Length, and /unsized.png, whose length
    nothing says; /missing.png (404); /to-file and /to-ftp, redirects to a file: and an ftp: URL."""
    asked: list[str] = []

    def do_GET(self):
        self.asked.append(self.path)
        if self.path.startswith("/to-"):
            self.send_response(302)
            elsewhere = {"/to-file": "file:///etc/passwd", "/to-ftp": "ftp://127.0.0.1/x.png"}
            self.send_header("Location", elsewhere[self.path])
            self.end_headers()
            return
        body = {"/red.png": png(RED), "/big.png": bytes(BOUND + 1), "/unsized.png": bytes(BOUND * 3)}.get(self.path)
        self.send_response(404 if body is None else 200)
        if self.path != "/unsized.png":
            self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def files():
    """The site's address; urllib asks it directly, whatever proxy the environment names."""
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    thread = threading.Thread(target=site.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name in ("no_proxy", "NO_PROXY"):
                patch.setenv(name, "127.0.0.1")
            yield f"http://127.0.0.1:{site.server_address[1]}"
    finally:
        site.shutdown()
        thread.join()


@pytest.mark.parametrize("body_of", [openai_chat, anthropic_messages, responses_input])
def test_with_the_flag_an_http_url_is_fetched(files, body_of):
    body, places = parsed(body_of, [f"{files}/red.png", data_url(png(BLUE))], Images(allow_urls=True))
    [message] = [m for m in body.messages if m["role"] == "user"]
    assert_parts(message, places, RED, BLUE)


@pytest.mark.parametrize("name, words", [("big.png", f"more than {BOUND // 2**20} MB"),
                                         ("unsized.png", f"more than {BOUND // 2**20} MB"),
                                         ("missing.png", "answered 404"),
                                         ("to-file", "file:"), ("to-ftp", "ftp:")])
def test_with_the_flag_a_url_past_the_bound_or_failing_is_a_400(files, monkeypatch, name, words):
    monkeypatch.setattr(bodies, "MAX_BYTES", BOUND)
    with pytest.raises(ApiError, match=words) as e:
        parsed(openai_chat, [f"{files}/{name}"], Images(allow_urls=True))
    assert (e.value.status, e.value.param) == (400, "messages[0].content[1]") and "\n" not in str(e.value)


def test_the_server_fetches_only_with_the_flag(server, fetching, files):
    Files.asked.clear()
    path, body, _ = openai_chat([f"{files}/red.png"])
    assert "--allow-image-urls" in refusal(path, *server.post(path, body)[::2])
    assert Files.asked == []
    message = refusal(path, *fetching.post(path, body)[::2])
    assert message.startswith("tiny reads no images") and Files.asked == ["/red.png"]


def test_nibble_serve_passes_allow_image_urls_on(tiny_dir, monkeypatch):
    from nibble.runner.serve import server as server_module
    from tests.test_cli import invoke
    given = []

    def run_server(models, sock, **kwargs):
        given.append(kwargs["allow_image_urls"])
        sock.close()
        models.close()
    monkeypatch.setattr(server_module, "serve", run_server)
    for flags, expected in (([], False), (["--allow-image-urls"], True)):
        result = invoke("serve", "-m", tiny_dir, "--port", 0, *flags)
        assert result.exit_code == 0, result.output
        assert given.pop() is expected


# ---- fuzz: chat's content parts, images among them: a reply or a 4xx in OpenAI's shape ----

IMAGE_URLS = [data_url(png(RED)), data_url(cut_short()), data_url(b"GIF89a"), "data:image/png;base64,@@",
              "data:text/html,<b>", "data:image/png,%89PNG", "http://127.0.0.1:9/x.png", "file:///etc/passwd",
              "ftp://x/y.png", "", "data:", "data:image/png;base64,"]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2, 9), st.text(max_size=6),
                    st.sampled_from(["text", "image_url", "input_audio", "file", "url", "detail", "auto", "\ud800",
                                     *IMAGE_URLS]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["type", "text", "image_url", "url", "detail", "input_audio"]) | st.text(max_size=4),
    inner, max_size=3), max_leaves=8)
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.one_of(
        st.sampled_from(IMAGE_URLS), st.fixed_dictionaries({"url": st.sampled_from(IMAGE_URLS) | JSON},
                                                           optional={"detail": JSON}), JSON)}),
    st.dictionaries(st.sampled_from(["type", "text", "image_url"]), JSON, max_size=3), JSON)


@pytest.mark.fuzz
@given(content=st.one_of(st.lists(PART, max_size=4), JSON), role=st.sampled_from(["user", "system", "assistant"]))
@example(content=[{"type": "image_url", "image_url": {"url": data_url(bomb())}}], role="user")
@example(content=[{"type": "text", "text": "Hi"}], role="user")
def test_fuzz_chat_content_parts_are_answered_or_a_4xx(server, content, role):
    status, _, raw = server.post("/v1/chat/completions", json.dumps(
        {"model": "tiny", "max_tokens": 2, "messages": [{"role": role, "content": content}]}).encode())
    if status == 200:
        assert json.loads(raw)["object"] == "chat.completion"
        event("200")
        return
    assert 400 <= status < 500, (status, raw)
    error = json.loads(raw)["error"]
    assert isinstance(error["message"], str) and "\n" not in error["message"], error
    event(f"{status} {error['param']}")



# ---- a model that reads images: every client's image reaches it ----

GEMMA3 = Path(__file__).parent / "data" / "vision" / "gemma3"


@pytest.fixture(scope="module")
def seeing(vision_dir):
    with serving(vision_dir, "gemma") as running:
        yield running


def test_each_client_asks_a_vision_model_about_an_image(seeing):
    """The image reaches the model (its tokens in the prompt), and a second question about it
    reuses its keys and values: the tower does not run again."""
    port, image = seeing.port, (GEMMA3 / "image.png").read_bytes()
    url = data_url(image)
    chat = lambda question: seeing.client.chat.completions.create(
        model="gemma", max_tokens=2, temperature=0, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]}])
    first, second = chat("What is it?"), chat("What is it? Say it again.")
    assert first.choices[0].message.content is not None and first.usage.prompt_tokens > 4
    assert second.usage.prompt_tokens_details.cached_tokens > 4   # past the image's 4 tokens
    claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=KEY, max_retries=0)
    said = claude.messages.create(model="gemma", max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "image", "source": anthropic_source(url)}, {"type": "text", "text": "What is it?"}]}])
    assert said.usage.input_tokens > 4 and said.stop_reason == "max_tokens"
    counted = claude.messages.count_tokens(model="gemma", messages=[{"role": "user", "content": [
        {"type": "image", "source": anthropic_source(url)}, {"type": "text", "text": "What is it?"}]}])
    assert counted.input_tokens == said.usage.input_tokens + said.usage.cache_read_input_tokens
    local = ollama.Client(host=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {KEY}"})
    reply = local.chat(model="gemma", options={"num_predict": 2, "temperature": 0},
                       messages=[{"role": "user", "content": "What is it?", "images": [image]}])
    assert reply.prompt_eval_count is not None and reply.done_reason == "length"
    answer = seeing.client.responses.create(model="gemma", max_output_tokens=2, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": url, "detail": "auto"}, {"type": "input_text", "text": "What is it?"}]}])
    assert answer.usage.input_tokens > 4


def test_a_prompt_whose_markers_and_images_disagree_is_a_400(seeing):
    """A message's text holding the model's image marker: one marker too many for the images."""
    status, _, raw = seeing.post("/v1/chat/completions", {"model": "gemma", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "<start_of_image> here"},
                                     {"type": "image_url", "image_url": {"url": data_url(png(RED))}}]}]})
    assert "image markers" in refusal("/v1/chat/completions", status, raw)
