"""Fuzzing the command line: argument lists, and bytes on stdin, run in process (click's CliRunner)
on the tiny model.

Each case ends in exit 0 with output, or an error exit (2: usage, 1: nibble's own) whose last
line on stderr is its one "Error: " line, after nothing but nibble's one-line notes: never a
traceback, another exception or click's three-line usage error.
"""
import os
import tempfile
import traceback

import click
import pytest
from click.testing import CliRunner
from hypothesis import event, given, settings, strategies as st

from nibble.formats import hub
from nibble.tui.cli.main import main

pytestmark = pytest.mark.fuzz

# chat is in: CliRunner's stdin is no terminal, so it parses its options and stops before the app
# starts (it would need one). bench is out: each run sums 1 GiB to measure the memory bandwidth,
# --shapes builds 7B-sized models and --write-checkpoint writes one (seconds to minutes a case);
# its options are click's same types, and its rules are tested in test_cli.py.
COMMANDS = ["run", "chat", "perplexity", "import", "quantize", "export"]
# Out of the option names: -ngl/--require-gpu (the GPU here is numba's simulator, seconds a token)
# and --force (a case could replace a directory the others read).
LEFT_OUT = {"-ngl", "--gpu-layers", "--require-gpu", "--force"}
# The notes nibble may write before an error, each one line (test_cli.py checks their wording).
NOTES = (" is more than ", " is not valid UTF-8 ", "ignored in the model's generation_config.json", "no GPU")


def option_names(command: str) -> list[str]:
    params = main.commands[command].params + main.params
    names = {n for p in params if isinstance(p, click.Option) for n in p.opts + p.secondary_opts}
    return sorted(names - LEFT_OUT)


# Text as argv may hold it: any character but NUL (a process's arguments are C strings), and the
# lone surrogates of bytes that are not UTF-8.
TEXT = st.text(st.one_of(st.characters(blacklist_characters="\0"),
                         st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF)),
               max_size=12).filter(lambda s: s not in hub.ALIASES)   # an alias would be downloaded
NUMBERS = st.one_of(st.integers(-3, 300), st.integers(), st.sampled_from([10**30, -10**30, 2**63]),
                    st.floats()).map(str)   # floats: nan, inf, 1e-45, -0.0 among them
WORDS = st.sampled_from(["", " ", "--", "-", "int4", "int8", "f32", "4", "8", "32", "64", "0x10", "1e3",
                         "out", "logits.bin", "missing.txt", "a/b", "a/b@c", "x.gguf", "x.safetensors"])
VALUE = st.one_of(NUMBERS, WORDS, TEXT)


@st.composite
def argument_lists(draw, text_file: str, model_dir: str) -> list[str]:
    """A command (or none), maybe the start that makes it run, then option names and values in
    any order: repeated, missing, junk."""
    command = draw(st.sampled_from(["run"] * 4 + COMMANDS[1:] + [None]))   # mostly run: the one that generates
    if command is None:   # nibble's own options, or no command
        return draw(st.lists(st.one_of(st.sampled_from(["--help", "-h", "--version", "--"]), VALUE), max_size=4))
    start = draw(st.sampled_from({
        "run": [["-n", "2"], ["-n", "2", "Hello"], []],   # few tokens: a case that parses is quick
        "chat": [[]],
        "perplexity": [[text_file, "--ctx", "16", "--chunks", "1"], []],
        "import": [[text_file, "-o", "out"], []],
        "quantize": [[model_dir, "-o", "out", "--bits", "4"], []],
        "export": [[model_dir, "--to", "gguf", "-o", "out.gguf"], [model_dir, "--to", "compressed-tensors", "-o", "ct"], []],
    }[command]))
    names = st.sampled_from(option_names(command))
    junk = TEXT.map(lambda s: "-" + s) | TEXT.map(lambda s: "--" + s)
    rest = draw(st.lists(st.one_of(names, names, VALUE, junk), max_size=8))
    return [command, *start, *rest]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    return str(path)


def invoke(tmp_path, args, input=None, model=None):
    """Run in a fresh empty folder (relative outputs land there), offline, the tiny model the
    default, nibble's home empty."""
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(dir=tmp_path) as folder:
        os.chdir(folder)
        try:
            env = {"NIBBLE_MODEL": model, "NIBBLE_HOME": "home", "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": "hf"}
            return CliRunner().invoke(main, args, input=input, env=env)
        finally:
            os.chdir(cwd)


def outcome(result) -> str:
    """The class of a case's end, having checked that it is a clean one."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        pytest.fail("".join(traceback.format_exception(*result.exc_info)))
    assert "Traceback" not in result.stderr
    if result.exit_code == 0:
        assert result.stdout or result.stderr   # the reply, the help, the version, or what was written
        return "exit 0"
    assert result.exit_code in (1, 2), result.exit_code
    *notes, last = result.stderr.splitlines() or [""]
    assert last.startswith("Error: ") and len(last) > len("Error: "), result.stderr
    assert all(any(n in line for n in NOTES) for line in notes), result.stderr
    return "usage error" if result.exit_code == 2 else "NibbleError"


@settings(max_examples=settings().max_examples // 10)   # a case loads the model: 0.05-0.5 s each
@given(data=st.data())
def test_argument_lists(tiny_dir, text_file, tmp_path, data):
    args = data.draw(argument_lists(text_file, str(tiny_dir)), "args")
    end = outcome(invoke(tmp_path, args, model=str(tiny_dir)))
    event(f"outcome: {args[0] if args and args[0] in COMMANDS else 'no command'}: {end}")


STDIN = st.one_of(
    st.binary(max_size=200),                                              # any bytes: mostly invalid UTF-8
    st.text(max_size=200).map(str.encode),                                # valid UTF-8, any characters
    st.sampled_from([b"", b"\n", b" \t\n", b"\0" * 50, b"\xff" * 50, b"\xc3", "😀".encode()[:3]]),
    st.integers(1, 200_000).map(lambda n: b"x" * n),                      # one long line: past the context
    st.lists(st.sampled_from([b"Hello", b"\0", b"\r\n", b"\xe9", b"<|im_end|>", b" "]), max_size=30).map(b"".join),
)


@settings(max_examples=settings().max_examples // 10)   # a case loads the model: 0.05-0.5 s each
@given(stdin=STDIN)
def test_stdin_bytes(tiny_dir, tmp_path, stdin):
    end = outcome(invoke(tmp_path, ["run", "-m", str(tiny_dir), "-n", "2"], input=stdin))
    event(f"outcome: {end}")
