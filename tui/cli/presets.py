"""`nibble create` and `nibble show`: presets (formats/presets.py), a model under a name with its
system prompt, sampling settings, chat template, first messages and LoRA adapters. main.py adds them to the
`nibble` group, which turns their errors into one line; `nibble ls` lists presets and `nibble rm`
removes them (models.py)."""
from __future__ import annotations

from pathlib import Path

import click

from nibble.formats.errors import NibbleError


@click.command()
@click.argument("name")
@click.option("-f", "--file", "path", type=click.Path(dir_okay=False, allow_dash=True),
              help="A Presetfile (ollama's Modelfile: FROM, SYSTEM, PARAMETER, TEMPLATE, MESSAGE, ADAPTER; '-': stdin).")
@click.option("--from", "source", metavar="MODEL", help="The model (what -m takes), instead of a Presetfile's FROM.")
@click.option("--system", help="The system prompt its conversations start with.")
@click.option("--temp", "temperature", type=float, help="Sampling temperature (0: greedy).")
@click.option("--top-k", type=int, help="Top-k sampling (0: off).")
@click.option("--top-p", type=float, help="Top-p sampling (1: off).")
@click.option("--min-p", type=float, help="Min-p sampling (0: off).")
@click.option("--repeat-penalty", type=float, help="Repetition penalty (1: off).")
@click.option("--seed", type=int, help="The seed of its sampling.")
@click.option("--lora", "loras", multiple=True, metavar="PATH[:SCALE]",
              help="A LoRA adapter it runs beside the model's weights (after the Presetfile's ADAPTER lines); repeatable.")
def create(name, path, source, system, temperature, top_k, top_p, min_p, repeat_penalty, seed, loras):
    """Keep a preset NAME: a model with its settings, from -f FILE and/or the options (which win);
    NAME then works wherever -m does, and in every API of nibble serve."""
    from nibble.formats import presets
    from nibble.runner.loader import check_preset
    from nibble.runner.text.tokenizer import as_text
    presets.check_name(name)
    preset = presets.Preset("")
    if path is not None:
        stream = click.get_binary_stream("stdin") if path == "-" else open(path, "rb")
        with stream:
            text, note = as_text(stream.read(), path)
        if note:
            click.echo(note, err=True)
        folder = Path.cwd() if path == "-" else Path(path).resolve().parent   # ADAPTER's relative paths'
        preset = presets.parse(text, "the Presetfile" if path == "-" else path, folder)
    elif source is None:
        raise click.UsageError("give the model: --from MODEL, or a Presetfile with -f FILE")
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
             "repetition_penalty": repeat_penalty, "seed": seed}
    preset.parameters |= {k: v for k, v in given.items() if v is not None}
    preset.source = source or preset.source
    if Path(preset.source).expanduser().exists():   # a path: the same model from any folder
        preset.source = str(Path(preset.source).expanduser().resolve())
    if system is not None:
        preset.system = system
    preset.adapters += [str(Path.cwd() / Path(a).expanduser()) for a in loras]
    check_preset(name, preset)
    where = presets.save(name, preset)
    click.echo(f"created {name} (from {preset.source}) in {where}")


@click.command()
@click.argument("name")
def show(name):
    """Print the preset NAME as a Presetfile."""
    from nibble.formats import presets
    preset = presets.read(name)
    if preset is None:
        raise NibbleError(f"no preset {name} (nibble create makes one; nibble ls lists them)")
    click.echo(presets.dump(preset), nl=False)
