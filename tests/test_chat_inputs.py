"""Chat data's inputs beyond plain conversations: tool schemas and tool turns rendered as
transformers renders them, each kind of bad record reported with its first file and line,
the CLI's exit status around data.max_bad_fraction, and SentencePiece tokenizers."""

import json
import logging

import numpy as np
import pytest
import yaml

from distill.config import DataConfig
from distill.data.chat import load_template
from distill.data.loader import load_corpus
from distill.data.tokenizers import load_tokenizer
from distill.errors import DistillError
from pipelines.commands.cli import main
from tests.conftest import tiny_config
from tests.test_chat import CONVERSATIONS, _hf, _model_dir, _trained_text, _write_jsonl, bpe
from tests.test_tokenizers import train_spm

__all__ = ["bpe"]  # the tokenizer fixture, shared with tests/test_chat.py

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city."}},
                "required": ["city"],
            },
        },
    }
]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": '{"sky": "clear"}'},
    {"role": "assistant", "content": "Clear."},
]


def test_tools_and_tool_turns_render_as_transformers(tmp_path, bpe):
    """Qwen2.5's template lists the tools in its system prompt and renders tool calls and
    tool turns; the text and ids equal apply_chat_template(..., tools=...)."""
    model_dir = _model_dir(tmp_path / "chatml", bpe, "chatml")
    hf = _hf(model_dir)
    tok = load_tokenizer(str(model_dir))
    template = load_template(DataConfig(source="x", tokenizer=str(model_dir)), tok)
    assert "tool" in template.roles
    for tools in (TOOLS, None):
        for messages in (TOOL_CONVERSATION, CONVERSATIONS[0]):
            text = template.render(messages, tools=tools)
            assert text == hf.apply_chat_template(messages, tools=tools, tokenize=False)
            want = hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)
            ((ids, _),) = tok.encode_offsets([text])
            assert ids.tolist() == list(want["input_ids"])
    assert "get_weather" in template.render(TOOL_CONVERSATION, tools=TOOLS)
    assert "get_weather" not in template.render(CONVERSATIONS[0], tools=None)


def test_tool_records_train_on_the_calls_and_answers(tmp_path, bpe):
    """A record's `tools` (a list, or the same list as a JSON string) reaches the template;
    the loss counts the assistant's tool call and answer, never the tool's response."""
    model_dir = _model_dir(tmp_path / "chatml", bpe, "chatml")
    records = [
        {"messages": TOOL_CONVERSATION, "tools": TOOLS},
        {"messages": TOOL_CONVERSATION, "tools": json.dumps(TOOLS)},
    ] * 3
    source = _write_jsonl(tmp_path / "chat.jsonl", records)
    cfg = DataConfig(source=str(source), format="chat", tokenizer=str(model_dir))
    corpus = load_corpus(cfg, 1024)
    tok, hf = corpus.tokenizer, _hf(model_dir)
    want = hf.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, tokenize=True, return_dict=True)
    seen, whole = [], 0
    for rows in (corpus.train, corpus.eval):
        for r in range(len(rows)):
            seen += _trained_text(tok, rows[r])
            starts = list(np.flatnonzero(rows.starts[r])) + [int(rows.real[r].sum())]
            for a, b in zip(starts[:-1], starts[1:], strict=True):
                whole += rows.ids[r][a:b].tolist() == list(want["input_ids"])
    assert whole == len(records)  # the tools' system prompt is in every conversation
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert sorted(set(seen)) == sorted({call + "<|im_end|>", "Clear.<|im_end|>"})
    assert len(seen) == 2 * len(records)

    renamed = [{"messages": TOOL_CONVERSATION, "functions": TOOLS}] * 2
    source = _write_jsonl(tmp_path / "renamed.jsonl", renamed)
    renamed_cfg = cfg.model_copy(update={"source": str(source), "tools_field": "functions"})
    other = load_corpus(renamed_cfg, 1024)
    assert other.train.ids[0][other.train.real[0]].tolist() == list(want["input_ids"])


