"""The models on disk: what nibble's cache and the Hugging Face cache hold that nibble can run,
each under the name that loads it with the copies quantized from it on first use, what it is
(family, parameters, quantization), and removing one.

A hub model is a set of files in one revision's snapshot: a safetensors model's (hub.HUB_FILES),
or one GGUF model's parts, named `org/name:TAG` with the shortest tag that picks it (pick_gguf).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import hashlib
import json
import os
import re
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from . import families, hub, usage
from .cross_encoder import ranks
from .errors import FormatError
from .gguf_header import SPLIT_PART, read_gguf_header, split_parts
from .paths import models_dir, quantized_dir
from .safetensors import read_safetensors_header
from .sentence_transformers import embeds

# safetensors dtypes as nibble names them (`bf16`); the others keep theirs, lowercased
_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}


@dataclass(frozen=True)
class CachedModel:
    """A model already on disk, and the name that loads it."""
    ref: str             # what to pass to resolve(): an alias, "org/name[@commit][:TAG]" or a path
    path: Path           # what resolve(ref) gives: a directory, or a GGUF model's first part
    size_bytes: int      # on disk (a hub model: its blobs), its quantized copies not counted
    repo_id: str | None = None    # a hub model's repo, revision, snapshot and files in it
    commit: str | None = None
    snapshot: Path | None = None
    files: tuple[str, ...] = ()
    copies: tuple[Path, ...] = ()   # quantized from it on first use (quantized_dir), run in its stead

    @property
    def paths(self) -> list[Path]:
        """Its files in the snapshot (a hub model), else its path."""
        return [self.snapshot / f for f in self.files] or [self.path]


@dataclass(frozen=True)
class Details:
    """What a model is, read from its headers (no weight is read)."""
    format: str                 # "gguf" or "safetensors"
    family: str                 # config.json's model_type, or GGUF's general.architecture
    parameters: int | None
    quantization: str           # "int4 g32", "bf16", "Q4_K_M"


def list_cached_models() -> list[CachedModel]:
    """Models that resolve() can load without the network: nibble's own, then the Hugging Face
    cache's, one per safetensors snapshot and one per whole GGUF model, each with its quantized
    copies; then the copies of models outside the caches or gone, by their paths."""
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    found = []
    models = models_dir()
    for d in sorted(models.iterdir()) if models.is_dir() else []:
        if d.name.startswith(".") or not (d / "config.json").is_file():
            continue   # a fetch in progress, or not a model
        found.append(CachedModel(d.name if d.name in hub.ALIASES else str(d), d, size_on_disk(d)))
    try:
        # Passed explicitly: scan_cache_dir's default was frozen when huggingface_hub was imported.
        cache = scan_cache_dir(constants.HF_HUB_CACHE)
    except CacheNotFound:
        cache = None
    for repo in sorted(cache.repos, key=lambda r: r.repo_id) if cache else []:
        if repo.repo_type == "model" and repo.revisions:
            found += _repo_models(repo)
    copies = _quantized_copies()
    found = [dataclasses.replace(m, copies=tuple(copies.pop(identity(m.path), []))) for m in found]
    return found + [CachedModel(str(d), d, size_on_disk(d)) for ds in copies.values() for d in ds]


def copy_name(ref: str, path: Path, bits: int) -> str:
    """The folder in quantized_dir() of the model at `path` (named `ref`) quantized to `bits`."""
    name = Path(ref).name if Path(ref).expanduser().exists() else ref.replace("/", "--")
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80]
    return f"{slug}-{identity(path)}-int{bits}"


def identity(path: Path) -> str:
    """A hash of where a model's files are and of each one's size and time: a checkpoint changed
    or replaced gets quantized copies of its own."""
    path = Path(path).resolve()
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    return hashlib.sha1(repr((str(path), stats)).encode()).hexdigest()[:12]


def copies_of(path: Path) -> list[Path]:
    """The whole copies in quantized_dir() of the model at `path`, in the caches or not."""
    return _quantized_copies().get(identity(path), [])


def _quantized_copies() -> dict[str, list[Path]]:
    """The whole copies in quantized_dir(), by the identity of the model they were made from."""
    root = quantized_dir()
    copies = {}
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if match := _COPY.fullmatch(d.name):
            if (d / "config.json").is_file():   # else one being written, or a killed write's
                copies.setdefault(match["identity"], []).append(d)
    return copies


_COPY = re.compile(r".*-(?P<identity>[0-9a-f]{12})-int\d+")


def _repo_models(repo) -> list[CachedModel]:
    """The models of the revision resolve() takes of a cached repo (main, else the newest)."""
    rev = max(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified))
    name = repo.repo_id if "main" in rev.refs else f"{repo.repo_id}@{rev.commit_hash}"
    sizes = {f.file_path.relative_to(rev.snapshot_path).as_posix(): f.size_on_disk for f in rev.files}

    def model(ref: str, path: Path, files: list[str]) -> CachedModel:
        return CachedModel(ref, path, sum(sizes[f] for f in files), repo.repo_id, rev.commit_hash,
                           rev.snapshot_path, tuple(files))

    found = []
    for stem, parts in hub.gguf_models(list(sizes)).items():
        split = SPLIT_PART.fullmatch(parts[0])
        if split and len(parts) != int(split["count"]):
            continue   # a part is missing: resolve() would download it
        tag = _tag(stem, list(sizes), name)
        ref = f"{name}:{tag}" if tag else str(rev.snapshot_path / parts[0])
        found.append(model(ref, rev.snapshot_path / parts[0], parts))
    found.sort(key=lambda m: m.ref)
    if hub.is_loadable(rev.snapshot_path):
        files = [f for f in sizes if any(fnmatch.fnmatch(f, p) for p in hub.HUB_FILES)]
        found.insert(0, model(name, rev.snapshot_path, files))
    return found


def _tag(stem: str, files: list[str], label: str) -> str | None:
    """The shortest tail of the model's name, from a separator on, that picks it among `files`
    as a reference's tag would (Q4_K_M, UD-Q4_K_XL); None if none does."""
    name = stem.rsplit("/", 1)[-1]
    tails = [name[m.end():] for m in reversed(list(re.finditer(r"[-.]", name)))] + [name]
    for tail in tails:
        try:
            if tail and hub.pick_gguf(files, tail, label)[0].startswith(stem):
                return tail
        except FormatError:
            continue   # names several models
    return None


