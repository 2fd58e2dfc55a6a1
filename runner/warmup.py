"""python -m nibble.runner.warmup MODEL [--kv-cache f32|int8] [--float]: compile a model's full
kernels into nibble's cache, at the lowest priority (runner/background.py starts it).

It loads the model as it runs (a directory or a GGUF file; --float: a float model as stored) and
runs two passes, a prompt's (more rows than the decode kernels take) and a decoded token's, on a
KV cache of the type given: what a command's passes compile, the layers and the output head. One
at a time: a second waits for the first, then finds the kernels cached.
"""
from __future__ import annotations

import argparse
import fcntl
import os
import signal
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(prog="python -m nibble.runner.warmup")
    parser.add_argument("model")
    parser.add_argument("--kv-cache", default="f32")
    parser.add_argument("--float", action="store_true")
    args = parser.parse_args(argv)
    # Out of the command's process group, so that Ctrl-C on the command leaves it be, but in its
    # session: where the kernel groups a session's processes for the scheduler (autogroup), a
    # new session would take half the cores whatever its niceness.
    os.setpgid(0, 0)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)   # the terminal closed: it goes on
    os.nice(19)   # the cores a command leaves idle, and no more
    import numba

    from .kernels.cpu import SMALL
    from .loader import load
    folder = Path(numba.config.CACHE_DIR)   # set by importing the kernels
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "warmup.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        model, _ = load(args.model, "float" if args.float else None)
        cache = model.new_cache(4 * SMALL, args.kv_cache)
        model.forward(np.zeros(SMALL + 1, np.int64), cache)   # a prompt's pass
        model.forward(np.zeros(1, np.int64), cache)           # a decoded token's


if __name__ == "__main__":
    main()
