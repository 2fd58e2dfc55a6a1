"""Where nibble keeps its files: a cache (models fetched by alias, compiled kernels, KV blocks) and data
(chats).

$NIBBLE_HOME holds both when set; otherwise they follow the XDG base directories. These
functions only compute paths: creating the folders is left to whoever writes there.
"""
import os
from pathlib import Path


def cache_home() -> Path:
    """nibble's cache: $NIBBLE_HOME, else $XDG_CACHE_HOME/nibble, else ~/.cache/nibble."""
    return _home("XDG_CACHE_HOME", Path(".cache"))


def data_home() -> Path:
    """nibble's data: $NIBBLE_HOME, else $XDG_DATA_HOME/nibble, else ~/.local/share/nibble."""
    return _home("XDG_DATA_HOME", Path(".local", "share"))


def models_dir() -> Path:
    """Models fetched by alias, a folder each."""
    return cache_home() / "models"


def quantized_dir() -> Path:
    """Float models quantized on first use, a folder each."""
    return cache_home() / "quantized"


def kernels_dir() -> Path:
    """Compiled kernels, a folder per version of their sources."""
    return cache_home() / "numba"


def kv_dir() -> Path:
    """The KV cache's blocks kept on disk, a folder per model (runner/kv/disk.py)."""
    return cache_home() / "kv"


def _home(xdg_variable: str, default_under_home: Path) -> Path:
    if home := os.environ.get("NIBBLE_HOME"):
        return Path(home).expanduser()
    return Path(os.environ.get(xdg_variable) or Path.home() / default_under_home) / "nibble"
