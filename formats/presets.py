"""Presets: a model under a name of its own, with the system prompt, sampling settings, chat
template and first messages it starts every conversation with, as ollama's Modelfile (`ollama
create`) and LM Studio's per-model defaults keep them. Written as ollama writes a Modelfile, a
"Presetfile":

    FROM qwen2.5:0.5b             # the model: anything -m takes (another preset too)
    SYSTEM You answer in French.
    PARAMETER temperature 0.2     # sampling settings, ollama's names
    TEMPLATE \"\"\"{{ ... }}\"\"\"      # a chat template (Jinja, as Hugging Face's are)
    MESSAGE user Bonjour          # turns put before every conversation's own
    MESSAGE assistant Salut !
    ADAPTER ./my-lora             # a LoRA adapter run beside the weights (a PEFT folder or a GGUF
                                  # LoRA; PATH:SCALE; several lines: several), as --lora takes it

An instruction's value runs to the end of its line, or across lines between triple quotes; `#`
starts a comment line; instructions are case-insensitive. A line nibble cannot take is refused by
its number. A preset is kept as that text, a small file in nibble's data folder, never a copy of
the weights (nor of an adapter's: ADAPTER keeps its path, made absolute): `-m NAME` runs FROM's
model with it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import FormatError
from .paths import data_home

# ollama's PARAMETER names -> the sampling field nibble reads (a model's generation_config.json name),
# and whether it is a whole number
PARAMETERS = {"temperature": ("temperature", False), "top_k": ("top_k", True), "top_p": ("top_p", False),
              "min_p": ("min_p", False), "repeat_penalty": ("repetition_penalty", False),
              "repeat_last_n": ("repeat_last_n", True), "presence_penalty": ("presence_penalty", False),
              "frequency_penalty": ("frequency_penalty", False), "seed": ("seed", True)}
ROLES = ("system", "user", "assistant")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}(:[A-Za-z0-9._-]{1,32})?")
_INSTRUCTION = re.compile(r"\s*([A-Za-z]+)(?:\s+(.*))?$", re.S)
# a Go template's actions ({{ .Prompt }}, {{- if .System }}): ollama's TEMPLATE language, not Jinja
_GO_TEMPLATE = re.compile(r"\{\{-?\s*(\.|if \.|range \.|end\b)")


@dataclass
class Preset:
    source: str                                     # FROM
    system: str | None = None
    parameters: dict[str, float | int] = field(default_factory=dict)   # by nibble's field names
    template: str | None = None
    messages: list[dict] = field(default_factory=list)   # {"role", "content"}
    license: str | None = None
    adapters: list[str] = field(default_factory=list)   # ADAPTER: PATH[:SCALE] as --lora takes it

    def conversation(self) -> list[dict]:
        """What a conversation starts with: the system prompt, then the preset's messages."""
        return ([{"role": "system", "content": self.system}] if self.system is not None else []) + self.messages


def parse(text: str, where: str = "Presetfile", folder: Path | None = None) -> Preset:
    """A Presetfile's text -> its Preset; FormatError naming the line that is wrong. `folder`: the
    Presetfile's, which an ADAPTER's relative path is relative to (as ollama reads a Modelfile's)."""
    lines, i, found = text.splitlines(), 0, {}
    preset = Preset("")
    while i < len(lines):
        number, line = i + 1, lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _INSTRUCTION.match(line)
        if m is None:
            raise FormatError(f"{where} line {number}: expected an instruction (FROM, SYSTEM, PARAMETER, TEMPLATE, "
                              f"MESSAGE, ADAPTER, LICENSE), got {line.strip()[:40]!r}")
        word, rest = m[1].upper(), (m[2] or "").strip()
        head = ""   # MESSAGE's role, PARAMETER's name: the value comes after it
        if word in ("MESSAGE", "PARAMETER"):
            head, _, rest = rest.partition(" ")
            rest = rest.strip()
        if rest.startswith('"""'):   # a value across lines, to the closing triple quotes
            body = rest[3:]
            while '"""' not in body:
                if i >= len(lines):
                    raise FormatError(f"{where} line {number}: its \"\"\" is never closed")
                body += "\n" + lines[i]
                i += 1
            body, after = body.split('"""', 1)
            if after.strip():
                raise FormatError(f"{where} line {number}: text after the closing \"\"\"")
            rest = body
        elif len(rest) >= 2 and rest[0] == rest[-1] == '"':
            rest = rest[1:-1]
        _take(preset, word, f"{head} {rest}" if head else rest, f"{where} line {number}", found, folder)
    if not preset.source:
        raise FormatError(f"{where}: no FROM line (the model the preset runs)")
    return preset


