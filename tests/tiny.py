"""A tiny seeded random model of each supported type, built at test time."""

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from nibble.formats.config import ModelConfig
from nibble.formats.model_dir import ModelDir
from nibble.runner.measure.synthetic import CHATML, byte_level_tokenizer

TEXT = ("The quick brown fox jumps over the lazy dog. Numba compiles Python to machine code. "
        "A small model answers questions about the sky, the sea and the capital of France. "
        "naïve café 東京 😀 — code: def f(x): return x**2\n") * 4


def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE with ChatML special tokens, trained on a few sentences."""
    return byte_level_tokenizer(TEXT, vocab_size=320)


def tiny_config(model_type="llama", vocab_size=320, **overrides) -> ModelConfig:
    d = dict(model_type=model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size, rms_norm_eps=1e-5,
             rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=model_type == "llama",
             bos_token_id=1, eos_token_id=2)
    if model_type == "mistral":
        d["sliding_window"] = 8
    if model_type == "qwen3":
        d["head_dim"] = 32   # explicit, and not hidden_size / heads, as in Qwen3's own configs
    if model_type == "gemma3_text":
        # a window of 4 in layer 0, the global layer 1 with its own theta and a linear scaling;
        # scores scaled by 1/sqrt(24), not 1/sqrt(head_dim); sqrt(128) = 11.3137 (the embedding
        # scale) is 11.3125 in bf16 and f16
        d |= dict(hidden_size=128, head_dim=32, query_pre_attn_scalar=24, sliding_window=4,
                  sliding_window_pattern=2,
                  rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
                  tie_word_embeddings=True)
    if model_type == "phi3":   # Phi-4-mini's RoPE: 3/4 of each head, longrope from position 16
        d |= {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 16,
              "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 3.0],
                               "long_factor": [1.0, 2.0, 3.0, 4.0, 6.0, 8.0]}}
    if model_type == "smollm3":
        d["no_rope_layers"] = [1, 0]   # RoPE in the first layer only
    d.update(overrides)
    return ModelConfig.from_dict(d)


def tiny_tensors(config: ModelConfig, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    c = config
    D, F, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q_dim, kv_dim = c.num_attention_heads * hd, c.num_key_value_heads * hd
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    norm = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    t = {"model.embed_tokens.weight": w(c.vocab_size, D), "model.norm.weight": norm(D)}
    if not c.tie_word_embeddings:
        t["lm_head.weight"] = w(c.vocab_size, D)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": norm(D), p + "post_attention_layernorm.weight": norm(D),
              p + "self_attn.q_proj.weight": w(q_dim, D), p + "self_attn.k_proj.weight": w(kv_dim, D),
              p + "self_attn.v_proj.weight": w(kv_dim, D), p + "self_attn.o_proj.weight": w(D, q_dim),
              p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D),
              p + "mlp.down_proj.weight": w(D, F)}
        if c.model_type in ("qwen3", "gemma3_text"):
            t |= {p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)}
        if c.model_type == "gemma3_text":
            t |= {p + "pre_feedforward_layernorm.weight": norm(D),
                  p + "post_feedforward_layernorm.weight": norm(D)}
        if c.attention_bias:
            t |= {p + "self_attn.q_proj.bias": w(q_dim), p + "self_attn.k_proj.bias": w(kv_dim),
                  p + "self_attn.v_proj.bias": w(kv_dim)}
        if c.model_type == "phi3":   # q/k/v stored as one matrix, gate/up as another
            t[p + "self_attn.qkv_proj.weight"] = np.concatenate(
                [t.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            t[p + "mlp.gate_up_proj.weight"] = np.concatenate(
                [t.pop(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
    return t


def tiny_model_dir(model_type="llama", seed=0) -> ModelDir:
    tok = tiny_tokenizer()
    config = tiny_config(model_type, vocab_size=tok.get_vocab_size())
    return ModelDir(path=None, config=config, tensors=tiny_tensors(config, seed), tokenizer=tok,
                    tokenizer_config={"chat_template": CHATML, "bos_token": "<|im_start|>",
                                      "eos_token": "<|im_end|>", "add_bos_token": False},
                    generation_config={"eos_token_id": 2})


FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


def tiny_coder_dir(seed=0) -> ModelDir:
    """The tiny model with Qwen2.5-Coder's fill-in-the-middle tokens in its vocabulary."""
    tok = tiny_tokenizer()
    tok.add_special_tokens(FIM)
    config = tiny_config(vocab_size=tok.get_vocab_size())
    return ModelDir(path=None, config=config, tensors=tiny_tensors(config, seed), tokenizer=tok,
                    tokenizer_config={"chat_template": CHATML, "bos_token": "<|im_start|>",
                                      "eos_token": "<|im_end|>", "add_bos_token": False},
                    generation_config={"eos_token_id": 2})


# Sampling defaults as a publisher writes them in generation_config.json (the sampled_dir fixture).
SAMPLING = {"do_sample": True, "temperature": 0.3, "top_k": 5, "top_p": 0.7}


TEMPLATES = Path(__file__).parent / "data" / "templates"


def tiny_with_template(template: str, model_type="llama", seed=0) -> ModelDir:
    """The tiny model with a published chat template (a file in tests/data/templates): a thinking
    model's, say. DeepSeek-R1's opens the reply's <think> block in the prompt, so that every
    token the random model samples is thinking until a budget ends it."""
    model = tiny_model_dir(model_type, seed)
    model.tokenizer_config = {**model.tokenizer_config, "chat_template": (TEMPLATES / template).read_text(),
                              "bos_token": "<|im_start|>"}
    return model


VISION = Path(__file__).parent / "data" / "vision"


def write_tiny_vision(out: Path, family: str = "gemma3") -> Path:
    """A tiny random vision-language model of tests/data/vision as a model directory that runs,
    with its family's chat template: Gemma 3 (its checkpoint, and a byte-level tokenizer whose
    ids 297-299 are the fixture's <start_of_image>, <end_of_image> and <image_soft_token>), or
    Idefics3 (SmolVLM's kind: its folder as it is, and SmolVLM's template), or Qwen2.5-VL (its
    folder as it is)."""
    import shutil
    if family == "qwen2_5_vl":   # its folder holds Qwen2-VL's template
        return Path(shutil.copytree(VISION / "qwen2_5_vl", out))
    if family == "idefics3":
        shutil.copytree(VISION / "idefics3", out)
        config = json.loads((out / "tokenizer_config.json").read_text())
        config["chat_template"] = (TEMPLATES / "HuggingFaceTB-SmolVLM-256M-Instruct.jinja").read_text()
        (out / "tokenizer_config.json").write_text(json.dumps(config))
        return out
    out.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(VISION / "gemma3" / name, out / name)
    tokenizer = byte_level_tokenizer(TEXT, vocab_size=297)
    assert tokenizer.get_vocab_size() == 297
    tokenizer.add_special_tokens(["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": (TEMPLATES / "google-gemma-3-4b-it.jinja").read_text(),
        "bos_token": "<|im_end|>", "eos_token": "<|im_start|>", "add_bos_token": False}))
    return out
