"""Conversations through each shipped family's chat template as the model ships it
(tests/data/chat_templates/): Qwen3 (reasoning, enable_thinking, tools), Qwen2.5, Llama 3.0
and 3.2, Gemma 3, Mistral Nemo. Each example's token ids equal transformers'
``apply_chat_template`` of the same turns, and the trained tokens of each answer are the
ones after ``apply_chat_template(turns before it, add_generation_prompt=True)`` up to its
end-of-turn token; a conversation a template cannot render is a counted bad record."""

import logging
from pathlib import Path

import numpy as np
import pytest

from distill.config import DataConfig
from distill.data.chat import load_template, trained_tokens
from distill.data.loader import load_corpus
from distill.data.tokenizers import load_tokenizer
from distill.errors import DistillError
from tests.test_chat import (
    CHATML,
    CONVERSATIONS,
    LLAMA3,
    _hf,
    _trained_text,
    _write_jsonl,
    train_bpe,
    write_model_dir,
)
from tests.test_chat_inputs import TOOL_CONVERSATION, TOOLS

SHIPPED = Path(__file__).parent / "data" / "chat_templates"
SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>",
    "<s>", "</s>", "[INST]", "[/INST]",
]  # fmt: skip
FAMILIES = {  # name: (template text, the special tokens its tokenizer_config.json names)
    "qwen3": ((SHIPPED / "qwen3.jinja").read_text(), {"eos_token": "<|im_end|>"}),
    "qwen2.5": (CHATML, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "llama3.2": (
        (SHIPPED / "llama3.2.jinja").read_text(),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    ),
    "gemma3": ((SHIPPED / "gemma3.jinja").read_text(),
               {"bos_token": "<bos>", "eos_token": "<eos>"}),
    "mistral": ((SHIPPED / "mistral-nemo.jinja").read_text(),
                {"bos_token": "<s>", "eos_token": "</s>"}),
}  # fmt: skip
END_OF_TURN = {"<|im_end|>", "<|eot_id|>", "<end_of_turn>", "</s>"}

REASONING = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What does the teacher hold?"},
    {"role": "assistant", "content": "A large model.", "reasoning_content": "It is big."},
    {"role": "user", "content": "And the student?"},
    {"role": "assistant", "content": "A small one.", "reasoning_content": "\nIt is small.\n"},
]
INLINE = [  # the reasoning inside the content, as Qwen3 writes it
    {"role": "user", "content": "Two plus two?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\nFour."},
    {"role": "user", "content": "Times three?"},
    {"role": "assistant", "content": "<think>\nMultiply.\n</think>\n\nTwelve."},
]
PLAIN = CONVERSATIONS  # multi-turn with a system prompt; one turn; one ending on a user turn
ALL = {"reasoning": REASONING, "inline": INLINE, **{f"plain{i}": c for i, c in enumerate(PLAIN)}}


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE tokenizer.json with every family's specials, trained here."""
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    texts = [m["content"] for c in ALL.values() for m in c] * 20
    train_bpe(texts, SPECIALS, 320).save(str(path))
    return path


def model_dir(root: Path, bpe: Path, family: str) -> Path:
    """A model directory as Hugging Face saves one, with ``family``'s shipped template."""
    return write_model_dir(root, bpe, *FAMILIES[family])


def _reference(hf, messages, tools, kwargs):
    """From transformers' token ids alone: the examples of ``messages`` (the whole
    conversation when each answer's ids continue it, else one per answer, through it) and
    each one's trained positions: those after apply_chat_template(turns before the answer,
    add_generation_prompt=True), through the answer's end-of-turn token."""

    def ids(msgs, gen=False):
        out = hf.apply_chat_template(
            msgs, tools=tools, add_generation_prompt=gen, tokenize=True, return_dict=True, **kwargs
        )
        return list(out["input_ids"])

    whole = ids(messages)
    answers = []
    for i in [i for i, m in enumerate(messages) if m["role"] == "assistant"]:
        head, through = ids(messages[:i], gen=True), ids(messages[: i + 1])
        assert through[: len(head)] == head, (i, hf.decode(head), hf.decode(through))
        end = len(through)
        while hf.decode(through[end - 1 :]).strip() == "":  # whitespace after the turn
            end -= 1
        assert hf.convert_ids_to_tokens(through[end - 1]) in END_OF_TURN
        answers.append((through, len(head), end))
    if all(whole[: len(t)] == t for t, _, _ in answers):
        mask = np.zeros(len(whole), bool)
        for _, a, b in answers:
            mask[a:b] = True
        return [(whole, mask)]
    out = []
    for through, a, b in answers:
        mask = np.zeros(len(through), bool)
        mask[a:b] = True
        out.append((through, mask))
    return out


