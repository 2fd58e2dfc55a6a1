"""Fill-in-the-middle: a coder model's FIM tokens, found in its vocabulary by their names, and the
prompt llama.cpp's /infill makes of a file's text before and after the cursor and of other
files' chunks: the repo-level format of the Qwen2.5-Coder report (arXiv 2409.12186),

    [FIM_REP]myproject\\n [FIM_SEP]name\\n chunk ... [FIM_SEP]filename\\n
    [FIM_PRE]prefix prompt [FIM_SUF]suffix [FIM_MID]

cut as llama.cpp cuts it (server-common.cpp's format_prompt_infill): the prefix's last 3/4 of a
batch, the suffix's first quarter, the chunks' last tokens in what the context leaves. A model
without a file separator gets each chunk after a "--- snippet ---" line, as there.
"""
from __future__ import annotations

from dataclasses import dataclass

BATCH = 2048   # llama.cpp's n_batch, which splits the prefix and suffix 3:1
# the FIM tokens by name, each kind's in order: prefix, suffix, middle (Qwen2.5-Coder's and
# CodeGemma's, StarCoder's, CodeLlama's, DeepSeek-Coder's)
KINDS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
         ("▁<PRE>", "▁<SUF>", "▁<MID>"), ("<PRE>", "<SUF>", "<MID>"),
         ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))
REPOS = ("<|repo_name|>", "<repo_name>")
SEPARATORS = ("<|file_sep|>", "<|file_separator|>", "<file_sep>")
# where a completion ends beside the model's end of text: its pad, a file or repo name begun,
# CodeLlama's end of infill (llama.cpp ends generation at each)
ENDS = ("<|fim_pad|>", "<fim_pad>", "▁<EOT>", "<EOT>", *REPOS, *SEPARATORS)
SNIPPET = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    rep: int | None   # a repository's name follows
    sep: int | None   # a file's name and text follow
    ends: tuple[str, ...]   # the texts of the tokens that end a completion


def fim_tokens(vocab) -> FimTokens | None:
    """The FIM tokens of a tokenizers.Tokenizer `vocab`, or None for a model without them."""
    find = vocab.token_to_id
    for names in KINDS:
        ids = [find(name) for name in names]
        if None not in ids:
            first = lambda options: next((find(t) for t in options if find(t) is not None), None)
            return FimTokens(*ids, first(REPOS), first(SEPARATORS), tuple(t for t in ENDS if find(t) is not None))
    return None


def infill_ids(encode, fim: FimTokens, prefix: str, suffix: str, extra: list[tuple[str, str]], prompt: str,
               ctx: int, max_tokens: int | None, bos: int | None) -> list[int]:
    """The ids of an infill request: `encode(text)` a text's ids (no BOS); `extra` (file name,
    text) chunks of other files; `prompt` text after the prefix (what is typed); `ctx` the
    context, `max_tokens` the reply's bound (None: none), `bos` the BOS id the model wants first
    (None: none)."""
    chunks = [fim.rep, *encode("myproject\n")] if fim.rep is not None else []
    for name, text in extra:
        chunks += [fim.sep, *encode(name + "\n")] if fim.sep is not None else encode(SNIPPET)
        chunks += encode(text)
    if fim.sep is not None:
        chunks += [fim.sep, *encode("filename\n")]
    before, after, typed = encode(prefix), encode(suffix), encode(prompt)
    before = before[len(before) - min(len(before), 3 * (BATCH // 4)):]
    after = after[:min(len(after), max(0, BATCH // 4 - (2 + len(typed))))]
    take = min(max(0, ctx - BATCH - 2 * (max_tokens if max_tokens is not None else -1)), len(chunks))
    return (chunks[len(chunks) - take:] + ([bos] if bos is not None else []) + [fim.pre, *before, *typed]
            + [fim.suf, *after] + [fim.mid])
