"""`nibble pull`, `ls`, `rm` and `ps`: the commands that manage models on disk and ask a running
server what it has loaded. main.py adds them to the `nibble` group, which turns their errors into
one line."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from nibble.formats.errors import NibbleError
from nibble.runner.serve import DEFAULT_HOST, DEFAULT_PORT

PS_TIMEOUT = 5   # seconds: a server that has not answered by then is stuck or not nibble's


@click.command()
@click.argument("ref", metavar="MODEL")
def pull(ref):
    """Download MODEL ahead of time, as `nibble run -m MODEL` would: an alias, a hub id
    org/name[@rev][:QUANT], or a path (only checked); a float model that runs quantized (past 1B
    weights) is quantized now, not on its first run."""
    from nibble.formats import catalog, hub
    from nibble.formats.model_dir import read_model_dir
    from nibble.runner.loader import as_quantized
    path = hub.resolve(ref, record=False)
    details = catalog.check_loads(path)
    if path.suffix != ".gguf":
        as_quantized(ref, read_model_dir(path), None)
    model = catalog.find(str(path), catalog.list_cached_models())
    name, size = (model.ref, model.size_bytes) if model else (str(path), catalog.size_on_disk(path))
    copies = catalog.copies_of(path)
    quantization = " + ".join([details.quantization, *(f"{_quantization(c)} copy" for c in copies)])
    click.echo(f"{name}: {details.family} {catalog.parameter_size(details.parameters)} {quantization}, "
               f"{format_bytes(size + sum(map(catalog.size_on_disk, copies)))} in {path}")


@click.command("ls")
@click.option("--json", "as_json", is_flag=True, help="One JSON object a model, in a list.")
def ls(as_json):
    """List the models in nibble's cache and the Hugging Face cache, by the name -m takes."""
    from nibble.formats import catalog, presets, usage
    rows = []
    for m in catalog.list_cached_models():
        try:
            d = catalog.describe(m.path)
        except NibbleError as e:   # one damaged file must not hide the others
            click.echo(f"nibble: {m.ref}: {e}", err=True)
            d = catalog.Details("?", "?", None, "?")
        copies = [{"quantization": _quantization(c), "size_bytes": catalog.size_on_disk(c), "path": str(c)}
                  for c in m.copies]
        rows.append({"name": m.ref, "family": d.family, "parameters": d.parameters, "quantization": d.quantization,
                     "format": d.format, "size_bytes": m.size_bytes, "last_used": usage.last_used(m.path),
                     "path": str(m.path), "copies": copies})
    if as_json:
        for r in rows:
            r["last_used"] = _iso(r["last_used"])
        made = [{"name": name, "preset": True, "from": p.source, "system": p.system, "parameters": p.parameters,
                 "adapters": p.adapters} for name in presets.names() if (p := presets.read(name))]
        click.echo(json.dumps(rows + made, indent=2, ensure_ascii=False))
        return
    now = time.time()
    if rows:
        table(["NAME", "FAMILY", "PARAMETERS", "QUANTIZATION", "SIZE", "LAST USED"],
              [[r["name"], r["family"], catalog.parameter_size(r["parameters"]),
                " + ".join([r["quantization"], *(f"{c['quantization']} copy" for c in r["copies"])]),
                format_bytes(r["size_bytes"] + sum(c["size_bytes"] for c in r["copies"])),
                ago(r["last_used"], now)] for r in rows])
    made = [(name, presets.read(name)) for name in presets.names()]
    if made:
        if rows:
            click.echo()
        table(["PRESET", "FROM", "SYSTEM", "SETTINGS"],
              [[name, p.source, _short(p.system or ""), " ".join([*(f"{k}={v}" for k, v in p.parameters.items()),
                                                                   *(f"adapter={Path(a).name}" for a in p.adapters)])]
               for name, p in made])
    if not rows and not made:
        click.echo("no models yet: `nibble pull MODEL` downloads one", err=True)


@click.command()
@click.argument("ref", metavar="MODEL")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
def rm(ref, yes):
    """Remove MODEL (a name `nibble ls` shows, an alias, a hub id or a path) from nibble's cache or
    the Hugging Face cache, with the copies quantized from it on first use; a GGUF repo's other
    quantizations stay."""
    from nibble.formats import catalog, presets
    if presets.remove(ref):   # a preset: its file, not its model
        click.echo(f"removed the preset {ref}")
        return
    models = catalog.list_cached_models()
    model = catalog.find(ref, models)
    if model is None:
        path = Path(ref).expanduser()
        if path.exists() and not catalog.in_caches(path):
            raise NibbleError(f"{path} is not in nibble's cache or the Hugging Face cache: "
                              "nibble rm removes only the models they hold")
        raise NibbleError(f"no model {ref} in nibble's cache or the Hugging Face cache (nibble ls lists them)")
    copies = f" and its {_plural(len(model.copies), 'quantized copy', 'quantized copies')}" if model.copies else ""
    if not yes and sys.stdin is not None and sys.stdin.isatty():
        size = model.size_bytes + sum(catalog.size_on_disk(c) for c in model.copies)
        click.confirm(f"remove {model.ref}{copies} ({format_bytes(size)}, {model.path})?", abort=True)
    freed = catalog.remove(model, models)
    click.echo(f"removed {model.ref}{copies}: {format_bytes(freed)} freed")


