"""Chat and instruction data: the model's chat template rendered as transformers renders it,
loss masks on the assistant's tokens, packing that keeps conversations whole, bad records,
prepared corpora, and a run whose answers are learnt while its questions are noise."""

import contextlib
import io
import json
import logging
import random

import numpy as np
import pytest
import yaml

from distill.config import DataConfig
from distill.data.chat import load_template
from distill.data.loader import load_corpus
from distill.data.packing import best_fit, packing_stats
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


def train_bpe(texts, specials=SPECIALS, vocab=VOCAB):
    """A byte-level BPE tokenizer trained on ``texts`` with the ``specials``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
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
    train_bpe(texts).save(str(path))
    return path


def _model_dir(root, bpe, name):
    """The model directory of the template ``name`` of ``TEMPLATES`` (``write_model_dir``)."""
    return write_model_dir(root, bpe, *TEMPLATES[name])


def write_model_dir(root, bpe, template: str, specials: dict):
    """A model directory as Hugging Face saves one: tokenizer.json and tokenizer_config.json
    with the chat template and the special tokens."""
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


# ----------------------------------------------------------------------------- masks


def _example_corpus(tmp_path, model_dir, records, seq_len=64, **data):
    source = _write_jsonl(tmp_path / "chat.jsonl", records)
    cfg = DataConfig(source=str(source), format="chat", tokenizer=str(model_dir), **data)
    return cfg, load_corpus(cfg, seq_len)


def _trained_text(tok, batch_row):
    """The decoded targets the loss counts, one string per run of trained positions."""
    mask = np.asarray(batch_row.mask) > 0
    runs, cur = [], []
    for t, m in zip(np.asarray(batch_row.targets), mask, strict=True):
        if m:
            cur.append(int(t))
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok._tok.decode(r, skip_special_tokens=False) for r in runs]


def test_generation_mask_equals_transformers(tmp_path, bpe):
    model_dir = _model_dir(tmp_path / "gen", bpe, "generation")
    hf = _hf(model_dir)
    tok = load_tokenizer(str(model_dir))
    template = load_template(DataConfig(source="x", tokenizer=str(model_dir)), tok)
    from distill.data.chat import trained_tokens

    for messages in CONVERSATIONS:
        want = _hf_ids(hf, messages, return_assistant_tokens_mask=True)["assistant_masks"]
        text, spans = template.render_spans(messages)
        ((ids, offsets),) = tok.encode_offsets([text])
        assert trained_tokens(offsets, spans).astype(int).tolist() == list(want)


@pytest.mark.parametrize(
    ("name", "eot"),
    [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>"), ("generation", "<|im_end|>")],
)
def test_masks_cover_the_answers_and_their_end_of_turn(tmp_path, bpe, name, eot):
    """Multi-turn conversations with system prompts: the loss counts exactly each assistant
    message's content and the end-of-turn token closing it (Llama-3 trims the content)."""
    model_dir = _model_dir(tmp_path / name, bpe, name)
    records = [{"messages": m} for m in CONVERSATIONS]
    _, corpus = _example_corpus(tmp_path, model_dir, records, seq_len=128, eval_fraction=0.3)
    tok = corpus.tokenizer
    answers = {
        (m["content"].strip() if name == "llama3" else m["content"]) + eot
        for c in CONVERSATIONS
        for m in c
        if m["role"] == "assistant"
    }
    seen = []
    for rows in (corpus.train, corpus.eval):
        for r in range(len(rows)):
            seen += _trained_text(tok, rows[r])
    assert sorted(seen) == sorted(answers)


def test_train_on_all_and_pairs(tmp_path, bpe):
    model_dir = _model_dir(tmp_path / "chatml", bpe, "chatml")
    records = [{"messages": m} for m in CONVERSATIONS]
    _, corpus = _example_corpus(
        tmp_path, model_dir, records, seq_len=128, train_on="all", eval_fraction=0.3
    )
    for rows in (corpus.train, corpus.eval):
        b = rows.gather(np.arange(len(rows)))
        seg = b.segment_ids
        # every target within the same conversation counts; padding and boundaries do not
        same = (seg[:, :-1] > 0) & (seg[:, 1:] == seg[:, :-1])
        assert np.array_equal(b.mask[:, :-1] > 0, same)

    pairs = [{"prompt": f"Q{i}: what is {i}?", "completion": f" It is {i}."} for i in range(6)]
    source = _write_jsonl(tmp_path / "pairs.jsonl", pairs)
    cfg = DataConfig(source=str(source), format="prompt_completion", tokenizer=str(model_dir))
    assert cfg.prompt_field == "prompt"
    corpus = load_corpus(cfg, 64)
    tok = corpus.tokenizer
    seen = []
    for rows in (corpus.train, corpus.eval):
        for r in range(len(rows)):
            seen += _trained_text(tok, rows[r])
    # the completion and the tokenizer's EOS (tokenizer_config.json names <|im_end|>)
    assert sorted(seen) == sorted(f" It is {i}.<|im_end|>" for i in range(6))  # its EOS


