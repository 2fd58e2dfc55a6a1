"""Presets (formats/presets.py): a Presetfile read and written back, refused by line number where
nibble cannot take it, fuzzed; `nibble create`, `show`, `ls`, `rm`; a preset run by `nibble run`
and by the server as its model runs with the same settings given by hand."""
import json
from pathlib import Path

import shutil

import pytest
from hypothesis import event, example, given, settings, strategies as st

from nibble.formats import hub, presets
from nibble.formats.errors import FormatError
from nibble.runner.loader import load
from tests.serving import KEY, bodies, serving
from tests.test_cli import assert_one_line_error, invoke
from tests.test_hub import isolated  # noqa: F401 (a fixture)

FILE = '''# a model that answers in French
from MODEL
SYSTEM You answer in French.
PARAMETER temperature 0
parameter top_k 20
PARAMETER seed 7
TEMPLATE """{% for m in messages %}<{{ m.role }}>{{ m.content }}
{% endfor %}<assistant>"""
MESSAGE user Bonjour
MESSAGE assistant """Salut !
Comment ça va ?"""
LICENSE "MIT"
ADAPTER /a/lora
ADAPTER /b/lora.gguf:0.5
'''


def test_a_presetfile_reads_and_writes_back():
    p = presets.parse(FILE)
    assert p.source == "MODEL" and p.system == "You answer in French." and p.license == "MIT"
    assert p.parameters == {"temperature": 0.0, "top_k": 20, "seed": 7}
    assert p.template.startswith("{% for m in messages %}") and p.template.endswith("<assistant>")
    assert p.messages == [{"role": "user", "content": "Bonjour"}, {"role": "assistant", "content": "Salut !\nComment ça va ?"}]
    assert p.conversation()[0] == {"role": "system", "content": "You answer in French."}
    assert p.adapters == ["/a/lora", "/b/lora.gguf:0.5"]
    assert presets.parse(presets.dump(p)) == p
    assert presets.parse("FROM m\nADAPTER lora\n", folder=Path("/here")).adapters == ["/here/lora"]


