"""The default model's score on everyday questions (not collected by pytest).

    python -m tests.score_questions [-m MODEL] [--seeds 0-4] [--set temperature=0.1 ...] [--json OUT]

Each question of tests/data/everyday-questions.json is asked once per seed as `nibble run` asks it
(the default model where -m names none, the model's own sampling defaults and any --set over
them, no thinking, the prompt-lookup draft), up to 512 tokens. A reply is right when it holds one
of the question's answers as a whole word, in any case. Prints a line per reply, then the score and
how many replies ran to the token limit.
"""
import argparse
import json
import re
from dataclasses import replace
from pathlib import Path

from nibble.formats.hub import default_model
from nibble.runner import load, stream_generate
from nibble.runner.text.template import build_messages
from nibble.runner.text.reasoning import ThinkingOptions, chat_prompt
from nibble.runner.generation.sample import make_sampler
from nibble.runner.settings import DEFAULT_DRAFT

QUESTIONS = Path(__file__).parent / "data" / "everyday-questions.json"


def seeds(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", help="default: nibble run's")
    p.add_argument("--seeds", type=seeds, default=seeds("0-4"), help="a seed or a range, e.g. 0-4")
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="sampling settings over the model's own (SamplerSettings' fields)")
    p.add_argument("--json", type=Path, help="write every reply here")
    args = p.parse_args()
    over = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    llm, tok = load(args.model or default_model()[0])
    questions = json.loads(QUESTIONS.read_text())["questions"]
    rows = []
    for seed in args.seeds:
        for q in questions:
            text, last = "", None
            prompt, split = chat_prompt(tok, build_messages(q["q"]), ThinkingOptions(think=False))
            sampler = make_sampler(replace(tok.sampling, seed=seed, **over), tok)
            for last in stream_generate(llm, tok, tok.encode(prompt), sampler=sampler, max_tokens=512,
                                        cache=llm.new_cache(4096), draft=DEFAULT_DRAFT, reasoning=split):
                text += last.text
            right = any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", text, re.IGNORECASE) for a in q["answers"])
            rows.append({"seed": seed, "q": q["q"], "right": right, "finish": last.finish_reason,
                         "tokens": last.generation_tokens, "text": text})
            print(f"{'right' if right else 'WRONG'} {last.finish_reason:6} {last.generation_tokens:4} "
                  f"{q['q'][:40]:40} | {text[:80]!r}", flush=True)
    right = sum(r["right"] for r in rows)
    at_limit = sum(r["finish"] == "length" for r in rows)
    print(f"{right}/{len(rows)} right ({right / len(rows):.1%}); {at_limit} ran to the token limit")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
