"""kill -9 during a streaming chat reply, again and again: how much of the reply does the history keep?

    python -m tests.durability --kills 20

Each round runs the real chat app headless in a child process, on the tiny model (greedy, slowed
to at most 100 tokens a second, replies of 200 tokens), sends a prompt, and kills the child at a
random moment while the reply streams (after a random token, a random fraction of a frame later).
The child prints a line per token generated, and holds the reply's last token until it is killed:
however fast it runs, the kill lands before the reply ends. The history is then opened as the next
start opens it: the reply must be marked interrupted, be a prefix of the model's greedy reply, and
the tokens lost are those generated minus those stored.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

PROMPT = "Tell me a long story about the sea."
TOKENS = 200        # a reply's length
TOKEN_DELAY = 0.01   # seconds per token in the child
THREADS = 1          # the machine may be busy: a parallel loop on a loaded core waits for it


class Kill(NamedTuple):
    generated: int    # tokens the child had generated when killed
    stored: int       # tokens of the stored reply
    finish: str | None
    prefix: bool      # the stored text is a prefix of the greedy reply

    @property
    def lost(self) -> int:
        return self.generated - self.stored


def load_tiny(path: str):
    from nibble.runner.loader import load
    model, tok = load(path)
    tok.eos_ids = frozenset()   # replies run to their max_tokens
    return model, tok


def greedy_reply(tiny: str, tokens: int) -> tuple[str, int]:
    """The reply's text and its length in tokens."""
    from nibble.runner.generation.session import ChatSession
    from nibble.runner.settings import SamplerSettings
    model, tok = load_tiny(tiny)
    chunks = ChatSession(model, tok, threads=THREADS).reply([{"role": "user", "content": PROMPT}],
                                                            SamplerSettings(temperature=0), tokens)
    chunks = list(chunks)
    return "".join(c.text for c in chunks), chunks[-1].stats.generation_tokens


def child(tiny: str, tokens: int):
    """The chat app, headless: send PROMPT, then stream the reply until killed."""
    from nibble.runner.generation import session as session_module
    from tests.tui_helpers import make_app, send, wait_for
    real, replying = session_module.stream_generate, False

    def slowed(*args, **kwargs):
        for r in real(*args, **kwargs):
            time.sleep(TOKEN_DELAY)
            if replying and r.generation_tokens:   # the reply's tokens, not the warm-up's
                if r.finish_reason:   # the reply's end is held until the kill: it lands mid-reply
                    threading.Event().wait()
                os.write(1, b"%d\n" % r.generation_tokens)   # fd 1 itself: Textual captures sys.stdout
            yield r
    session_module.stream_generate = slowed

    async def chat():
        app = make_app(load_tiny(tiny), max_tokens=tokens, threads=THREADS)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.session is not None, timeout=300, what="the model")
            nonlocal replying
            replying = True
            await send(pilot, PROMPT, wait=False)
            await asyncio.sleep(3600)
    asyncio.run(chat())


def one_kill(tiny: str, home: Path, reference: str, tokens: int, rng: random.Random) -> Kill:
    """Kill a chat app while it writes the reply (of `tokens` tokens) to PROMPT, and read what it kept."""
    import numba
    # The kernels greedy_reply compiled, already in this process's cache: the child loads them.
    env = {**os.environ, "NIBBLE_HOME": str(home), "NUMBA_CACHE_DIR": numba.config.CACHE_DIR}
    p = subprocess.Popen([sys.executable, "-m", "tests.durability", "--child", tiny,
                          "--tokens", str(tokens)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        # A random moment: after a random token, a random part of a frame later.
        until, generated = rng.randrange(1, tokens), 0
        while generated < until:
            line = p.stdout.readline()
            assert line, "the child ended before its reply did"
            generated = int(line)
        time.sleep(rng.uniform(0, 0.1))
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    generated = max([generated, *map(int, p.stdout)])
    p.stdout.close()
    from nibble.tui.store import Store
    store, warning = Store.open(home / "history.db")   # as the next start opens it
    assert warning is None, warning
    chat = store.chats()[0]
    last = store.messages(chat.id)[-1]
    store.close()
    if last.role == "user":   # killed before the first word was stored: dropped, as intended
        return Kill(generated, 0, None, True)
    return Kill(generated, last.stats.get("generation_tokens", 0), last.finish,
                reference.startswith(last.content))


def run(kills: int, seed: int = 0, home: Path | None = None, tokens: int = TOKENS) -> list[Kill]:
    """`kills` rounds in `home` (a new folder if None), on replies of `tokens` tokens: one tiny
    model, one history."""
    from nibble.formats.model_dir import write_model_dir
    from tests.tiny import tiny_model_dir
    with tempfile.TemporaryDirectory() as tmp:
        home = home or Path(tmp)
        tiny = str(write_model_dir(tiny_model_dir(), Path(tmp) / "tiny"))
        reference, length = greedy_reply(tiny, tokens)
        rng = random.Random(seed)
        return [one_kill(tiny, home, reference, length, rng) for _ in range(kills)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=TOKENS, help="a reply's length")
    parser.add_argument("--child", metavar="TINY_MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.tokens)
    results = run(args.kills, args.seed, tokens=args.tokens)
    for i, k in enumerate(results, 1):
        print(json.dumps({"kill": i, **k._asdict(), "lost": k.lost}))
    lost = [k.lost for k in results]
    print(f"{len(results)} kills: tokens lost at most {max(lost)}, "
          f"mean {sum(lost) / len(lost):.1f}; interrupted {sum(k.finish == 'interrupted' for k in results)}, "
          f"dropped before a word {sum(k.finish is None for k in results)}; "
          f"all prefixes of the greedy reply: {all(k.prefix for k in results)}")


if __name__ == "__main__":
    main()