# ----------------------------------------------------------------------------- packing


def test_best_fit_keeps_examples_whole():
    lengths = np.array([9, 3, 7, 5, 2, 2, 4, 1])
    rows = best_fit(lengths, cap=10)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(lengths[r].sum() <= 10 for r in rows)
    # longest first, each into the fullest row with room: [9, 1], [7, 3], [5, 4], [2, 2]
    assert [sorted(lengths[r].tolist()) for r in rows] == [[1, 9], [3, 7], [4, 5], [2, 2]]


def _random_text(rng, n):
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))


def test_packing_never_splits_a_conversation(tmp_path, bpe):
    model_dir = _model_dir(tmp_path / "chatml", bpe, "chatml")
    rng = random.Random(0)
    records = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": _random_text(rng, rng.randint(2, 40))},
                {"role": "assistant", "content": ANSWER},
            ]
        }
        for _ in range(40)
    ]
    cfg, corpus = _example_corpus(tmp_path, model_dir, records, seq_len=128, eval_fraction=0.1)
    rows = corpus.train
    tok = corpus.tokenizer
    texts = [
        load_template(cfg, tok).render(r["messages"]) for r in records
    ]  # every conversation's ids, found whole in exactly one row
    found = 0
    for text in texts:
        ((ids, _),) = tok.encode_offsets([text])
        for split in (corpus.train, corpus.eval):
            for r in range(len(split)):
                seg_ids = split.ids[r][split.real[r]]
                starts = np.flatnonzero(split.starts[r])
                bounds = list(starts) + [int(split.real[r].sum())]
                pieces = [
                    seg_ids[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)
                ]
                found += pieces.count(ids.tolist())
    assert found == len(records)
    stats = packing_stats(rows)
    b = rows.gather(np.arange(len(rows)))
    real = (b.segment_ids > 0).sum()
    assert stats["real_fraction"] == pytest.approx(
        (rows.real[:, 1:]).sum() / (len(rows) * rows.seq_len)
    )
    assert stats["trained_fraction"] == pytest.approx(b.mask.sum() / rows.real[:, 1:].sum())
    assert 0.8 < stats["real_fraction"] <= 1.0 and real > 0
    assert stats["longer_than_row"] == 0


def test_long_conversations_cut_or_split(tmp_path, bpe, caplog):
    model_dir = _model_dir(tmp_path / "gen", bpe, "generation")
    long = [
        {"role": "user", "content": "q " * 40},
        {"role": "assistant", "content": (ANSWER + " ") * 12},
    ]
    records = [{"messages": long}] * 3 + [{"messages": CONVERSATIONS[1]}] * 3
    with caplog.at_level(logging.WARNING, logger="distill"):
        _, cut = _example_corpus(tmp_path, model_dir, records, seq_len=48, eval_fraction=0.3)
    assert "were cut to one row" in caplog.text
    assert cut.train.num_long + cut.eval.num_long == 3
    _, split = _example_corpus(
        tmp_path, model_dir, records, seq_len=48, eval_fraction=0.3, long_conversations="split"
    )
    trained = lambda c: sum(r.gather(np.arange(len(r))).mask.sum() for r in (c.train, c.eval))
    assert trained(split) > trained(cut)


# ----------------------------------------------------------------------------- bad input


