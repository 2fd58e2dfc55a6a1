"""Structured output: replies under a grammar parse and validate, the mask is exact, bad grammars
are one line, and `nibble run --json-schema / --json-object`."""
import dataclasses
import json

import numpy as np
import pytest
from click.testing import CliRunner

from nibble.tui.cli.main import main
from nibble.runner.text.grammar import Grammar, GrammarError
from nibble.runner.generation.sample import make_sampler
from nibble.runner.settings import SamplerSettings
from nibble.runner.text.tokenizer import Tokenizer
from tests.test_cli import notes
from tests.tiny import tiny_model_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
    "additionalProperties": False,
}
GREEDY = SamplerSettings(temperature=0)


def valid(value, schema) -> bool:
    """JSON Schema for the keywords SCHEMA uses, written plainly (the oracle)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        return (isinstance(value, dict) and set(schema["required"]) <= set(value) <= set(props)
                and all(valid(v, props[k]) for k, v in value.items()))
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema["maxItems"]
                and all(valid(v, schema["items"]) for v in value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema["maxLength"]
    if kind == "integer":
        return type(value) is int and schema["minimum"] <= value <= schema["maximum"]
    return type(value) is bool


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from nibble.runner import load
    return load(str(tiny_dir))


def reply(tiny, grammar, settings=GREEDY, max_tokens=200, prompt="Hi"):
    from nibble.runner import stream_generate
    model, tok = tiny
    rs = list(stream_generate(model, tok, tok.prompt(prompt), sampler=make_sampler(settings),
                              max_tokens=max_tokens, constraint=grammar.constraint(tok)))
    return "".join(r.text for r in rs), rs[-1].finish_reason


@pytest.mark.parametrize("settings", [GREEDY] + [SamplerSettings(temperature=1.0, top_k=0, seed=s) for s in range(3)],
                         ids=["greedy", "seed0", "seed1", "seed2"])
def test_replies_under_a_schema_parse_and_validate(tiny, settings):
    text, finish = reply(tiny, Grammar.json_schema(SCHEMA), settings)
    assert finish == "stop" and valid(json.loads(text), SCHEMA), text
    assert "\n" not in text and "  " not in text.replace(json.dumps(json.loads(text)), "")   # compact


def test_json_object_replies_are_objects(tiny):
    text, finish = reply(tiny, Grammar.json_object(), SamplerSettings(temperature=1.0, seed=0), max_tokens=240)
    assert finish == "stop" and isinstance(json.loads(text), dict)


def test_a_reply_cut_by_max_tokens_ends_length(tiny):
    text, finish = reply(tiny, Grammar.json_schema(SCHEMA), max_tokens=4)
    assert finish == "length" and text == '{"na'   # 4 tokens of the first key (the schema's order)
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_a_lark_grammar_ends_the_reply_when_complete(tiny):
    text, finish = reply(tiny, Grammar.lark('start: "yes" | "no" | "maybe so"'))
    assert (text in ("yes", "no", "maybe so"), finish) == (True, "stop")


def test_the_mask_allows_exactly_the_tokens_that_continue_the_grammar():
    md = tiny_model_dir()
    md.config = dataclasses.replace(md.config, vocab_size=400)   # the model's rows past the tokenizer's 320
    tok = Tokenizer(md)
    options = ["yes", "no", "maybe so", "maybe not"]
    constraint = Grammar.json_schema({"enum": options}).constraint(tok)
    vocab = [tok.tokenizer.decode([i]) for i in range(320)]   # special tokens decode to ""
    logits = np.random.default_rng(0).standard_normal(400).astype(np.float32)
    written = ""
    for token in tok.encode('"maybe so"'):
        masked = logits.copy()
        constraint.mask(masked)
        allowed = set(np.flatnonzero(np.isfinite(masked)))
        assert allowed == {i for i, text in enumerate(vocab)
                           if text and any(json.dumps(o).startswith(written + text) for o in options)}
        np.testing.assert_array_equal(masked[list(allowed)], logits[list(allowed)])
        assert not constraint.done
        constraint.advance(token)
        written += vocab[token]
    constraint.mask(masked := logits.copy())
    assert list(np.flatnonzero(np.isfinite(masked))) == sorted(tok.eos_ids) and constraint.done


@pytest.mark.parametrize("schema,message", [
    ({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, "Pointer '/nope' does not exist"),
    ({"type": "string", "pattern": "(?<=x)a"}, "look-around, including look-ahead and look-behind, is not supported"),
    ({"type": "objekt"}, "Invalid type: objekt"),
    ([{"type": "object"}], "a JSON schema must be an object, not list"),
])
def test_bad_schemas_are_one_line_naming_the_problem(schema, message):
    with pytest.raises(GrammarError) as e:
        Grammar.json_schema(schema)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_bad_lark_grammar_is_one_line():
    with pytest.raises(GrammarError, match='bad grammar: at 1\\(8\\): unknown name: "foo" 1 | start: foo'):
        Grammar.lark("start: foo")


def test_a_token_the_grammar_forbids_is_one_line():
    tok = Tokenizer(tiny_model_dir())
    constraint = Grammar.json_object().constraint(tok)
    with pytest.raises(GrammarError) as e:
        constraint.advance(tok.encode("x")[0])
    assert str(e.value).startswith("the grammar failed: ") and "token \"x\" doesn't satisfy the grammar" in str(e.value)
    assert "<grammar>" not in str(e.value)


def test_a_special_token_the_tokenizer_lacks_is_refused_at_the_constraint():
    grammar = Grammar.lark('start: "x" <|nope|>')
    with pytest.raises(GrammarError, match="bad grammar: .*nope"):
        grammar.constraint(Tokenizer(tiny_model_dir()))


# `nibble run`

def invoke(*args):
    return CliRunner().invoke(main, ["run", *map(str, args)])


def test_run_json_schema(tiny_dir, tmp_path):
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    r = invoke("-m", tiny_dir, "--temp", 0, "--json-schema", tmp_path / "schema.json", "Who?")
    assert r.exit_code == 0, r.output
    assert valid(json.loads(r.stdout), SCHEMA) and r.stderr.rstrip().endswith("| stop")


def test_run_json_object_combines_with_json(tiny_dir):
    r = invoke("-m", tiny_dir, "--seed", 0, "--json-object", "--json", "-n", 240, "Who?")
    out = json.loads(r.stdout)
    assert out["finish_reason"] == "stop" and isinstance(json.loads(out["text"]), dict)


def test_run_says_when_the_json_was_cut(tiny_dir):
    r = invoke("-m", tiny_dir, "--temp", 0, "--json-object", "-n", 3, "Who?")
    said = notes(r.stderr)
    assert r.exit_code == 0 and said[0].startswith("the reply ended (length) before its JSON was complete")
    assert said[-1].endswith("| length")


@pytest.mark.parametrize("content,message", [
    ('{"type": "objekt"}', "schema.json: bad JSON schema: Invalid type: objekt"),
    ("{'type': 'object'}", "schema.json is not JSON: Expecting property name enclosed in double quotes"),
])
def test_run_refuses_a_bad_schema_file_in_one_line_before_loading(tmp_path, content, message):
    (tmp_path / "schema.json").write_text(content)
    r = invoke("-m", tmp_path / "no-model", "--json-schema", tmp_path / "schema.json", "Who?")
    assert r.exit_code == 1 and r.stdout == "" and r.stderr.count("\n") == 1 and message in r.stderr


def test_run_takes_one_json_flag(tmp_path):
    (tmp_path / "schema.json").write_text("{}")
    r = invoke("--json-object", "--json-schema", tmp_path / "schema.json", "Who?")
    assert r.exit_code == 2 and "give --json-schema or --json-object, not both" in r.stderr


@pytest.mark.slow
def test_smollm2_replies_with_valid_json_for_a_schema(smollm2_dir):
    from nibble.runner import load
    model, tok = load(str(smollm2_dir))
    text, finish = reply((model, tok), Grammar.json_schema(SCHEMA), max_tokens=100,
                         prompt="Describe a user of a web site as JSON: name, age, role, tags, active.")
    assert finish == "stop" and valid(json.loads(text), SCHEMA), text