def encodes(path: Path) -> bool:
    """Whether the model at `path` embeds or reranks (an encoder's pass, an EmbedEngine's, no
    decode), by its files' headers: no weight is read."""
    return ranks(path) or embeds(path, describe(path).family)


def describe(path: Path) -> Details:
    """What the model at `path` (a directory, a .safetensors file or a GGUF's first part) is."""
    if path.suffix == ".gguf":
        return _describe_gguf(split_parts(path))
    folder = path if path.is_dir() else path.parent
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    files = sorted(folder.glob("*.safetensors")) if path.is_dir() else [path]
    entries = {k: v for f in files for k, v in read_safetensors_header(f).items()}
    quant = config.get("quantization") if isinstance(config.get("quantization"), dict) else None
    params = sum(_parameters(name, dtype, shape, entries, quant) for name, (dtype, shape) in entries.items())
    if quant:
        label = f"int{quant.get('bits')} g{quant.get('group_size')}"
    else:
        by_dtype = Counter()
        for dtype, shape in entries.values():
            by_dtype[dtype] += _count(shape)
        top = by_dtype.most_common(1)[0][0] if by_dtype else "?"
        label = _DTYPES.get(top, top.lower())
    return Details("safetensors", str(config.get("model_type") or "?"), params, label)


def check_loads(path: Path) -> Details:
    """What the model at `path` is, once nibble knows it can read it: a directory's config,
    tokenizer and weights' headers (read_model_dir, no weight read), or a GGUF's header and an
    architecture nibble runs (a GGUF's full import repacks every weight: `nibble run` does that)."""
    if path.suffix == ".gguf":
        details = describe(path)
        if families.gguf_arch(details.family) is None:
            raise FormatError(f"{path}: nibble cannot run the GGUF architecture {details.family!r}; "
                              f"it runs {', '.join(families.gguf_archs())}")
        return details
    from .model_dir import read_model_dir
    read_model_dir(path)
    return describe(path)


