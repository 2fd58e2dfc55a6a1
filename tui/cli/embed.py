"""`nibble embed`: texts in, a vector each out (runner/embedding/embed.py). main.py adds it to the `nibble`
group, which turns its errors into one line."""
from __future__ import annotations

import json
import sys

import click

from nibble.formats.hub import DEFAULT_EMBEDDING_MODEL


@click.command()
@click.argument("text", required=False)
@click.option("-m", "--model", default=DEFAULT_EMBEDDING_MODEL, show_default=True, envvar="NIBBLE_EMBEDDING_MODEL",
              help="An embedding model: a directory, hub id (org/name) or alias.")
@click.option("-f", "--file", "path", type=click.Path(dir_okay=False, allow_dash=True),
              help="Texts from this file, one a line ('-': stdin).")
@click.option("--quant", type=click.Choice(["int8", "int4"]),
              help="Quantize a float model, once (kept in nibble's cache) [default: int4 for a float model of "
                   "more than 1B weights].")
@click.option("--prompt", help="Put the model's prompt of this name before each text (e.g. query, document).")
@click.option("--dimensions", type=click.IntRange(min=1),
              help="Keep each vector's first N dimensions (for models trained so, Matryoshka's).")
@click.option("--npy", type=click.Path(dir_okay=False),
              help="Write the vectors to this .npy file (float32, a row a text) instead of JSON lines.")
def embed(text, model, path, quant, prompt, dimensions, npy):
    """Print the vector of TEXT, or of each line of -f FILE or of stdin, as a JSON list a line."""
    from nibble.runner.embedding.embed import Embedder
    from nibble.quant.open_model import open_model
    from nibble.runner.loader import as_quantized
    from nibble.runner.text.tokenizer import as_text
    if text is not None and path is not None:
        raise click.UsageError("give TEXT or -f FILE, not both")
    if text is None and path is None and (sys.stdin is None or sys.stdin.isatty()):
        raise click.UsageError("no text: give one as an argument, with -f FILE, or on stdin")
    if text is not None:
        data, note = as_text(text, "the text")
    else:
        stream = getattr(sys.stdin, "buffer", sys.stdin) if path in (None, "-") else open(path, "rb")
        with stream:
            data, note = as_text(stream.read(), "the texts")
    if note:
        click.echo(note, err=True)
    texts = [data] if text is not None else data.splitlines()
    if not texts:
        raise click.UsageError("no text: the input is empty")
    embedder = Embedder(as_quantized(model, open_model(model), quant), model)
    tokenized = embedder.tokenize(texts, prompt)
    if tokenized.cut:
        click.echo(f"nibble: {tokenized.cut} of {len(texts)} texts cut to {embedder.max_length} tokens, "
                   f"the model's length", err=True)
    vectors = embedder.embed_ids(tokenized.ids, tokenized.skip)
    if dimensions is not None:
        vectors = embedder.shorten(vectors, dimensions)
    if npy:
        import numpy as np
        with open(npy, "wb") as f:
            np.save(f, vectors)
        return
    for v in vectors:
        click.echo(json.dumps(v.tolist()))
