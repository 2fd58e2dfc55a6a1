"""The suite runs in several worker processes (pytest-xdist) that share pytest's cache."""
import contextlib
import fcntl


@contextlib.contextmanager
def shared(folder):
    """Hold `folder` (in pytest's cache) for one worker at a time: the first fills it, the others
    wait and find it filled."""
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder
