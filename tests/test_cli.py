"""The command line, on the tiny model: output streams, stats, and one clean line for bad input."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from nibble.formats.errors import NibbleError
from nibble.quant.open_model import open_model
from nibble.tui.cli.main import main

GREEDY = ["--temp", "0", "-n", "12"]


def invoke(*args, input=None, env=None):
    return CliRunner().invoke(main, list(map(str, args)), input=input, env=env)


def assert_one_line_error(result, code=1, match=""):
    assert result.exit_code == code, result.output
    assert result.stdout == "" and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and match in lines[0], result.stderr


def test_run_streams_reply_and_stats(tiny_dir):
    r = invoke("run", "-m", tiny_dir, *GREEDY, "Hello there")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip()
    stats = r.stderr.strip().splitlines()[-1]
    assert stats.startswith("prompt ") and "tok/s" in stats and "first token" in stats


def test_prompt_from_argument_option_and_stdin_agree(tiny_dir):
    a = invoke("run", "-m", tiny_dir, *GREEDY, "Hello there").stdout
    b = invoke("run", "-m", tiny_dir, *GREEDY, "-p", "Hello there").stdout
    c = invoke("run", "-m", tiny_dir, *GREEDY, input="Hello there").stdout
    assert a == b == c != ""


def test_seeded_runs_reproduce(tiny_dir):
    runs = [invoke("run", "-m", tiny_dir, "--seed", 7, "-n", 20, "--top-k", 0, "Hello").stdout for _ in range(2)]
    assert runs[0] == runs[1] != ""


def test_json_output(tiny_dir):
    r = invoke("run", "-m", tiny_dir, *GREEDY, "--json", "Hello")
    out = json.loads(r.stdout)
    assert out["finish_reason"] in ("stop", "length") and out["prompt_tokens"] > 0
    assert out["text"] == invoke("run", "-m", tiny_dir, *GREEDY, "Hello").stdout.rstrip("\n")


def test_run_prints_the_thinking_dimmed_on_stderr_and_the_answer_on_stdout(r1_dir):
    think = ["run", "-m", r1_dir, "--temp", 0, "-n", 16, "--reasoning-budget", 4, "Why is the sky blue?"]
    whole = json.loads(invoke(*think, "--json").stdout)
    assert whole["thinking"].strip() and whole["text"] and whole["finish_reason"] == "length"
    shown = invoke(*think)
    assert shown.stdout.rstrip("\n") == whole["text"] and whole["thinking"] in shown.stderr
    hidden = invoke(*think, "--hide-thinking")
    assert hidden.stdout == shown.stdout and whole["thinking"] not in hidden.stderr
    off = json.loads(invoke(*think[:-1], "--no-think", "--json", think[-1]).stdout)
    assert "thinking" not in off and off["text"]


def test_run_answers_without_thinking_unless_asked(r1_dir):
    """`run` is a question answered at once: a model that thinks does not, but with --think (or a
    reasoning budget)."""
    ask = ["run", "-m", r1_dir, "--temp", 0, "-n", 16, "--json", "Why is the sky blue?"]
    plain = json.loads(invoke(*ask).stdout)
    assert "thinking" not in plain and plain["text"]
    assert plain["text"] == json.loads(invoke(*ask[:-1], "--no-think", ask[-1]).stdout)["text"]
    thinks = json.loads(invoke(*ask[:-1], "--think", ask[-1]).stdout)
    assert thinks["thinking"].strip()


def test_raw_prompt_skips_the_template(tiny_dir):
    raw = json.loads(invoke("run", "-m", tiny_dir, *GREEDY, "--json", "--raw", "Hello").stdout)
    chat = json.loads(invoke("run", "-m", tiny_dir, *GREEDY, "--json", "Hello").stdout)
    assert raw["prompt_tokens"] < chat["prompt_tokens"]


def test_stop_string_cuts_the_reply(tiny_dir):
    full = invoke("run", "-m", tiny_dir, "--temp", 0, "-n", 40, "--raw", "The quick").stdout.rstrip("\n")
    stop = full[len(full) // 2:][:3]
    cut = invoke("run", "-m", tiny_dir, "--temp", 0, "-n", 40, "--raw", "--stop", stop, "The quick").stdout
    assert cut.rstrip("\n") == full[:full.index(stop)]


def test_empty_prompt(tiny_dir):
    assert_one_line_error(invoke("run", "-m", tiny_dir, "   "), match="prompt is empty")
    assert_one_line_error(invoke("run", "-m", tiny_dir, input=""), match="prompt is empty")


def test_no_prompt_and_a_terminal_on_stdin(tiny_dir, monkeypatch):
    monkeypatch.setattr("nibble.tui.cli.main._stdin_is_terminal", lambda: True)
    r = invoke("run", "-m", tiny_dir)
    assert r.exit_code == 2 and "no prompt" in r.stderr


def test_prompt_longer_than_context_names_both_numbers(tiny_dir):
    assert_one_line_error(invoke("run", "-m", tiny_dir, "-c", 8, "Hello there, how are you today?"),
                          match="and the context holds 8")


def capture_sampling(monkeypatch) -> dict:
    """What `nibble run` samples with and how many tokens it asks for, without generating."""
    from nibble.runner.generation import generate, sample
    seen = {}
    monkeypatch.setattr(sample, "make_sampler", lambda settings, *_: seen.setdefault("sampling", settings))
    monkeypatch.setattr(generate, "stream_generate",
                        lambda *args, max_tokens, **kwargs: seen.update(max_tokens=max_tokens) or iter(()))
    return seen


def test_the_flags_defaults_are_the_model_s_else_the_library_s(tiny_dir, monkeypatch):
    from nibble.runner.settings import MAX_TOKENS, SamplerSettings
    seen = capture_sampling(monkeypatch)
    r = invoke("run", "-m", tiny_dir, "Hi")   # its generation_config.json sets no sampling
    assert r.exit_code == 0, r.output
    assert seen == {"sampling": SamplerSettings(), "max_tokens": MAX_TOKENS}
    shown, d = " ".join(invoke("run", "--help").stdout.split()), SamplerSettings()
    for flag, value in [("--temp FLOAT", d.temperature), ("--top-k INTEGER", d.top_k), ("--top-p FLOAT", d.top_p),
                        ("--min-p FLOAT", d.min_p), ("--repeat-penalty FLOAT", d.repetition_penalty)]:
        assert re.search(rf"{flag} [^[]*\[default: the model's generation_config.json, else {value}]", shown), flag
    assert re.search(rf"--max-tokens INTEGER RANGE [^[]*\[default: {MAX_TOKENS}[];]", shown)
    assert f"Penalise the last {d.repeat_last_n} tokens" in shown


def test_run_samples_as_the_model_says_unless_a_flag_says_otherwise(sampled_dir, monkeypatch):
    from nibble.runner.settings import SamplerSettings
    seen = capture_sampling(monkeypatch)
    assert invoke("run", "-m", sampled_dir, "Hi").exit_code == 0
    assert seen["sampling"] == SamplerSettings(temperature=0.3, top_k=5, top_p=0.7)   # tiny.SAMPLING
    seen.clear()
    r = invoke("run", "-m", sampled_dir, "--temp", 0.9, "--min-p", 0.2, "--seed", 3, "Hi")
    assert r.exit_code == 0, r.output
    assert seen["sampling"] == SamplerSettings(temperature=0.9, top_k=5, top_p=0.7, min_p=0.2, seed=3)


def test_the_dry_flags_reach_the_sampler(tiny_dir, monkeypatch):
    from nibble.runner.settings import SamplerSettings
    seen = capture_sampling(monkeypatch)
    r = invoke("run", "-m", tiny_dir, "--dry-multiplier", 0.8, "--dry-base", 2, "--dry-allowed-length", 3,
               "--dry-penalty-last-n", 100, "Hi")
    assert r.exit_code == 0, r.output
    assert seen["sampling"] == SamplerSettings(dry_multiplier=0.8, dry_base=2.0, dry_allowed_length=3,
                                               dry_penalty_last_n=100)


def test_a_run_with_dry(tiny_dir):
    r = invoke("run", "-m", tiny_dir, "-n", 24, "--seed", 1, "--dry-multiplier", 0.8, "Hello")
    assert r.exit_code == 0 and r.stdout.strip(), r.output
    assert_one_line_error(invoke("run", "-m", tiny_dir, "--dry-base", 0.5, "Hi"), match="dry_base must be 1 or more")


def with_generation_config(model_dir, out, **fields):
    """A copy of `model_dir` whose generation_config.json also sets `fields`."""
    import shutil
    d = shutil.copytree(model_dir, out)
    path = d / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return d


def test_a_model_that_says_greedy_answers_greedily(tiny_dir, tmp_path):
    d = with_generation_config(tiny_dir, tmp_path / "greedy", do_sample=False, temperature=0.9)
    runs = {invoke("run", "-m", d, "-n", 16, "Hello").stdout for _ in range(2)}
    assert runs == {invoke("run", "-m", tiny_dir, "-n", 16, "--temp", 0, "Hello").stdout}


def test_a_value_the_model_sets_wrong_is_ignored_with_a_note(tiny_dir, tmp_path, monkeypatch):
    from nibble.runner.settings import SamplerSettings
    d = with_generation_config(tiny_dir, tmp_path / "odd", temperature=0.5, top_p=2)
    seen = capture_sampling(monkeypatch)
    r = invoke("run", "-m", d, "Hi")
    assert r.exit_code == 0, r.output
    assert seen["sampling"] == SamplerSettings(temperature=0.5)
    assert ("ignored in the model's generation_config.json (nibble's defaults apply): "
            "top_p must be in (0, 1] (1 is off), got 2") in r.stderr.splitlines()
def test_bad_sampler_setting(tiny_dir):
    assert_one_line_error(invoke("run", "-m", tiny_dir, "--top-p", 2, "Hi"), match="top_p")


def test_bad_model_references(tmp_path):
    assert_one_line_error(invoke("run", "-m", tmp_path / "nowhere", "Hi"), match="no model at")
    (tmp_path / "broken.safetensors").write_bytes(b"\x05\x00")
    assert_one_line_error(invoke("run", "-m", tmp_path / "broken.safetensors", "Hi"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text('{"model_type": "gpt2"}')
    assert_one_line_error(invoke("run", "-m", tmp_path / "d", "Hi"), match="unsupported architecture 'gpt2'")


def test_truncated_weights_file(tiny_dir, tmp_path):
    import shutil
    d = shutil.copytree(tiny_dir, tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_one_line_error(invoke("run", "-m", d, "Hi"), match="model.safetensors")


def test_hub_offline_names_the_variable(tmp_path):
    r = invoke("run", "-m", "nibble-test/no-such-model", "Hi",
               env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)})
    assert_one_line_error(r, match="HF_HUB_OFFLINE")


def test_import_writes_a_model_dir(tmp_path):
    import numpy as np
    from gguf import GGUFWriter
    gguf = tmp_path / "x.gguf"
    w = GGUFWriter(str(gguf), "gpt2")   # an architecture nibble does not run
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert_one_line_error(invoke("import", gguf, "-o", tmp_path / "out"), match="gpt2")
    assert not (tmp_path / "out").exists()


def interruptible():
    """Popen's preexec_fn for a child that a test sends Ctrl-C: SIGINT back to its default, which
    Python makes KeyboardInterrupt. A pytest started in the background by a shell without job
    control ignores SIGINT, its children inherit that, and Python then leaves it ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_keeps_the_text_and_prints_stats(smollm2_dir, tmp_path):
    """A real SIGINT while the real model writes a reply that cannot end before it: a schema of
    a thousand numbers at least holds the reply open past -n, whatever the model would say."""
    schema = tmp_path / "long.json"
    schema.write_text(json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 1000}))
    proc = subprocess.Popen([sys.executable, "-m", "nibble.tui.cli.main", "run", "-m", str(smollm2_dir), "-n", "2000",
                             "--json-schema", str(schema), "List numbers."],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=interruptible)
    first = proc.stdout.read(20)   # the reply has started
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert len(first + out) > 20 and "Traceback" not in err.decode()
    assert err.decode().strip().splitlines()[-1].endswith("| interrupted")


