"""When each cached model was last loaded, for `nibble ls`: an empty file per model in
$NIBBLE_HOME/used, named by a hash of the model's path, whose modification time is the last load.

Not the files' access times: many systems mount with noatime or relatime (an access time moved
once a day at most), and reading a model's header for `nibble ls` would count as a use.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .paths import cache_home


def record_use(path: Path):
    """Note that the model at `path` was loaded now. Best effort: a run never fails for it."""
    record = _record(path)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.touch()
    except OSError:
        pass


def last_used(path: Path) -> float | None:
    """When the model at `path` was last loaded (seconds since the epoch), or None if never."""
    try:
        return _record(path).stat().st_mtime
    except OSError:
        return None


def forget(path: Path):
    """Drop the record of a model that is removed."""
    _record(path).unlink(missing_ok=True)


def _record(path: Path) -> Path:
    # The folder's real path, not the file's: a hub model's file links to a blob that another
    # revision's file may share.
    folder, name = os.path.split(os.path.abspath(path))
    key = hashlib.sha256(os.fsencode(os.path.join(os.path.realpath(folder), name))).hexdigest()[:32]
    return cache_home() / "used" / key
