"""Structured output: a grammar masks the tokens it forbids at each step, so a reply always
parses (a JSON schema, any JSON object, a Lark grammar). On llguidance, chosen for its packaging
(one wheel, no torch), its real JSON grammar (any depth) and its messages.

    grammar = Grammar.json_schema(schema)        # checked here: a bad schema is one GrammarError line
    constraint = grammar.constraint(tokenizer)   # a fresh matcher for one reply
    constraint.mask(logits); token = sampler(logits, ids); constraint.advance(token)
    if constraint.done: ...                      # nothing may follow: the reply ends "stop"
"""
from __future__ import annotations

from dataclasses import dataclass

import llguidance
import llguidance.numpy
import numpy as np

from nibble.formats.errors import NibbleError

from .tokenizer import Tokenizer

# JSON as json.dumps writes it: ", " and ": ", no other whitespace. The default grammar allows any
# whitespace between tokens, and small models then loop on newlines.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(NibbleError):
    """A grammar (a JSON schema, a Lark grammar) llguidance cannot use: its message, in one line."""


@dataclass(frozen=True)
class Grammar:
    """A grammar in llguidance's form (a Lark grammar, or its JSON envelope), checked when made."""
    source: str

    @classmethod
    def json_schema(cls, schema: dict) -> Grammar:
        """JSON that validates against `schema` (a JSON Schema, as a dict), written compactly."""
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be an object, not {type(schema).__name__}")
        try:
            source = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT)
        except ValueError as e:   # not JSON-serializable
            raise GrammarError(f"bad JSON schema: {e}") from None
        return cls._checked(source, "JSON schema")

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's JSON mode)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def lark(cls, text: str) -> Grammar:
        """A Lark grammar in llguidance's dialect (`%json {schema}` rules, `<|special|>` tokens)."""
        return cls._checked(llguidance.LLMatcher.grammar_from_lark(text), "grammar")

    @classmethod
    def _checked(cls, source: str, what: str) -> Grammar:
        # Without a tokenizer: the rules are checked, special tokens only in constraint().
        bad, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source)
        if bad:
            raise GrammarError(f"bad {what}: {_one_line(messages[0])}")
        return cls(source)

    def constraint(self, tokenizer: Tokenizer) -> Constraint:
        """A fresh matcher of this grammar over `tokenizer`'s vocabulary, for one reply."""
        lltokenizer = tokenizer.grammar_tokenizer
        matcher = llguidance.LLMatcher(lltokenizer, self.source, log_level=0)
        if matcher.is_error():   # e.g. a special token the tokenizer lacks
            raise GrammarError(f"bad grammar: {_one_line(matcher.get_error())}")
        return Constraint(matcher, lltokenizer.vocab_size)


class Constraint:
    """One reply's matcher: which tokens may come next, and the tokens that came."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int):
        self.matcher = matcher
        self._bits = llguidance.numpy.allocate_token_bitmask(1, vocab)   # int32 [1, ceil(vocab / 32)]

    def mask(self, logits: np.ndarray) -> None:
        """Set the logits [vocab] of the tokens the grammar forbids next to -inf, in place."""
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self._bits)
        self._check()
        allowed = np.unpackbits(self._bits.view(np.uint8), count=logits.shape[0], bitorder="little")
        logits[~allowed.view(bool)] = -np.inf

    def advance(self, token: int) -> None:
        """The token sampled (from masked logits, so the grammar accepts it)."""
        self.matcher.consume_token(token)
        self._check()

    @property
    def done(self) -> bool:
        """Nothing may follow (the grammar is complete, or an end token was taken)."""
        return self.matcher.is_stopped()

    def _check(self):
        if self.matcher.is_error():   # a token the mask did not allow, or a limit of llguidance's
            # its first line; the rest dumps the parser's state and the whole grammar
            raise GrammarError(f"the grammar failed: {self.matcher.get_error().strip().splitlines()[0]}")


def _one_line(message: str) -> str:
    # llguidance's messages may quote the grammar over several lines, with a caret under the error.
    return " ".join(message.split())