def test_ctrl_c_while_loading_is_one_line(tiny_dir, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr("nibble.runner.loader.load", interrupted)
    r = invoke("run", "-m", tiny_dir, "Hi")
    assert r.exit_code == 130 and "Traceback" not in r.stderr and r.stderr.strip() == "interrupted"


def test_int8_kv_cache_flag(tiny_dir):
    r = invoke("run", "-m", tiny_dir, *GREEDY, "--kv-cache", "int8", "Hello there")
    assert r.exit_code == 0 and r.stdout.strip()
    r = invoke("run", "-m", tiny_dir, "--kv-cache", "fp8", "Hello")
    assert r.exit_code == 2 and "'fp8' is not one of 'f32', 'int8'" in r.stderr


def test_quantize_at_load_once(tiny_dir, tmp_path, monkeypatch):
    """--quant quantizes a float model once, into nibble's cache; later runs load that copy."""
    from nibble.formats import catalog
    from nibble.runner.convert import quantize
    monkeypatch.setenv("NIBBLE_HOME", str(tmp_path))
    writes = []
    write = quantize._write_quantized
    monkeypatch.setattr(quantize, "_write_quantized", lambda *a, **k: writes.append(a[1]) or write(*a, **k))
    for _ in range(2):   # int4 only: int8 would compile every kernel of its kind for this test alone
        r = invoke("run", "-m", tiny_dir, *GREEDY, "--quant", "int4", "--json", "Hello")
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["prompt_tokens"] > 0
    [out] = writes
    assert out.name == f"llama-{catalog.identity(tiny_dir)}-int4" and out.parent == tmp_path / "quantized"
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert (q["bits"], q["group_size"]) == (4, 64)


def test_a_float_model_past_the_threshold_runs_int4_unless_float(tiny_dir, tmp_path, monkeypatch, capsys):
    from nibble.formats import progress
    from nibble.runner import loader
    monkeypatch.setenv("NIBBLE_HOME", str(tmp_path))
    monkeypatch.setattr(loader, "AUTO_QUANT_PARAMS", 1000)   # the tiny model has more
    monkeypatch.setattr(progress, "PLAIN_EVERY", 0.0)
    model_dir = open_model(str(tiny_dir))
    quantized = loader.as_quantized(str(tiny_dir), model_dir, None)
    assert (quantized.config.quantization["bits"], quantized.config.quantization["group_size"]) == (4, 64)
    err = capsys.readouterr().err.splitlines()
    assert any(re.fullmatch(f"quantizing {re.escape(str(tiny_dir))} to int4 for this and later runs, once: "
                            r"\d+ s so far, layer 1 of \d+", line) for line in err)
    assert err[-1].startswith(f"nibble: quantized {tiny_dir} to int4 in ") and err[-1].endswith("--float runs it as stored")
    assert loader.as_quantized(str(tiny_dir), model_dir, "float") is model_dir
    monkeypatch.setattr(loader, "AUTO_QUANT_PARAMS", 10 ** 9)
    assert loader.as_quantized(str(tiny_dir), model_dir, None) is model_dir
    with pytest.raises(NibbleError, match="already quantized: drop --quant"):
        loader.as_quantized("q", quantized, "int8")
    assert loader.as_quantized("q", quantized, "float") is quantized


def test_a_changed_checkpoint_is_quantized_again(tiny_dir, tmp_path, monkeypatch):
    import shutil

    from nibble.runner import loader
    monkeypatch.setenv("NIBBLE_HOME", str(tmp_path / "home"))
    copy = shutil.copytree(tiny_dir, tmp_path / "llama")
    first = loader.as_quantized(str(copy), open_model(str(copy)), "int4")
    os.utime(copy / "model.safetensors", ns=(0, 0))
    second = loader.as_quantized(str(copy), open_model(str(copy)), "int4")
    assert first.path != second.path and first.path.parent == second.path.parent


@pytest.mark.parametrize("args", [["run", "-n", -5, "Hi"], ["run", "-c", 0, "Hi"], ["run", "-t", 0, "Hi"],
                                  ["chat", "-n", 0], ["chat", "-c", -1], ["perplexity", "-t", 0, "x"],
                                  ["bench", "-t", 0], ["bench", "-p", "many"], ["run", "--bogus"],
                                  ["nosuch"], ["--bogus"], ["run", "-m"], ["run", "--temp"]])
def test_usage_errors_are_one_line_and_exit_2(args):
    assert_one_line_error(invoke(*args), code=2)


def test_a_line_break_in_a_quoted_value_stays_on_the_error_s_line(tmp_path):
    r = invoke("run", "-m", tmp_path / "two\nlines", "Hi")
    assert_one_line_error(r, match="two\\nlines")
    assert_one_line_error(invoke("run", "--a\u2028b"), code=2, match="--a\\u2028b")


def notes(stderr: str) -> list[str]:
    """stderr's lines but a first run's compile progress (the kernels this test is the first to run)."""
    return [line for line in stderr.splitlines() if not line.startswith(("compiling the kernels", "compiled the kernels"))]


def test_ctx_and_threads_above_what_can_be_used_are_lowered_in_one_line_each(tiny_dir):
    import numba
    cores = numba.config.NUMBA_NUM_THREADS
    r = invoke("run", "-m", tiny_dir, *GREEDY, "-c", 100000, "-t", 999, "--json", "Hello")
    assert r.exit_code == 0, r.output
    assert notes(r.stderr) == [f"-t 999 is more than the {cores} CPU threads here: using {cores}",
                               "-c 100000 is more than the model's context of 256 tokens: using 256"]
    assert json.loads(r.stdout)["text"] == json.loads(invoke("run", "-m", tiny_dir, *GREEDY, "--json", "Hello").stdout)["text"]
    r = invoke("run", "-m", tiny_dir, *GREEDY, "-c", 256, "-t", cores, "Hello")   # the limits themselves
    assert r.exit_code == 0 and notes(r.stderr)[:-1] == []   # the stats line alone


def test_perplexity_and_bench_follow_the_same_rule(tiny_dir, tmp_path):
    import numba
    cores = numba.config.NUMBA_NUM_THREADS
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 80)
    r = invoke("perplexity", text, "-m", tiny_dir, "--ctx", 100000, "--chunks", 1, "-t", 999, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["ctx"] == 256
    assert [line for line in r.stderr.splitlines() if " is more than " in line] == [
        f"-t 999 is more than the {cores} CPU threads here: using {cores}",
        "--ctx 100000 is more than the model's context of 256 tokens: using 256"]
    assert_one_line_error(invoke("bench", "-m", tiny_dir, "-p", 10**12, "-n", 2), match="do not fit")


def test_chat_lowers_threads_before_the_app_starts(tiny_dir, monkeypatch):
    import numba
    from nibble.tui.app import ChatApp
    cores = numba.config.NUMBA_NUM_THREADS
    seen = {}
    monkeypatch.setattr("nibble.tui.cli.main._in_terminal", lambda: True)
    monkeypatch.setattr(ChatApp, "run", lambda app: seen.update(threads=app.threads, ctx=app.ctx_size))
    r = invoke("chat", "-m", tiny_dir, "-t", 999)
    assert r.exit_code == 0, r.output
    assert r.stderr.strip() == f"-t 999 is more than the {cores} CPU threads here: using {cores}"
    assert seen == {"threads": cores, "ctx": 4096}   # each session then as long as its model allows


@pytest.mark.parametrize("flags,draft", [((), "default"), (("--draft", 3), 3), (("--no-draft",), 0),
                                         (("--draft", 5, "--no-draft"), 0)])
def test_draft_flags_reach_generation_and_the_chat_app(tiny_dir, monkeypatch, flags, draft):
    from nibble.runner.generation import generate
    from nibble.runner.settings import DEFAULT_DRAFT
    from nibble.tui.app import ChatApp
    draft = DEFAULT_DRAFT if draft == "default" else draft
    seen = {}
    monkeypatch.setattr(generate, "stream_generate", lambda *a, draft, **kw: seen.update(run=draft) or iter(()))
    monkeypatch.setattr("nibble.tui.cli.main._in_terminal", lambda: True)
    monkeypatch.setattr(ChatApp, "run", lambda app: seen.update(chat=app.draft))
    assert invoke("run", "-m", tiny_dir, *flags, "Hi").exit_code == 0
    assert invoke("chat", "-m", tiny_dir, *flags).exit_code == 0
    assert seen == {"run": draft, "chat": draft}
    assert_one_line_error(invoke("run", "-m", tiny_dir, "--draft", 16, "Hi"), code=2, match="--draft")


def test_invalid_utf8_is_read_as_replacement_characters_with_one_line(tiny_dir, tmp_path):
    """As llama.cpp's tokenizer and ollama's JSON do (silently): the prompt runs, and a note says so."""
    want = invoke("run", "-m", tiny_dir, *GREEDY, "--json", "caf\ufffd \ufffd\ufffd!")
    r = invoke("run", "-m", tiny_dir, *GREEDY, "--json", input=b"caf\xe9 \xff\xfe!")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) | {"prompt_tps": 0, "generation_tps": 0, "ttft": 0} == \
        json.loads(want.stdout) | {"prompt_tps": 0, "generation_tps": 0, "ttft": 0}
    assert notes(r.stderr) == ["the prompt on stdin is not valid UTF-8 (from byte 3): "
                               "its invalid bytes are read as U+FFFD"]
    # An argument's undecodable bytes, as Python hands them over (os.fsdecode: lone surrogates)
    r = invoke("run", "-m", tiny_dir, *GREEDY, "--json", os.fsdecode(b"caf\xe9 \xff\xfe!"))
    assert r.exit_code == 0 and json.loads(r.stdout)["text"] == json.loads(want.stdout)["text"]
    text = tmp_path / "latin1.txt"
    text.write_bytes("Le café est très bon. ".encode("latin-1") * 60)
    r = invoke("perplexity", text, "-m", tiny_dir, "--ctx", 64, "--chunks", 1)
    assert r.exit_code == 0 and f"{text} is not valid UTF-8 (from byte 6)" in r.stderr