CASES = [  # (family, conversation, tools, template variables, examples made)
    *[("qwen3", name, None, {}, 2 if name in ("reasoning", "inline", "plain0", "plain2") else 1)
      for name in ALL],
    ("qwen3", "plain0", None, {"enable_thinking": False}, 2),
    ("qwen3", "plain1", None, {"enable_thinking": True}, 1),
    ("qwen3", "tools", TOOLS, {}, 2),
    *[(family, name, None, {}, 1) for family in ("qwen2.5", "llama3", "llama3.2", "gemma3")
      for name in ALL],
    ("qwen2.5", "tools", TOOLS, {}, 1),
    ("llama3.2", "tools", None, {}, 1),
    ("mistral", "plain1", None, {}, 1),
    ("mistral", "inline", None, {}, 1),
]  # fmt: skip


@pytest.mark.parametrize(("family", "name", "tools", "kwargs", "made"), CASES)
def test_examples_equal_transformers(tmp_path, bpe, family, name, tools, kwargs, made):
    """Each example's ids are apply_chat_template's of its turns; its trained tokens are
    the answers' as transformers' own renderings place them. Qwen3 makes one example per
    answer of a multi-turn conversation (its template drops an earlier answer's reasoning
    once a user turn follows); the other families one per conversation."""
    messages = TOOL_CONVERSATION if name == "tools" else ALL[name]
    root = model_dir(tmp_path / family, bpe, family)
    hf, tok = _hf(root), load_tokenizer(str(root))
    cfg = DataConfig(source="x", tokenizer=str(root), chat_template_kwargs=kwargs or None)
    examples = load_template(cfg, tok).render_examples(messages, tools)
    want = _reference(hf, messages, tools, kwargs)
    assert len(examples) == len(want) == made
    for (text, spans), (ids, mask) in zip(examples, want, strict=True):
        ((got, offsets),) = tok.encode_offsets([text])
        assert got.tolist() == ids
        assert trained_tokens(offsets, spans).tolist() == mask.tolist()


def test_qwen3_answers_keep_their_reasoning(tmp_path, bpe):
    """Each answer of a multi-turn Qwen3 conversation is trained with its reasoning, after
    the turns before it rendered as the model sees them when it answers (the earlier answer
    without its reasoning); the whole conversation renders as transformers renders it."""
    root = model_dir(tmp_path / "qwen3", bpe, "qwen3")
    tok = load_tokenizer(str(root))
    template = load_template(DataConfig(source="x", tokenizer=str(root)), tok)
    (first, [a]), (second, [b]) = template.render_examples(REASONING)
    assert first[slice(*a)] == "<think>\nIt is big.\n</think>\n\nA large model.<|im_end|>"
    assert second[slice(*b)] == "<think>\nIt is small.\n</think>\n\nA small one.<|im_end|>"
    assert second == _hf(root).apply_chat_template(REASONING, tokenize=False)
    assert "It is big." not in second and second[: b[0]].endswith("<|im_start|>assistant\n")