def _take(preset: Preset, word: str, value: str, at: str, found: dict, folder: Path | None):
    if word in ("FROM", "SYSTEM", "TEMPLATE", "LICENSE") and word in found:
        raise FormatError(f"{at}: a second {word} (the first is line {found[word]})")
    found.setdefault(word, at.rsplit(" ", 1)[-1])
    if word == "FROM":
        if not value:
            raise FormatError(f"{at}: FROM names no model")
        preset.source = value
    elif word == "SYSTEM":
        preset.system = value
    elif word == "TEMPLATE":
        if _GO_TEMPLATE.search(value):
            raise FormatError(f"{at}: TEMPLATE is a Go template (ollama's); nibble's are Jinja, as a model's "
                              "tokenizer_config.json chat_template is")
        preset.template = value
    elif word == "LICENSE":
        preset.license = value
    elif word == "PARAMETER":
        name, _, given = value.partition(" ")
        preset.parameters.update([parameter(name, given.strip(), at)])
    elif word == "MESSAGE":
        role, _, content = value.partition(" ")
        if role not in ROLES:
            raise FormatError(f"{at}: MESSAGE's role must be one of {', '.join(ROLES)}, not {role!r}")
        preset.messages.append({"role": role, "content": content})
    elif word == "ADAPTER":
        if not value:
            raise FormatError(f"{at}: ADAPTER names no adapter (a PEFT folder or a GGUF LoRA file)")
        preset.adapters.append(str(folder / Path(value).expanduser()) if folder is not None else value)
    else:
        raise FormatError(f"{at}: unknown instruction {word} (FROM, SYSTEM, PARAMETER, TEMPLATE, MESSAGE, "
                          "ADAPTER, LICENSE)")


def parameter(name: str, given: str, at: str = "PARAMETER") -> tuple[str, float | int]:
    """One PARAMETER (ollama's name, its value as written) -> (nibble's field, the number)."""
    if name not in PARAMETERS:
        raise FormatError(f"{at}: unknown parameter {name!r} (nibble takes {', '.join(PARAMETERS)})")
    field_name, whole = PARAMETERS[name]
    try:
        value = int(given) if whole else float(given)
    except ValueError:
        raise FormatError(f"{at}: {name} must be {'a whole number' if whole else 'a number'}, not {given!r}") from None
    return field_name, value


def dump(preset: Preset) -> str:
    """The Presetfile of `preset` (what parse reads back to it)."""
    by_field = {f: name for name, (f, _) in PARAMETERS.items()}
    lines = [f"FROM {preset.source}"]
    if preset.system is not None:
        lines.append(f"SYSTEM {_value(preset.system)}")
    lines += [f"PARAMETER {by_field[k]} {v}" for k, v in preset.parameters.items()]
    if preset.template is not None:
        lines.append(f"TEMPLATE {_value(preset.template, multi=True)}")
    lines += [f"MESSAGE {m['role']} {_value(m['content'])}" for m in preset.messages]
    lines += [f"ADAPTER {_value(a)}" for a in preset.adapters]
    if preset.license is not None:
        lines.append(f"LICENSE {_value(preset.license, multi=True)}")
    return "\n".join(lines) + "\n"


def _value(text: str, multi: bool = False) -> str:
    if '"""' in text:
        raise FormatError('a preset\'s text cannot hold """ (it ends a value in a Presetfile)')
    if multi or "\n" in text or text != text.strip() or (len(text) >= 2 and text[0] == text[-1] == '"'):
        return f'"""{text}"""'
    return text


def merged(outer: Preset, inner: Preset) -> Preset:
    """A preset made FROM another: the outer one's settings over the inner one's, on the inner one's model."""
    return Preset(inner.source, outer.system if outer.system is not None else inner.system,
                  {**inner.parameters, **outer.parameters},
                  outer.template if outer.template is not None else inner.template,
                  inner.messages + outer.messages, outer.license if outer.license is not None else inner.license,
                  inner.adapters + outer.adapters)


# ---- kept in nibble's data folder ----

def presets_dir() -> Path:
    return data_home() / "presets"


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise FormatError(f"{name!r} cannot name a preset: letters, digits, '.', '_' and '-' (a ':tag' after "
                          "them), starting with a letter or digit")
    return name


def _file(name: str) -> Path:
    return presets_dir() / (name.replace(":", "@") + ".presetfile")


def read(name: str) -> Preset | None:
    """The preset `name` as it was written (not merged with one it is made from), or None."""
    if not _NAME.fullmatch(name) or not _file(name).is_file():
        return None
    return parse(_file(name).read_text(encoding="utf-8"), f"the preset {name}")


def find(name: str) -> Preset | None:
    """The preset of that name, or None (a name no preset has, or one that is no preset's name);
    one made FROM another preset merged with it, down to a model."""
    seen, preset = [], None
    while (found := read(name)) is not None:
        if name in seen:
            raise FormatError(f"the presets {' -> '.join(seen + [name])} are made from each other: none runs a model")
        seen.append(name)
        preset = found if preset is None else merged(preset, found)
        name = found.source
    return preset


def save(name: str, preset: Preset) -> Path:
    """Keep `preset` as `name` (replacing one of that name), written whole or not at all."""
    path = _file(check_name(name))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(dump(preset), encoding="utf-8")
    tmp.replace(path)
    return path


def remove(name: str) -> bool:
    """Forget the preset `name`; whether there was one."""
    if not _NAME.fullmatch(name) or not _file(name).is_file():
        return False
    _file(name).unlink()
    return True


def names() -> list[str]:
    """Every preset's name, sorted."""
    folder = presets_dir()
    found = [p.name.removesuffix(".presetfile").replace("@", ":") for p in folder.glob("*.presetfile")] \
        if folder.is_dir() else []
    return sorted(n for n in found if _NAME.fullmatch(n))