def test_bad_records_are_counted_and_refused_only_when_too_many(tmp_path, bpe, caplog, capsys):
    model_dir = _model_dir(tmp_path / "chatml", bpe, "chatml")
    good = [{"messages": CONVERSATIONS[1]}] * 20
    bad = [
        {"text": "no messages"},
        {"messages": []},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user"}]},
        {"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "no answer"}]},
    ]
    source = tmp_path / "chat.jsonl"
    _write_jsonl(source, good + bad)
    with open(source, "a") as f:
        f.write("{not json\n")
    cfg = dict(source=str(source), format="chat", tokenizer=str(model_dir))
    with pytest.raises(DistillError) as info:
        load_corpus(DataConfig(**cfg), 128)
    msg = str(info.value)
    assert len(msg.splitlines()) == 1
    assert msg.startswith("data.source: 7 of 27 records") and "max_bad_fraction=0.01" in msg
    for kind in (
        "without the field (first: ",
        "with an empty conversation",
        "without a role",
        "without content",
        "('narrator')",
        "with no assistant turn",
        f"not valid JSON (first: {source} line 27)",
    ):
        assert kind in msg
    # the CLI: exit 2 before any device work, the same one line
    tree = tiny_config(str(source), str(tmp_path / "out"), data=cfg)
    tree["data"].pop("include")
    tree["teacher"]["model"]["vocab_size"] = 320
    tree["train"]["seq_len"] = 128
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(tree))
    assert main(["validate", str(tmp_path / "cfg.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(msg), err

    with caplog.at_level(logging.WARNING, logger="distill"):
        corpus = load_corpus(DataConfig(**cfg, max_bad_fraction=0.5), 128)
    assert corpus.train.num_documents + corpus.eval.num_documents == 20
    assert f"1 record(s) without the field (first: {source} line 21)" in caplog.text
    # train_on: all keeps the conversation without an answer
    corpus = load_corpus(DataConfig(**cfg, max_bad_fraction=0.5, train_on="all"), 128)
    assert corpus.train.num_documents + corpus.eval.num_documents == 21


def test_template_that_fails_is_a_bad_record_naming_file_and_record(tmp_path, bpe):
    model_dir = _model_dir(tmp_path / "chatml", bpe, "chatml")
    template = tmp_path / "strict.jinja"
    template.write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    )
    records = [{"messages": CONVERSATIONS[1]}, {"messages": CONVERSATIONS[0]}]
    source = _write_jsonl(tmp_path / "chat.jsonl", records)
    cfg = DataConfig(
        source=str(source), format="chat", tokenizer=str(model_dir), chat_template=str(template)
    )
    with pytest.raises(DistillError) as info:
        load_corpus(cfg, 64)
    msg = str(info.value)  # a bad record: 1 of 2 is past data.max_bad_fraction
    assert len(msg.splitlines()) == 1 and msg.startswith("data.source: 1 of 2 records")
    want = f"1 record(s) that {template} fails to render (System role not supported)"
    assert f"{want} (first: {source} line 2)" in msg


# ----------------------------------------------------------------------------- prepare


def test_prepare_writes_the_masks_with_the_rows(tmp_path, bpe):
    from distill.config.load import load_config
    from pipelines.commands.prepare import prepare

    model_dir = _model_dir(tmp_path / "chatml", bpe, "chatml")
    records = [{"messages": c} for c in CONVERSATIONS] * 4
    source = _write_jsonl(tmp_path / "chat.jsonl", records)
    data = {"source": str(source), "format": "chat", "tokenizer": str(model_dir)}
    tree = tiny_config(str(source), str(tmp_path / "out"), data=data)
    tree["data"].pop("include")
    tree["data"]["prepared_dir"] = str(tmp_path / "prepared")
    tree["train"]["seq_len"] = 128
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tree))
    cfg = load_config(str(path))
    summary = prepare(cfg)
    assert 0 < summary["packing"]["trained_fraction"] < summary["packing"]["real_fraction"] <= 1
    stored = load_corpus(cfg.data, cfg.train.seq_len)
    cfg.data.prepared_dir = None
    memory = load_corpus(cfg.data, cfg.train.seq_len)
    for a, b in ((stored.train, memory.train), (stored.eval, memory.eval)):
        rows = np.arange(len(b))
        for x, y in zip(a.gather(rows), b.gather(rows), strict=True):
            np.testing.assert_array_equal(x, y)
    cfg.data.train_on = "all"
    cfg.data.prepared_dir = str(tmp_path / "prepared")
    with pytest.raises(DistillError, match="data.train_on: 'all' differs from 'assistant'"):
        load_corpus(cfg.data, cfg.train.seq_len)


# ----------------------------------------------------------------------------- a run