@pytest.mark.parametrize("text, message", [
    ("FROM a\nSTOP x\n", "line 2: unknown instruction STOP"),
    ("FROM a\nPARAMETER stop x\n", "line 2: unknown parameter 'stop'"),
    ("FROM a\nPARAMETER top_k 2.5\n", "line 2: top_k must be a whole number"),
    ("FROM a\nMESSAGE tool hi\n", "line 2: MESSAGE's role must be one of system, user, assistant"),
    ("FROM a\nSYSTEM \"\"\"never\nclosed\n", "line 2: its \"\"\" is never closed"),
    ("FROM a\n\nFROM b\n", "line 3: a second FROM (the first is line 1)"),
    ("SYSTEM hi\n", "no FROM line"),
    ("FROM a\nTEMPLATE {{ .System }} {{ .Prompt }}\n", "line 2: TEMPLATE is a Go template"),
    ("FROM a\nADAPTER\n", "line 2: ADAPTER names no adapter"),
    ("FROM a\n!!\n", "line 2: expected an instruction"),
])
def test_what_nibble_cannot_take_is_refused_by_its_line(text, message):
    with pytest.raises(FormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        presets.parse(text)


LINES = st.lists(st.sampled_from(["FROM m", "SYSTEM s", 'SYSTEM """a', 'b"""', "PARAMETER temperature 0.5",
                                  "PARAMETER top_k x", "MESSAGE user hi", "MESSAGE bot hi", "# note", "",
                                  'TEMPLATE "{{ messages }}"', "LICENSE x", "FROM n", "  from   m  "])
                 | st.text(max_size=12), max_size=8)


@given(lines=LINES)
def test_fuzz_a_presetfile_is_read_or_refused_in_one_line(lines):
    try:
        p = presets.parse("\n".join(lines))
    except FormatError as e:
        assert "\n" not in str(e).split(": ", 1)[0]
        event("refused")
        return
    assert presets.parse(presets.dump(p)) == p
    event("read")


def test_create_show_ls_rm(tiny_dir, isolated, tmp_path):  # noqa: F811
    r = invoke("create", "fr", "--from", tiny_dir, "--system", "Réponds en français.", "--temp", "0.3", "--top-k", "5")
    assert r.exit_code == 0, r.output
    shown = invoke("show", "fr").stdout
    assert shown == (f"FROM {tiny_dir}\nSYSTEM Réponds en français.\nPARAMETER temperature 0.3\nPARAMETER top_k 5\n")
    (tmp_path / "Presetfile").write_text(shown.replace("0.3", "0") + "MESSAGE user Bonjour\n")
    assert invoke("create", "fr-2", "-f", tmp_path / "Presetfile", "--top-k", "9").exit_code == 0   # options win
    assert presets.read("fr-2").parameters == {"temperature": 0.0, "top_k": 9}
    listed = json.loads(invoke("ls", "--json").stdout)
    assert [(m["name"], m["from"]) for m in listed if m.get("preset")] == [("fr", str(tiny_dir)), ("fr-2", str(tiny_dir))]
    assert "fr-2" in invoke("ls").stdout
    assert hub.resolve("fr") == tiny_dir
    assert invoke("rm", "fr-2").stdout == "removed the preset fr-2\n" and presets.read("fr-2") is None
    assert_one_line_error(invoke("show", "fr-2"), 1, "no preset fr-2")
    assert_one_line_error(invoke("create", "x", "--from", tiny_dir, "--temp", "-1"), 1, "temperature must be 0")
    assert_one_line_error(invoke("create", "a b", "--from", tiny_dir), 1, "cannot name a preset")
    assert_one_line_error(invoke("create", "smollm2", "--from", tiny_dir), 1, "is the alias of a model")
    assert_one_line_error(invoke("create", "x"), 2, "give the model")
    (tmp_path / "bad").write_text("FROM x\nPARAMETER top_q 1\n")
    assert_one_line_error(invoke("create", "x", "-f", tmp_path / "bad"), 1, "line 2: unknown parameter 'top_q'")


def test_a_preset_made_from_a_preset_adds_to_it(tiny_dir, isolated):  # noqa: F811
    presets.save("base", presets.Preset(str(tiny_dir), "S", {"temperature": 0.5, "top_k": 3},
                                        messages=[{"role": "user", "content": "a"}]))
    presets.save("more", presets.Preset("base", None, {"top_k": 4}, messages=[{"role": "user", "content": "b"}]))
    p = presets.find("more")
    assert p.source == str(tiny_dir) and p.system == "S" and p.parameters == {"temperature": 0.5, "top_k": 4}
    assert [m["content"] for m in p.messages] == ["a", "b"]
    presets.save("base", presets.Preset("more"))
    with pytest.raises(FormatError, match="made from each other"):
        presets.find("more")


def test_a_preset_runs_as_its_model_given_its_settings_by_hand(tiny_dir, isolated):  # noqa: F811
    """Its system prompt and messages open the conversation (a request's own system prompt wins),
    its sampling settings are the model's defaults, its template renders the prompt."""
    presets.save("p", presets.parse(f'FROM {tiny_dir}\nSYSTEM Be brief.\nPARAMETER temperature 0\nPARAMETER top_k 3\n'
                                    'MESSAGE user Hi\nMESSAGE assistant Hello\n'))
    _, tokenizer = load("p")
    _, plain = load(str(tiny_dir))
    assert tokenizer.sampling.temperature == 0 and tokenizer.sampling.top_k == 3
    opening = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello"}]
    asked = [{"role": "user", "content": "Why?"}]
    assert tokenizer.chat(asked) == plain.chat(opening + asked)
    theirs = [{"role": "system", "content": "Be long."}] + asked
    assert tokenizer.chat(theirs) == plain.chat(theirs[:1] + opening[1:] + asked)
    presets.save("q", presets.parse(f"FROM {tiny_dir}\nSYSTEM Be brief.\nPARAMETER temperature 0\n"))
    by_preset = invoke("run", "-m", "q", "-n", "8", "Why?")
    by_hand = invoke("run", "-m", tiny_dir, "--temp", "0", "-n", "8", "--system", "Be brief.", "Why?")
    assert by_preset.exit_code == by_hand.exit_code == 0 and by_preset.stdout == by_hand.stdout != ""
    presets.save("t", presets.parse(f'FROM {tiny_dir}\nTEMPLATE """{{{{ messages[-1].content }}}}!"""\n'))
    _, templated = load("t")
    assert templated.chat(asked) == templated.encode("Why?!")


def test_a_presets_adapter_runs_beside_its_model(isolated, tmp_path):  # noqa: F811
    """ADAPTER (relative to the Presetfile, kept absolute): the preset runs as --lora runs, `nibble
    show` prints it back, and one that does not read is refused at create."""
    from tests.test_lora import LORA
    from tests.test_serve_lora import served_base
    from nibble.formats.model_dir import write_model_dir
    folder = write_model_dir(served_base(), tmp_path / "base")
    shutil.copytree(LORA / "llama3-r4", tmp_path / "adapter")
    (tmp_path / "Presetfile").write_text(f"FROM {folder}\nPARAMETER temperature 0\nADAPTER adapter:0.5\n")
    assert invoke("create", "tuned", "-f", tmp_path / "Presetfile").exit_code == 0
    assert invoke("show", "tuned").stdout == f"FROM {folder}\nPARAMETER temperature 0.0\nADAPTER {tmp_path}/adapter:0.5\n"
    by_preset = invoke("run", "-m", "tuned", "-n", "8", "--raw", "Thequick")
    by_flag = invoke("run", "-m", folder, "--temp", "0", "--lora", f"{tmp_path}/adapter:0.5", "-n", "8", "--raw", "Thequick")
    plain = invoke("run", "-m", folder, "--temp", "0", "-n", "8", "--raw", "Thequick")
    assert by_preset.exit_code == by_flag.exit_code == 0 and by_preset.stdout == by_flag.stdout != plain.stdout
    assert "temperature=0.0 adapter=adapter:0.5" in invoke("ls").stdout
    assert invoke("create", "tuned-2", "--from", "tuned", "--lora", LORA / "llama3-r8-rslora").exit_code == 0
    assert [Path(a).name for a in presets.find("tuned-2").adapters] == ["adapter:0.5", "llama3-r8-rslora"]
    (tmp_path / "Bad").write_text(f"FROM {folder}\nADAPTER nowhere\n")
    assert_one_line_error(invoke("create", "x", "-f", tmp_path / "Bad"), 1, "holds no adapter_config.json")


def test_the_server_answers_to_a_presets_name(tiny_dir, isolated):  # noqa: F811
    import threading
    import time
    from nibble.runner.serve.models import EngineOptions, Models, servable
    from nibble.runner.serve.server import Server, listen
    from tests.serving import Running
    presets.save("brief", presets.parse(f"FROM {tiny_dir}\nSYSTEM Be brief.\nPARAMETER temperature 0\n"))
    refs, default = servable(str(tiny_dir))
    assert refs["brief"] == "brief"
    models = Models(refs, default, EngineOptions(parallel=2, queue=4, ctx=256))
    models.add(default, *load(str(tiny_dir)))
    sock = listen("127.0.0.1", 0)
    server = Server(models, KEY)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        client = Running(sock.getsockname()[1], None).client
        assert "brief" in [m.id for m in client.models.list().data]
        ask = [{"role": "user", "content": "Why?"}]
        by_preset = client.chat.completions.create(model="brief", messages=ask, max_tokens=8)
        by_hand = client.chat.completions.create(model=default, max_tokens=8, temperature=0,
                                                 messages=[{"role": "system", "content": "Be brief."}] + ask)
        assert by_preset.choices[0].message.content == by_hand.choices[0].message.content
        assert by_preset.usage.prompt_tokens == by_hand.usage.prompt_tokens
    finally:
        server.should_exit = True
        thread.join()
        models.close()


def test_the_ollama_clients_create_and_show(tiny_dir, isolated):  # noqa: F811
    import ollama
    with serving(tiny_dir) as server:
        client = ollama.Client(host=f"http://127.0.0.1:{server.port}", headers={"Authorization": f"Bearer {KEY}"})
        assert client.create(model="terse", from_="tiny", system="Be brief.", parameters={"temperature": 0, "top_k": 3},
                             messages=[{"role": "user", "content": "Hi"}]).status == "success"
        assert presets.read("terse") == presets.Preset(str(tiny_dir), "Be brief.", {"temperature": 0.0, "top_k": 3},
                                                       messages=[{"role": "user", "content": "Hi"}])
        shown = client.show("terse")   # not loaded: from its files
        assert shown.modelfile.startswith(f"# Presetfile of terse\nFROM {tiny_dir}\nSYSTEM Be brief.\n")
        assert shown.parameters.splitlines()[1].split() == ["temperature", "0.0"]
        assert shown.parameters.splitlines()[2].split() == ["top_k", "3"]
        assert "terse" in [m.model for m in client.list().models]
        by_preset = client.chat(model="terse", messages=[{"role": "user", "content": "Why?"}], options={"num_predict": 6})
        by_hand = client.chat(model="tiny", options={"num_predict": 6, "temperature": 0},
                              messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                        {"role": "user", "content": "Why?"}])
        assert by_preset.message.content == by_hand.message.content
        # an older client's Modelfile, streamed progress
        status, _, raw = server.post("/api/create", {"name": "older", "modelfile": "FROM tiny\nPARAMETER top_k 2\n"})
        assert status == 200 and [json.loads(line)["status"] for line in raw.decode().splitlines()][-1] == "success"
        for body, message in [({"model": "x"}, "from is missing"), ({"model": "x", "from": "tiny", "adapters": {"a": "b"}},
                              "adapters: nibble takes no uploaded adapters"),
                              ({"model": "x", "from": "tiny", "parameters": {"top_q": 1}}, "unknown parameter 'top_q'"),
                              ({"model": "x y", "from": "tiny"}, "cannot name a preset"),
                              ({"model": "x", "modelfile": "FROM tiny\nFOO 1\n"}, "modelfile line 2: unknown instruction")]:
            status, _, raw = server.post("/api/create", body)
            assert status == 400 and message in json.loads(raw)["error"], (body, raw)


