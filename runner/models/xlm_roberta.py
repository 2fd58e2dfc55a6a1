"""RoBERTa and XLM-RoBERTa (bge-m3, multilingual-e5, bge-reranker): BERT's blocks under another
name. Their positions count from the padding id + 1, as fairseq's did, so position_embeddings holds
that many rows more than a text may take; a single token type."""
from nibble.formats.config import ModelConfig
from nibble.formats.values import integer
from .bert import Bert

_DEFAULTS = dict(Bert.model_types["bert"], pad_token_id=1, bos_token_id=0, eos_token_id=2)


class XLMRoberta(Bert):
    model_types = {"xlm-roberta": _DEFAULTS, "roberta": dict(_DEFAULTS, vocab_size=50265)}
    fields = {**Bert.fields, "pad_token_id": integer()}

    def position_offset(self, c: ModelConfig) -> int:
        return c.pad_token_id + 1