def _bootstrap_ce(tmp_path, source, model_dir, train_on, caplog):
    """The last CE of the teacher bootstrap (a CE-only run of the loop) on ``source``, the
    config it ran with and its corpus."""
    from distill.config.load import load_config
    from pipelines.bootstrap import bootstrap_teacher

    data = {"source": str(source), "format": "chat", "tokenizer": str(model_dir)}
    tree = tiny_config(str(source), str(tmp_path / f"out-{train_on}"), data=data)
    tree["data"].pop("include")
    tree["data"].update(train_on=train_on, eval_fraction=0.2)
    tree["teacher"]["model"]["vocab_size"] = 320
    tree["teacher"].update(pretrain_steps=60, pretrain_lr=1e-2)
    tree["train"].update(seq_len=64, batch_size=8, log_every=60)
    path = tmp_path / f"{train_on}.yaml"
    path.write_text(yaml.safe_dump(tree))
    cfg = load_config(str(path))
    cfg.resolve_dtypes("cpu")
    corpus = load_corpus(cfg.data, cfg.train.seq_len)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="distill"):
        bootstrap_teacher(cfg, corpus)
    (line,) = [r.getMessage() for r in caplog.records if "bootstrap step 60/60" in r.getMessage()]
    return float(line.rsplit(" ", 1)[1]), cfg, corpus


def _held_out_ce(cfg, corpus):
    """The bootstrapped teacher's mean CE over the eval rows' masked targets, and how many
    targets count: what the evaluation's teacher_loss averages."""
    import jax
    import jax.numpy as jnp

    from distill.checkpoint import load_params
    from distill.models import model
    from distill.outputs import teacher_path

    mcfg = cfg.teacher.model
    params = load_params(teacher_path(cfg), model.abstract_params(mcfg))
    b = corpus.eval.gather(np.arange(len(corpus.eval)))
    logits = model.apply(mcfg, params, b.tokens, b.segment_ids, b.positions)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), b.targets[..., None], -1)[..., 0]
    return float((nll * b.mask).sum() / b.mask.sum()), int(b.mask.sum())


def test_answers_are_learnt_and_questions_are_not_counted(tmp_path, bpe, caplog):
    """User turns are random strings, every answer the same sentence: a CE-only run on the
    assistant's tokens reaches a near-zero loss, on its training rows and on held-out
    conversations whose questions it never saw; the same run on every token cannot."""
    model_dir = _model_dir(tmp_path / "gen", bpe, "generation")
    rng = random.Random(1)
    records = [
        {
            "messages": [
                {"role": "user", "content": _random_text(rng, rng.randint(6, 16))},
                {"role": "assistant", "content": ANSWER},
            ]
        }
        for _ in range(64)
    ]
    source = _write_jsonl(tmp_path / "chat.jsonl", records)
    answers, cfg, corpus = _bootstrap_ce(tmp_path, source, model_dir, "assistant", caplog)
    everything, _, _ = _bootstrap_ce(tmp_path, source, model_dir, "all", caplog)
    assert answers < 0.1 and everything > 0.5, (answers, everything)
    held_out, counted = _held_out_ce(cfg, corpus)
    tok = corpus.tokenizer
    answer_tokens = len(tok.encode(ANSWER + "<|im_end|>"))
    assert counted == corpus.eval.num_documents * answer_tokens  # the answers, nothing else
    assert held_out < 0.1, held_out

    # `distill generate --chat` wraps a new question as a user turn and prints the answer
    from distill import outputs

    outputs.write_config(cfg)
    out = cfg.run.output_dir
    args = ["generate", out, "--chat", "--teacher", "--temperature", "0", "--json"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main([*args, "--prompt", "qwzx plk", "--max-new-tokens", "24"]) == 0
    (sample,) = [json.loads(x) for x in buf.getvalue().splitlines() if x.startswith("{")]
    assert sample["stopped"] and sample["completion"] == ANSWER, sample


# ----------------------------------------------------------------------------- on-policy


def test_on_policy_prompts_are_conversations_up_to_the_last_answer(tmp_path, bpe):
    from distill.config.load import load_config
    from distill.data.prompts import prompt_set

    model_dir = _model_dir(tmp_path / "llama3", bpe, "llama3")
    hf = _hf(model_dir)
    records = [{"messages": c} for c in CONVERSATIONS]
    source = _write_jsonl(tmp_path / "chat.jsonl", records)
    data = {"source": str(source), "format": "chat", "tokenizer": str(model_dir)}
    tree = tiny_config(str(source), str(tmp_path / "out"), data=data)
    tree["data"].pop("include")
    tree["distill"] = {"on_policy": {"fraction": 1.0, "prompt_len": 64}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tree))
    cfg = load_config(str(path))
    prompts = prompt_set(cfg, load_tokenizer(str(model_dir)))
    got = set()
    for i in range(len(CONVERSATIONS)):
        keep = prompts.segment_ids[i] > 0
        got.add(tuple(prompts.tokens[i][keep].tolist()))
        assert prompts.positions[i][keep][-1] >= keep.sum() - 1
    want = set()
    for c in CONVERSATIONS:
        last = max(i for i, m in enumerate(c) if m["role"] == "assistant")
        ids = _hf_ids(hf, c[:last], add_generation_prompt=True)["input_ids"]
        want.add(tuple(list(ids)[-64:]))  # a prompt keeps its last prompt_len tokens
    assert got == want