def _short(text: str, most: int = 40) -> str:
    line = " ".join(text.split())
    return line if len(line) <= most else line[:most - 1] + "…"


def _quantization(path: Path) -> str:
    """What a quantized copy is ("int4 g64"), or "?" if its files say nothing readable."""
    from nibble.formats import catalog
    try:
        return catalog.describe(path).quantization
    except NibbleError:
        return "?"


def _plural(n: int, one: str, many: str) -> str:
    return one if n == 1 else f"{n} {many}"


@click.command()
@click.option("--host", default=DEFAULT_HOST, show_default=True, help="The address nibble serve listens on.")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=click.IntRange(1, 65535),
              help="The port nibble serve listens on.")
@click.option("--api-key", envvar="NIBBLE_API_KEY", help="The server's key, if it asks for one.")
@click.option("--json", "as_json", is_flag=True, help="Print the server's answer (ollama's /api/ps) as it is.")
def ps(host, port, api_key, as_json):
    """Show what a running `nibble serve` has loaded."""
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    body = _get_running(url, api_key)
    if as_json:
        click.echo(json.dumps(body, indent=2, ensure_ascii=False))
        return
    rows, now = [], time.time()
    for m in body["models"]:
        d = m.get("details") if isinstance(m.get("details"), dict) else {}
        size = m.get("size")
        rows.append([m.get("name", "?"), d.get("family", "?"), d.get("parameter_size", "?"),
                     d.get("quantization_level", "?"), format_bytes(size) if isinstance(size, int) else "?",
                     str(m.get("context_length", "?")), "CPU" if not m.get("size_vram") else "GPU",
                     until(m.get("expires_at"), now)])
    table(["NAME", "FAMILY", "PARAMETERS", "QUANTIZATION", "SIZE", "CONTEXT", "PROCESSOR", "UNTIL"], rows)


def _get_running(url: str, api_key: str | None) -> dict:
    """The server's GET /api/ps, or one line saying why there is none."""
    import urllib.error
    import urllib.request
    request = urllib.request.Request(f"{url}/api/ps", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=PS_TIMEOUT) as r:
            raw = r.read(1 << 20)
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise NibbleError(f"the nibble serve at {url} asks for its API key: pass --api-key "
                              "or set NIBBLE_API_KEY") from None
        raise NibbleError(f"{url} is not a nibble serve: GET /api/ps answered HTTP {e.code}") from None
    except (urllib.error.URLError, ConnectionError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError):
            raise NibbleError(f"{url} did not answer in {PS_TIMEOUT} s") from None
        raise NibbleError(f"no nibble serve at {url}") from None
    except TimeoutError:
        raise NibbleError(f"{url} did not answer in {PS_TIMEOUT} s") from None
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not (isinstance(body, dict) and isinstance(body.get("models"), list)
            and all(isinstance(m, dict) for m in body["models"])):
        raise NibbleError(f"{url} is not a nibble serve: its /api/ps is not a list of models")
    return body


def table(header: list[str], rows: list[list[str]]):
    """Columns aligned by padding, two spaces apart, on stdout."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        click.echo("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())


def format_bytes(n: int) -> str:
    """98 MB, 1.2 GB: decimal units, as the hub and pip show sizes."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}" if n < 10 * scale else f"{n / scale:.0f} {unit}"
    return f"{n} B"


def ago(when: float | None, now: float) -> str:
    if when is None:
        return "never"
    span = _span(now - when)
    return f"{span} ago" if span else "just now"


def until(expires_at, now: float) -> str:
    """ollama's expires_at as its ps shows it: "4 minutes from now", "forever" (year 9999)."""
    from datetime import datetime
    try:
        when = datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
        if when.year >= 9999:
            return "forever"
        seconds = when.timestamp() - now
    except (AttributeError, TypeError, ValueError, OverflowError, OSError):   # not a date: a foreign server's
        return "?"
    if seconds <= 0:
        return "unloading"
    return f"{_span(seconds) or 'less than a minute'} from now"


def _span(seconds: float) -> str | None:
    """5 minutes, 1 hour, 3 days: the largest unit that fits; None under a minute."""
    for unit, length in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= length:
            n = int(seconds // length)
            return f"{n} {unit}{'s' * (n != 1)}"
    return None


def _iso(when: float | None) -> str | None:
    from datetime import datetime, timezone
    return datetime.fromtimestamp(when, timezone.utc).isoformat(timespec="seconds") if when is not None else None
