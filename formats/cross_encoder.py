"""What a reranker's files say of how it scores a query and a document: a cross-encoder reads the
two together and gives one number, its relevance. Three kinds, as sentence-transformers' CrossEncoder
and llama.cpp run them:
- a sequence classifier of one label (config.json's architectures: BertForSequenceClassification,
  ms-marco-MiniLM's; XLMRobertaForSequenceClassification, bge-reranker's; a decoder's
  ...ForSequenceClassification, which scores its last token): its logit;
- Qwen3-Reranker, a causal LM asked whether the document answers the query: the logit of "yes"
  less that of "no" at the last token. Its config.json says only Qwen3ForCausalLM; its model card's
  heading tells it apart, as llama.cpp's converter tells it. A GGUF file says so in its metadata
  (pooling type RANK, its prompt the chat template named "rerank") and holds the rows of "yes"
  and "no" as cls.output.
The score reported is the logit through the activation sentence-transformers applies (config.json's
`sentence_transformers.activation_fn`; a sigmoid where it says none): for Qwen3-Reranker, the
probability of "yes" its model card computes."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import FormatError

# architectures -> how the head reads the blocks' last states (runner/embedding/rerank.py)
CLASSIFIERS = {"BertForSequenceClassification": "pooler",
               "XLMRobertaForSequenceClassification": "dense", "RobertaForSequenceClassification": "dense"}
DECODER_CLASSIFIER = "ForSequenceClassification"   # any other: a decoder's `score` on its last token
ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity",
               "torch.nn.Sigmoid": "sigmoid", "torch.nn.Identity": "identity"}
QWEN3_RERANKER = "# Qwen3-Reranker"   # the card's heading, as llama.cpp's convert_hf_to_gguf.py looks for it
GGUF_RANK = 4   # llama.cpp's LLAMA_POOLING_TYPE_RANK
# the prompt llama.cpp's converter writes for Qwen3-Reranker, around the query and the document
_GGUF_PROMPT = re.compile(r"(.*)<Instruct>: (.*?)\n<Query>: \{query\}\n<Document>: \{document\}(.*)", re.S)


@dataclass(frozen=True)
class Prompt:
    """The text a yes/no reranker reads around a query and a document (Qwen3-Reranker's card)."""
    prefix: str = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
                   "the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
                   "<|im_start|>user\n")
    suffix: str = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    instruction: str = "Given a web search query, retrieve relevant passages that answer the query"
    yes: str = "yes"
    no: str = "no"

    def text(self, query: str, document: str, instruction: str | None = None) -> str:
        return f"<Instruct>: {instruction or self.instruction}\n<Query>: {query}\n<Document>: {document}"


@dataclass(frozen=True)
class Scoring:
    head: str                    # "pooler", "dense", "score" (a classifier's) or "yes-no"
    activation: str = "sigmoid"  # or "identity": logit -> the score reported
    prompt: Prompt | None = None   # a yes/no reranker's


def ranks(path: Path | None) -> bool:
    """Whether the model directory `path` holds a reranker (None, a model in memory or a GGUF
    file: no). Reads config.json and the model card only."""
    return reads_as(path) is not None


def reads_as(path: Path | None) -> str | None:
    """The head of the reranker at `path`, or None for any other model."""
    if path is not None and path.suffix == ".gguf" and path.is_file():
        meta = _gguf_metadata(path)
        arch = meta.get("general.architecture")
        if meta.get(f"{arch}.pooling_type") != GGUF_RANK:
            return None
        return "yes-no" if "tokenizer.chat_template.rerank" in meta else "gguf"   # its prompt: Qwen3-Reranker's
    if path is None or not (path / "config.json").is_file():
        return None
    config = _config(path)
    names = config.get("architectures") or []
    name = names[0] if isinstance(names, list) and names and isinstance(names[0], str) else ""
    if name in CLASSIFIERS:
        return CLASSIFIERS[name]
    if name.endswith(DECODER_CLASSIFIER):
        return "score"
    if name.endswith("ForCausalLM") and _card_says_reranker(path / "README.md"):
        return "yes-no"
    return None


def read_scoring(path: Path) -> Scoring:
    """The Scoring of the reranker at `path` (ranks(path)); FormatError for a classifier nibble
    cannot rank with (more than one label, an activation it does not know)."""
    head = reads_as(path)
    if head is None:
        raise FormatError(f"{path} holds no reranker")
    if path.suffix == ".gguf":
        return _gguf_scoring(path, head)
    config = _config(path)
    if head == "yes-no":
        return Scoring(head, "sigmoid", Prompt())
    labels = config.get("id2label")
    count = len(labels) if isinstance(labels, dict) else config.get("num_labels", 2)
    if count != 1:
        raise FormatError(f"{path / 'config.json'}: a classifier of {count} labels; a reranker scores with one "
                          "(a cross-encoder trained for relevance)")
    settings = config.get("sentence_transformers")
    named = settings.get("activation_fn") if isinstance(settings, dict) else None
    named = named or config.get("sbert_ce_default_activation_function")
    if named is not None and named not in ACTIVATIONS:
        raise FormatError(f"{path / 'config.json'}: nibble scores through a sigmoid or no activation, "
                          f"not {named!r}")
    return Scoring(head, ACTIVATIONS.get(named, "sigmoid"))


def _gguf_scoring(path: Path, head: str) -> Scoring:
    """A GGUF reranker's: Qwen3-Reranker's, its prompt the file's "rerank" template."""
    if head != "yes-no":
        raise FormatError(f"{path}: nibble reranks with GGUF files of Qwen3-Reranker; for a classifier's "
                          "(bge-reranker, ms-marco-MiniLM) run its safetensors (the Hugging Face repo)")
    template = _gguf_metadata(path).get("tokenizer.chat_template.rerank")
    parts = _GGUF_PROMPT.fullmatch(template) if isinstance(template, str) else None
    if parts is None:
        raise FormatError(f"{path}: its rerank template is not Qwen3-Reranker's (<Instruct>, <Query>: {{query}}, "
                          "<Document>: {document})")
    return Scoring(head, "sigmoid", Prompt(prefix=parts[1], instruction=parts[2], suffix=parts[3]))


def _gguf_metadata(path: Path) -> dict:
    from .gguf_header import read_gguf_header
    return read_gguf_header(path).metadata


def max_length(tokenizer_config: dict) -> int | None:
    """The tokens a pair is cut to where the tokenizer says (its model_max_length, which
    transformers sets huge for none)."""
    n = tokenizer_config.get("model_max_length")
    return n if isinstance(n, int) and not isinstance(n, bool) and 0 < n < 1 << 30 else None


def _card_says_reranker(card: Path) -> bool:
    try:
        return card.is_file() and QWEN3_RERANKER in card.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def _config(path: Path) -> dict:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise FormatError(f"{path / 'config.json'} cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise FormatError(f"{path / 'config.json'} must hold a JSON object")
    return config