@pytest.mark.slow  # a full run with sampling: 50 s on two shared cores
def test_on_policy_run_on_chat(tmp_path, bpe):
    """A distillation whose every step continues the conversations' prompts."""
    from tests.conftest import read_train

    model_dir = _model_dir(tmp_path / "gen", bpe, "generation")
    records = [{"messages": c} for c in CONVERSATIONS] * 8
    source = _write_jsonl(tmp_path / "chat.jsonl", records)
    out = tmp_path / "out"
    data = {"source": str(source), "format": "chat", "tokenizer": str(model_dir)}
    on_policy = {"fraction": 1.0, "prompt_len": 48, "max_new_tokens": 8}
    tree = tiny_config(str(source), str(out), data=data, distill={"on_policy": on_policy})
    tree["data"].pop("include")
    tree["teacher"]["model"]["vocab_size"] = 320
    tree["train"].update(steps=2, seq_len=64, log_every=1, eval_every=2)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tree))
    assert main(["run", str(path)]) == 0
    train = read_train(out)
    assert train and all(r["on_policy"] == 1.0 and np.isfinite(r["loss"]) for r in train)


def test_evaluation_samples_answer_the_held_out_conversations(tmp_path, bpe):
    from distill.data.prompts import answer_prompts

    model_dir = _model_dir(tmp_path / "gen", bpe, "generation")
    records = [{"messages": c} for c in CONVERSATIONS] * 4
    _, corpus = _example_corpus(tmp_path, model_dir, records, seq_len=128, eval_fraction=0.3)
    tok = corpus.tokenizer
    rows = corpus.eval.gather(np.arange(len(corpus.eval)))
    prompts = answer_prompts(rows, 40)
    for i in range(len(corpus.eval)):
        keep = prompts.segment_ids[i] > 0
        text = tok._tok.decode(prompts.tokens[i][keep].tolist(), skip_special_tokens=False)
        assert text.endswith("<|im_start|>assistant\n"), text
        first = int(np.argmax(rows.mask[i]))  # the prompt's last token predicts the answer
        assert prompts.tokens[i][-1] == rows.tokens[i][first]


def test_parquet_records_and_a_template_that_rewrites_earlier_turns(tmp_path, bpe):
    import pyarrow as pa
    import pyarrow.parquet as pq

    model_dir = _model_dir(tmp_path / "llama3", bpe, "llama3")
    table = pa.table({"conv": [c for c in CONVERSATIONS] * 2, "other": list(range(6))})
    pq.write_table(table, tmp_path / "chat.parquet")
    cfg = DataConfig(
        source=str(tmp_path / "chat.parquet"),
        format="chat",
        messages_field="conv",
        tokenizer=str(model_dir),
    )
    jsonl = _write_jsonl(tmp_path / "chat.jsonl", [{"conv": c} for c in CONVERSATIONS] * 2)
    a, b = load_corpus(cfg, 128), load_corpus(cfg.model_copy(update={"source": str(jsonl)}), 128)
    for x, y in ((a.train, b.train), (a.eval, b.eval)):
        assert np.array_equal(x.ids, y.ids) and np.array_equal(x.train, y.train)

    # a template whose text before a turn depends on the turns after it (here: the count)
    counting = tmp_path / "counting.jinja"
    counting.write_text(
        "{{ messages|length }}\\n{% for m in messages %}{{ m['role'] + ': ' + m['content'] + "
        "'\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(DistillError) as info:
        load_corpus(cfg.model_copy(update={"chat_template": str(counting)}), 128)
    msg = str(info.value)
    assert len(msg.splitlines()) == 1 and f"{counting} fails to render" in msg
    assert "row 0" in msg and "{% generation %}" in msg