def size_on_disk(path: Path) -> int:
    """Bytes of a model directory's files, or of a GGUF model's parts."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return sum(p.stat().st_size for p in (split_parts(path) if path.suffix == ".gguf" else [path]))


def parameter_size(n: int | None) -> str:
    """A parameter count as ollama writes it: 135M, 1.7B."""
    if not n:
        return "?"
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _parameters(name: str, dtype: str, shape: tuple, entries: dict, quant: dict | None) -> int:
    """A tensor's weights: a packed MLX weight (uint32 beside P.scales) holds 32/bits of them a
    word; its scales, biases, table of levels and high planes are none."""
    n = _count(shape)
    module = name.removesuffix(".weight")
    if quant and dtype == "U32" and f"{module}.scales" in entries:
        own = quant.get(module)
        bits = (own if isinstance(own, dict) else quant).get("bits", quant.get("bits"))
        return n * 32 // bits if isinstance(bits, int) and bits > 0 else n
    if name.endswith((".scales", ".biases", ".values", ".high")) and f"{name.rsplit('.', 1)[0]}.weight" in entries:
        return 0
    return n


def _count(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _describe_gguf(parts: list[Path]) -> Details:
    import gguf   # its enums' names: only when there is a GGUF to describe
    headers = [read_gguf_header(p) for p in parts]
    meta = headers[0].metadata
    tensors = [t for h in headers for t in h.tensors.values()]
    file_type = meta.get("general.file_type")
    try:
        label = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:   # no file type, or one this gguf does not know: the commonest tensor type
        by_type = Counter()
        for t in tensors:
            by_type[t.ggml_type] += t.size
        top = by_type.most_common(1)[0][0] if by_type else None
        label = gguf.GGMLQuantizationType(top).name if top in set(gguf.GGMLQuantizationType) else "?"
    return Details("gguf", str(meta.get("general.architecture") or "?"), sum(t.size for t in tensors), label)


def find(ref: str, models: list[CachedModel]) -> CachedModel | None:
    """The cached model `ref` names, as resolve() would read it: a path (of the model or one of
    its files), an alias, a hub reference in any of its spellings, or a name `nibble ls` shows."""
    path = Path(ref).expanduser()
    if path.exists():
        key = _key(path)
        if copy := next((c for m in models for c in m.copies if _key(c) == key), None):
            return CachedModel(str(copy), copy, size_on_disk(copy))   # the copy alone
        return next((m for m in models if key in map(_key, [m.path, *m.paths])), None)
    if named := next((m for m in models if m.ref == ref), None):
        return named
    if ref in hub.ALIASES:
        target = models_dir() / ref
    elif hub_ref := hub.parse_hub_ref(ref):
        try:
            target = hub.cached_hub_model(*hub_ref)
        except ValueError:   # huggingface_hub's HFValidationError: not a valid repo id
            target = None
    else:
        target = None
    return next((m for m in models if target and _key(m.path) == _key(target)), None)


def in_caches(path: Path) -> bool:
    """Whether `path` lies in nibble's models or quantized folder or the Hugging Face cache."""
    from huggingface_hub import constants
    key = Path(_key(path))
    roots = (models_dir(), quantized_dir(), constants.HF_HUB_CACHE)
    return any(key.is_relative_to(os.path.realpath(root)) for root in roots)


def remove(model: CachedModel, models: list[CachedModel]) -> int:
    """Delete `model` from its cache, and its quantized copies; the bytes freed. A hub revision
    left with no other model is deleted whole by huggingface_hub (snapshot, refs, blobs no other
    revision uses); else only the model's files, and their blobs where no other file links to
    them."""
    copies = sum(size_on_disk(d) for d in model.copies)
    for d in model.copies:
        shutil.rmtree(d)
    return copies + _remove(model, models)


def _remove(model: CachedModel, models: list[CachedModel]) -> int:
    usage.forget(model.path)
    if model.repo_id is None:
        shutil.rmtree(model.path)
        return model.size_bytes
    from huggingface_hub import constants, scan_cache_dir
    others = [m for m in models if (m.repo_id, m.commit) == (model.repo_id, model.commit) and m != model]
    cache = scan_cache_dir(constants.HF_HUB_CACHE)
    if not others:
        strategy = cache.delete_revisions(model.commit)
        strategy.execute()
        return strategy.expected_freed_size
    return _remove_files(model, cache)


def _remove_files(model: CachedModel, cache) -> int:
    """The model's links in its snapshot, and each blob that no link left in the repo points to."""
    repo = next(r for r in cache.repos if r.repo_id == model.repo_id and r.repo_type == "model")
    snapshot = model.snapshot
    mine = set(model.paths)
    kept = {f.blob_path for rev in repo.revisions for f in rev.files if f.file_path not in mine}
    freed = 0
    for f in (f for rev in repo.revisions for f in rev.files if f.file_path in mine):
        f.file_path.unlink()
        if f.blob_path not in kept and f.blob_path.exists():
            freed += f.size_on_disk
            f.blob_path.unlink()
        for parent in f.file_path.relative_to(snapshot).parents[:-1]:   # folders it leaves empty
            with contextlib.suppress(OSError):
                (snapshot / parent).rmdir()
    return freed


def _key(path: Path) -> str:
    """A path compared as the folder's real path and the name (a hub file is a link to a blob)."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(os.path.realpath(folder), name)