def test_qwen3_corpus_holds_each_record_whole(tmp_path, bpe, caplog):
    """A Qwen3 corpus of multi-turn conversations: one example per answer, the answers (with
    their reasoning) trained, a record's examples all on one side of the held-out split."""
    root = model_dir(tmp_path / "qwen3", bpe, "qwen3")
    records = [{"messages": _numbered(c, k)} for k, c in enumerate([REASONING, INLINE, *PLAIN] * 4)]
    source = _write_jsonl(tmp_path / "chat.jsonl", records)
    cfg = DataConfig(source=str(source), format="chat", tokenizer=str(root), eval_fraction=0.3)
    corpus = load_corpus(cfg, 128)
    per_record = [2, 2, 2, 1, 2] * 4
    assert corpus.train.num_documents + corpus.eval.num_documents == sum(per_record)
    tok = corpus.tokenizer
    seen = [t for rows in (corpus.train, corpus.eval) for r in range(len(rows))
            for t in _trained_text(tok, rows[r])]  # fmt: skip
    assert sorted(set(seen)) == sorted({
        "<think>\nIt is big.\n</think>\n\nA large model.<|im_end|>",
        "<think>\nIt is small.\n</think>\n\nA small one.<|im_end|>",
        "<think>\nAdd them.\n</think>\n\nFour.<|im_end|>",
        "<think>\nMultiply.\n</think>\n\nTwelve.<|im_end|>",
        *(f"<think>\n\n</think>\n\n{m['content']}<|im_end|>"
          for c in PLAIN for m in c if m["role"] == "assistant"),
    })  # fmt: skip
    # a record's examples (each holding its first user turn) land on one side
    held = "".join(
        tok._tok.decode(rows.ids[r][rows.real[r]].tolist(), skip_special_tokens=False)
        for rows in (corpus.eval,)
        for r in range(len(rows))
    )
    counts = [held.count(f" #{k}<|im_end|>") for k in range(len(records))]
    assert all(n in (0, m) for n, m in zip(counts, per_record, strict=True)), counts
    assert 2 in counts and 0 in counts


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_train_on_all_keeps_each_conversation_whole(tmp_path, bpe, family):
    """data.train_on: all trains on every token of the conversation as the whole renders it:
    one example per record, never split, even where no answer can be placed (Mistral with a
    system message)."""
    root = model_dir(tmp_path / family, bpe, family)
    records = [{"messages": c} for c in [REASONING, INLINE, CONVERSATIONS[0]] * 2]
    source = _write_jsonl(tmp_path / "chat.jsonl", records)
    cfg = DataConfig(source=str(source), format="chat", tokenizer=str(root), train_on="all")
    corpus = load_corpus(cfg, 256)
    hf, tok = _hf(root), corpus.tokenizer
    want = sorted(hf.apply_chat_template(c, tokenize=False) for c in [REASONING, INLINE] * 2)
    want = sorted(want + [hf.apply_chat_template(PLAIN[0], tokenize=False)] * 2)
    got = []
    for rows in (corpus.train, corpus.eval):
        for r in range(len(rows)):
            bounds = [*np.flatnonzero(rows.starts[r]), int(rows.real[r].sum())]
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                got.append(tok._tok.decode(rows.ids[r][a:b].tolist(), skip_special_tokens=False))
    got.sort()
    assert got == want


def _numbered(messages, k):
    """``messages`` with `` #k`` after the first user turn."""
    out = [dict(m) for m in messages]
    first = next(m for m in out if m["role"] == "user")
    first["content"] = first["content"].rstrip() + f" #{k}"
    return out


@pytest.mark.parametrize(
    ("family", "messages", "kwargs", "why"),
    [
        ("gemma3", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                    {"role": "assistant", "content": "c"}],
         None, "(Conversation roles must alternate user/assistant/user/assistant/...)"),
        ("mistral", CONVERSATIONS[0], None,
         "(message 2, an answer, does not follow the conversation before it"),
        ("qwen3", REASONING, {"enable_thinking": False},
         "(message 2, an answer, does not follow the conversation before it"),
    ],
)  # fmt: skip
def test_unrenderable_conversations_are_bad_records(
    tmp_path, bpe, caplog, family, messages, kwargs, why
):
    """A conversation the template refuses (Gemma's alternation), or whose answer it does not
    render after its prompt (Mistral moves the system message into the last user turn;
    Qwen3 without thinking prompts an empty <think> block): a bad record naming the template
    and the first line, counted against data.max_bad_fraction."""
    root = model_dir(tmp_path / family, bpe, family)
    good = [{"messages": CONVERSATIONS[1]}] * 9
    source = _write_jsonl(tmp_path / "chat.jsonl", good[:4] + [{"messages": messages}] + good[4:])
    cfg = DataConfig(source=str(source), format="chat", tokenizer=str(root),
                     chat_template_kwargs=kwargs, max_bad_fraction=0.1)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="distill"):
        corpus = load_corpus(cfg, 128)
    assert corpus.train.num_documents + corpus.eval.num_documents == 9
    kind = f"1 record(s) that {root / 'tokenizer_config.json'} fails to render {why}"
    assert kind in caplog.text and f"(first: {source} line 5)" in caplog.text
    with pytest.raises(DistillError) as info:
        load_corpus(cfg.model_copy(update={"max_bad_fraction": 0.05}), 128)
    msg = str(info.value)
    assert len(msg.splitlines()) == 1 and msg.startswith("data.source: 1 of 10 records")
    assert kind in msg


def test_template_kwargs_cannot_replace_distills_own(tmp_path):
    with pytest.raises(ValueError, match="chat_template_kwargs: 'messages' is set by distill"):
        DataConfig(source="x", chat_template_kwargs={"messages": []})
