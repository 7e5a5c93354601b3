"""The chat corpus made from the standard library's docstrings (`data.source:
"{stdlib_chat}"`): well-formed conversations answered from the docstrings, the same on
every call, read from source and never imported, written once to the cache; the byte
tokenizer's built-in ChatML with only the answers trained; and a chat run on it with no
download."""

import inspect
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from distill.config import DataConfig
from distill.data import stdlib_chat
from distill.data.chat import load_template
from distill.data.tokenizers import ByteTokenizer
from pipelines.commands.cli import main
from tests.conftest import read_train, tiny_config, write_config

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def records():
    before = set(sys.modules)
    got = list(stdlib_chat.conversations(STDLIB))
    assert not {"antigravity", "this", "turtle"} & (set(sys.modules) - before)  # not imported
    return got


def test_conversations_are_questions_answered_from_docstrings(records):
    assert len(records) > 1000
    assert records == list(stdlib_chat.conversations(STDLIB))  # the same corpus every time
    for r in records:
        roles = [m["role"] for m in r["messages"]]
        assert roles[0] == "system" and 1 <= (len(roles) - 1) // 2 <= 2
        assert roles[1:] == ["user", "assistant"] * ((len(roles) - 1) // 2)
        assert all(m["content"].strip() for m in r["messages"])
    want = stdlib_chat._first_paragraph(inspect.getdoc(json.dumps))  # its first paragraph
    answers = {
        a["content"]
        for r in records
        for q, a in zip(r["messages"][1::2], r["messages"][2::2], strict=True)
        if "`json.dumps`" in q["content"]
    }
    assert answers and all(a == want or a.startswith("`json.dumps(obj, *,") for a in answers)


def test_the_corpus_is_written_once_to_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTILL_CACHE_DIR", str(tmp_path))
    path = stdlib_chat.corpus_path()
    assert path.parent == tmp_path and path.name.startswith(f"stdlib-chat-v{stdlib_chat.VERSION}")
    first = path.stat().st_mtime_ns
    assert stdlib_chat.corpus_path() == path and path.stat().st_mtime_ns == first
    assert not list(tmp_path.glob("*.tmp"))
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(x) for x in lines[:3]] == list(stdlib_chat.conversations(STDLIB))[:3]


def test_the_byte_tokenizer_renders_chatml_and_trains_the_answers():
    cfg = DataConfig(source="x.jsonl", format="chat")
    template = load_template(cfg, ByteTokenizer())
    messages = [
        {"role": "system", "content": "S."},
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": "A."},
    ]
    text = template.render(messages)
    assert text == (
        "<|im_start|>system\nS.<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n"
        "<|im_start|>assistant\nA.<|im_end|>\n"
    )
    prompt = template.render(messages[:2], add_generation_prompt=True)
    assert text.startswith(prompt) and prompt.endswith("<|im_start|>assistant\n")
    rendered, spans = template.render_spans(messages)
    assert [rendered[a:b] for a, b in spans] == ["A.<|im_end|>"]


def test_a_chat_run_on_the_standard_library_with_no_download(corpus_dir, tmp_path, capsys):
    """validate, then a short run on the conversations (teacher bootstrap, distillation)."""
    cfg = tiny_config(str(corpus_dir), str(tmp_path / "out"))
    cfg["data"] = {"source": "{stdlib_chat}", "format": "chat", "eval_batches": 1}
    cfg["train"].update(seq_len=256, steps=2, log_every=1, eval_every=2, checkpoint_every=2)
    cfg["teacher"].update(pretrain_steps=2)
    path = write_config(tmp_path, cfg)
    assert main(["validate", path]) == 0
    assert ": ok (" in capsys.readouterr().out
    assert main(["run", path]) == 0
    train = read_train(tmp_path / "out")
    assert [r["step"] for r in train] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["kd_loss"] > 0 for r in train)
