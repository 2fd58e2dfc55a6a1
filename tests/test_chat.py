"""Chat templates rendered as Hugging Face renders them, checked against llama.cpp's SmolLM2 prompts."""

import pytest

from nibble.formats.errors import NibbleError
from nibble.runner.chat import ChatTemplate, build_messages
from tests.llamacpp import SMOLLM2 as REFERENCE

# llama.cpp's run of SmolLM2-135M-Instruct (tests/data): its GGUF metadata holds the model's chat
# template, and each greedy output the prompt llama.cpp rendered.
SMOLLM2_TEMPLATE = REFERENCE["model_metadata"]["tokenizer.chat_template"]
SMOLLM2_OUTPUTS = REFERENCE["greedy"]["models"]["SmolLM2-135M-Instruct.F32.gguf"]["outputs"]
SMOLLM2_CONFIG = {"chat_template": SMOLLM2_TEMPLATE, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}


@pytest.mark.parametrize("output", SMOLLM2_OUTPUTS, ids=lambda o: o["prompt"][:20])
def test_smollm2_prompt_matches_llamacpp(output):
    template = ChatTemplate.from_tokenizer_config(SMOLLM2_CONFIG)
    assert template.render(build_messages(output["prompt"])) == output["rendered_prompt"]


def test_smollm2_with_a_system_prompt():
    template = ChatTemplate.from_tokenizer_config(SMOLLM2_CONFIG)
    text = template.render(build_messages("Hi", system="Be brief."))
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert not template.render(build_messages("Hi"), add_generation_prompt=False).endswith("assistant\n")


def test_build_messages():
    assert build_messages("q") == [{"role": "user", "content": "q"}]
    assert build_messages("q", system="s") == [{"role": "system", "content": "s"},
                                               {"role": "user", "content": "q"}]


def test_raise_exception_becomes_a_nibble_error():
    template = ChatTemplate("{% if messages[0]['role'] != 'user' %}"
                            "{{ raise_exception('Conversation must start with a user message') }}"
                            "{% endif %}ok")
    assert template.render(build_messages("q")) == "ok"
    with pytest.raises(NibbleError, match="Conversation must start with a user message"):
        template.render(build_messages("q", system="s"))


def test_no_template_says_to_pass_raw():
    with pytest.raises(NibbleError, match="--raw"):
        ChatTemplate.from_tokenizer_config({"eos_token": "</s>"})


def test_syntax_error_is_a_nibble_error():
    with pytest.raises(NibbleError, match="syntax error"):
        ChatTemplate("{% for m in messages %}{{ m.content }}")


def test_named_templates_pick_default_and_added_token_dicts():
    config = {"chat_template": [{"name": "tool_use", "template": "tools"},
                                {"name": "default", "template": "{{ bos_token }}{{ eos_token }}"}],
              "bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>"}
    assert ChatTemplate.from_tokenizer_config(config).render([]) == "<s></s>"
    config["chat_template"] = config["chat_template"][:1] + [{"name": "rag", "template": "x"}]
    with pytest.raises(NibbleError, match="default"):
        ChatTemplate.from_tokenizer_config(config)


def test_hugging_face_environment():
    """trim_blocks/lstrip_blocks, loop controls, HF's tojson, strftime_now, {% generation %}."""
    template = ChatTemplate(
        "{% for m in messages %}\n"
        "  {% if loop.index > 1 %}{% break %}{% endif %}\n"
        "{{ m | tojson }}|{{ strftime_now('%Y') | length }}|"
        "{% generation %}{{ m.content }}{% endgeneration %}\n"
        "{% endfor %}")
    text = template.render([{"role": "user", "content": "café <b>"}, {"role": "user", "content": "x"}])
    assert text == '{"role": "user", "content": "café <b>"}|4|café <b>'


def test_the_sandbox_refuses_mutation():
    template = ChatTemplate("{{ messages.append(1) }}")
    with pytest.raises(NibbleError, match="failed to render"):
        template.render([])
