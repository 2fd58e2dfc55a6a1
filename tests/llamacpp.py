"""llama.cpp's figures for SmolLM2-135M-Instruct, kept in tests/data (where they came from: data/README.md)."""
import json
from pathlib import Path

DATA = Path(__file__).parent / "data"
SMOLLM2 = json.loads((DATA / "smollm2-llamacpp.json").read_text())        # greedy, tokenize, perplexity, speed
TOKENIZER = json.loads((DATA / "tokenizer-llamacpp.json").read_text())    # awkward strings, the pydoc corpus
