"""Chat and instruction data: the model's chat template rendered as transformers renders it,
loss masks on the assistant's tokens, packing that keeps conversations whole, bad records,
prepared corpora, and a run whose answers are learnt while its questions are noise."""

import json
import logging
import random

import numpy as np
import pytest
import yaml

from distill.config import DataConfig
from distill.data.chat import load_template
from distill.data.packing import ExampleRows, best_fit, packing_stats
from distill.data.pipeline import load_corpus
from distill.data.tokenizers import load_tokenizer
from distill.errors import DistillError
from pipelines.commands.cli import main
from tests.conftest import tiny_config

# Qwen2.5-Instruct's template (tokenizer_config.json "chat_template"), as the model ships it.
CHATML = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Meta-Llama-3-8B-Instruct's template, as the model ships it.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] "
    "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# ChatML with transformers' {% generation %} blocks around the answers (as SmolLM3 and the
# TRL docs mark them), for the mask that apply_chat_template itself returns.
CHATML_GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
VOCAB = 300
ANSWER = "The student learns the answer."
TEMPLATES = {
    "chatml": (CHATML, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "generation": (CHATML_GENERATION, {"eos_token": "<|im_end|>"}),
}

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What does the teacher hold?"},
        {"role": "assistant", "content": "A large model."},
        {"role": "user", "content": "  And the student?  "},
        {"role": "assistant", "content": "A small one, it learns on another mesh."},
    ],
    [
        {"role": "user", "content": "Say héllo in bytes: ünïcode ✓"},
        {"role": "assistant", "content": "héllo ✓"},
    ],
    [
        {"role": "system", "content": "Answer twice."},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "four\n"},
        {"role": "user", "content": "five"},
    ],
]


def _train_bpe(texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE tokenizer.json trained here with the chat specials (no download)."""
    texts = [m["content"] for c in CONVERSATIONS for m in c] * 20 + [ANSWER] * 50
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    _train_bpe(texts).save(str(path))
    return path


def _model_dir(root, bpe, name):
    """A model directory as Hugging Face saves one: tokenizer.json and tokenizer_config.json
    with the chat template and the special tokens."""
    template, specials = TEMPLATES[name]
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.json").write_bytes(bpe.read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **specials}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def _hf(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _hf_ids(hf, messages, **kw):
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)
    return out


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ----------------------------------------------------------------------------- rendering


@pytest.mark.parametrize("name", ["chatml", "llama3", "generation"])
def test_template_ids_equal_transformers(tmp_path, bpe, name):
    model_dir = _model_dir(tmp_path / name, bpe, name)
    hf = _hf(model_dir)
    tok = load_tokenizer(str(model_dir / "tokenizer.json"))
    template = load_template(DataConfig(source="x", tokenizer=str(model_dir)), tok)
    for messages in CONVERSATIONS:
        for gen in (False, True):
            text = template.render(messages, add_generation_prompt=gen)
            assert text == hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen
            )
            want = _hf_ids(hf, messages, add_generation_prompt=gen)["input_ids"]
            ((ids, _),) = tok.encode_offsets([text])
            assert ids.tolist() == list(want)