BAD = [
    ({"text": "no messages"}, "without the field"),
    ({"messages": []}, "with an empty conversation"),
    ({"messages": [{"content": "no role"}]}, "with a message without a role"),
    ({"messages": [{"role": "user"}]}, "with a message without content"),
    (
        {"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
        "with a role the template does not know ('narrator')",
    ),
    (
        {"messages": [{"role": "user", "content": "no answer"}]},
        "with no assistant turn (data.train_on: assistant)",
    ),
    (
        {"messages": CONVERSATIONS[1], "tools": "not json"},
        "whose tools are not a list of JSON schemas (data.tools_field)",
    ),
]


def _config(tmp_path, source, model_dir, **data):
    tree = tiny_config(str(source), str(tmp_path / "out"))
    tree["data"] = {"source": str(source), "format": "chat", "tokenizer": str(model_dir), **data}
    tree["teacher"]["model"]["vocab_size"] = 320
    tree["train"]["seq_len"] = 128
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def test_each_bad_kind_names_its_first_file_and_line(tmp_path, bpe, capsys, caplog):
    """Two records of every bad kind among good ones: one line per kind naming the first;
    `distill validate` exits 2 past data.max_bad_fraction, 0 under it, 2 when nothing is
    left to train on whatever the fraction."""
    model_dir = _model_dir(tmp_path / "chatml", bpe, "chatml")
    good = [{"messages": CONVERSATIONS[1]}] * 40
    records = good[:20] + [r for r, _ in BAD] + good[20:] + [r for r, _ in BAD]
    source = _write_jsonl(tmp_path / "chat.jsonl", records)
    with pytest.raises(DistillError) as info:
        load_corpus(DataConfig(source=str(source), format="chat", tokenizer=str(model_dir)), 128)
    msg = str(info.value)
    assert len(msg.splitlines()) == 1
    assert msg.startswith(f"data.source: 14 of 54 records of '{source}' are unusable")
    for line, (_, kind) in enumerate(BAD, start=21):
        assert f"2 record(s) {kind} (first: {source} line {line})" in msg, kind

    assert main(["validate", _config(tmp_path, source, model_dir)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(msg)
    with caplog.at_level(logging.WARNING, logger="distill"):
        assert main(["validate", _config(tmp_path, source, model_dir, max_bad_fraction=0.3)]) == 0
    warned = caplog.text
    for line, (_, kind) in enumerate(BAD, start=21):
        assert f"skipped 2 record(s) {kind} (first: {source} line {line})" in warned, kind

    nothing = _write_jsonl(tmp_path / "bad.jsonl", [r for r, _ in BAD])
    assert main(["validate", _config(tmp_path, nothing, model_dir, max_bad_fraction=1.0)]) == 2
    assert "data.source: 7 of 7 records" in capsys.readouterr().err


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory):
    """A SentencePiece model (byte fallback, as Llama 2's) beside a Mistral-style chat
    template, as a model directory without tokenizer.json."""
    root = tmp_path_factory.mktemp("spm")
    texts = [m["content"] for c in CONVERSATIONS for m in c] * 20
    train_spm(
        root / "tokenizer", texts, 300, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
    )  # fmt: skip
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
        "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% elif m['role'] == 'assistant' %}"
        "{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
    )
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>"}
    (root / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return root


def test_sentencepiece_pairs_train_on_the_completion(tmp_path, spm_dir):
    pairs = [{"prompt": f"Say {w}:", "completion": f" {w} héllo"} for w in ("one", "two", "four")]
    source = _write_jsonl(tmp_path / "pairs.jsonl", pairs * 2)
    cfg = DataConfig(source=str(source), format="prompt_completion", tokenizer=str(spm_dir))
    corpus = load_corpus(cfg, 32)
    tok = corpus.tokenizer
    assert tok.kind == "sentencepiece"
    seen = []
    for rows in (corpus.train, corpus.eval):
        b = rows.gather(np.arange(len(rows)))
        for targets, mask in zip(b.targets, b.mask, strict=True):
            trained = targets[mask > 0]
            assert trained[-1] == tok.eos_id
            seen.append(tok.decode(trained[:-1]))
    assert sorted(seen) == sorted(p["completion"].strip() for p in pairs * 2)


def test_sentencepiece_chat_is_refused_in_one_line(tmp_path, spm_dir, capsys):
    """A chat template writes <s> and </s> as text, which SentencePiece would spell out;
    the run is refused before device work, naming the way to a tokenizer.json."""
    source = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    assert main(["validate", _config(tmp_path, source, spm_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"data.tokenizer: {spm_dir / 'tokenizer.model'} is a SentencePiece model" in err
    assert "tokenizer.json" in err


def test_template_saved_by_transformers_beside_the_tokenizer(tmp_path, bpe):
    """transformers 5 saves the template as chat_template.jinja, apart from
    tokenizer_config.json; that file is the one read."""
    hf = _hf(_model_dir(tmp_path / "chatml", bpe, "chatml"))
    saved = tmp_path / "saved"
    hf.save_pretrained(str(saved))
    assert "chat_template" not in json.loads((saved / "tokenizer_config.json").read_text())
    tok = load_tokenizer(str(saved))
    template = load_template(DataConfig(source="x", tokenizer=str(saved)), tok)
    assert template.where == str(saved / "chat_template.jinja")
    want = hf.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, tokenize=False)
    assert template.render(TOOL_CONVERSATION, tools=TOOLS) == want
