"""`nibble rerank`: a query and documents in, the documents out best first with their scores
(runner/embedding/rerank.py). main.py adds it to the `nibble` group, which turns its errors into
one line."""
from __future__ import annotations

import json
import sys

import click


@click.command()
@click.argument("query")
@click.option("-m", "--model", required=True, envvar="NIBBLE_RERANK_MODEL",
              help="A reranker: a directory, hub id (org/name) or alias (BAAI/bge-reranker-base, "
                   "cross-encoder/ms-marco-MiniLM-L6-v2, Qwen/Qwen3-Reranker-0.6B).")
@click.option("-f", "--file", "path", type=click.Path(dir_okay=False, allow_dash=True),
              help="The documents, one a line ('-' or left out: stdin).")
@click.option("--top", "top_n", type=click.IntRange(min=1), help="Print the best N only.")
@click.option("--instruction", help="What the query is for (Qwen3-Reranker's instruction).")
@click.option("--quant", type=click.Choice(["int8", "int4"]),
              help="Quantize a float model, once (kept in nibble's cache) [default: int4 for a float model of "
                   "more than 1B weights].")
@click.option("--json", "as_json", is_flag=True, help="A JSON object a document: index, score, text.")
def rerank(query, model, path, top_n, instruction, quant, as_json):
    """Score each line of -f FILE (or stdin) as an answer to QUERY; print them best first, a score
    and a document a line."""
    from nibble.formats.cross_encoder import ranks
    from nibble.formats.hub import resolve
    from nibble.quant.open_model import open_model
    from nibble.runner.embedding.rerank import Reranker, not_a_reranker
    from nibble.runner.loader import as_quantized
    from nibble.runner.text.tokenizer import as_text
    if path in (None, "-") and (sys.stdin is None or sys.stdin.isatty()):
        raise click.UsageError("no documents: give them with -f FILE or on stdin, one a line")
    stream = getattr(sys.stdin, "buffer", sys.stdin) if path in (None, "-") else open(path, "rb")
    with stream:
        data, note = as_text(stream.read(), "the documents")
    if note:
        click.echo(note, err=True)
    documents = [line for line in data.splitlines() if line.strip()]
    if not documents:
        raise click.UsageError("no documents: the input has no line of text")
    source = resolve(model)
    if not ranks(source):   # said before the weights are read
        raise not_a_reranker(model)
    reranker = Reranker(as_quantized(model, open_model(model), quant), model, source)
    pairs = reranker.pairs(query, documents, instruction)
    if pairs.cut:
        click.echo(f"nibble: {pairs.cut} of {len(documents)} documents cut to {reranker.max_length} tokens with the "
                   "query, the model's length", err=True)
    scores = reranker.scores(reranker.logits(pairs.ids, pairs.types))
    for i in sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n]:
        if as_json:
            click.echo(json.dumps({"index": i, "score": float(scores[i]), "text": documents[i]}, ensure_ascii=False))
        else:
            click.echo(f"{scores[i]:.4f}  {documents[i]}")