CREATE_KEYS = ["model", "name", "from", "system", "template", "parameters", "messages", "modelfile", "license",
               "adapters", "files", "quantize", "stream"]


@pytest.mark.fuzz
@settings(max_examples=60, deadline=None)
@given(body=bodies({"model": "p", "from": "tiny", "system": "s"}, CREATE_KEYS))
@example(body={"model": "p", "modelfile": 'FROM tiny\nSYSTEM """open'})
@example(body={"model": "p", "from": "tiny", "parameters": {"temperature": "hot"}})
@example(body={"model": "../../etc", "from": "tiny"})
def test_fuzz_create_keeps_a_preset_or_says_why_not(create_server, body):
    status, _, raw = create_server.post("/api/create", json.dumps(body).encode())
    if status == 200:
        name = body.get("model") or body.get("name")
        assert presets.read(name) is not None
    else:
        assert 400 <= status < 500, (status, raw)
        assert isinstance(json.loads(raw)["error"], str)
    event(str(status))


@pytest.fixture(scope="module")
def create_server(tmp_path_factory, tiny_dir):
    """The tiny model served alone, its presets in a folder of the module's."""
    import os
    home, before = tmp_path_factory.mktemp("home"), os.environ.get("NIBBLE_HOME")
    os.environ["NIBBLE_HOME"] = str(home)
    try:
        with serving(tiny_dir) as server:
            yield server
    finally:
        if before is None:
            os.environ.pop("NIBBLE_HOME")
        else:
            os.environ["NIBBLE_HOME"] = before
