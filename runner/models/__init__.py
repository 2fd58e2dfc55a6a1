"""The model families, one class each in a module of its own, as mlx-lm's models/. A family
subclasses base.Transformer (Llama's block, and what every family's blocks share) or another
family (`class Mixtral(Llama)`), overriding what differs: its class attributes and rules
(formats.families.Family) are what the file readers know of it, its methods how its checkpoints'
tensors become its blocks' weights and how calibration and quantize see them. runner/model.py
runs any of them; switch_layers.py is no family but the machinery every mixture of experts shares
(mlx-lm's switch_layers.py). FAMILIES, the table below, is how a model_type finds its family.
"""
from nibble.formats import families
from nibble.formats.config import ModelConfig
from .base import Transformer
from .bert import Bert
from .gemma3 import Gemma3
from .gpt_oss import GptOss
from .granitemoe import GraniteMoe
from .llama import Llama
from .mixtral import Mixtral
from .olmoe import Olmoe
from .phi3 import Phi3
from .qwen3_moe import Qwen3Moe
from .xlm_roberta import XLMRoberta

FAMILIES = (Bert(), Gemma3(), GptOss(), GraniteMoe(), Llama(), Mixtral(), Olmoe(), Phi3(), Qwen3Moe(), XLMRoberta())
for _family in FAMILIES:
    families.add(_family)


def family(config: ModelConfig) -> Transformer:
    """The family that runs `config`'s model_type."""
    return families.of(config.model_type)
