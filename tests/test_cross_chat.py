"""Chat data and prompt/completion pairs across tokenizers: each side renders a conversation
with its own chat template (checked against transformers' apply_chat_template), the two are
aligned through the answers, cut and split records keep the same stretch on both sides, and
a short run distils a ChatML student from a byte-level teacher with its own template."""

from __future__ import annotations

import json

import numpy as np
import pytest

from distill.config import DataConfig, TeacherConfig
from distill.data.cross.examples import cross_example_corpus, regions
from distill.data.tokenizers import ByteTokenizer, load_tokenizer
from distill.errors import DistillError
from tests.test_chat import (
    CONVERSATIONS,
    SPECIALS,
    _hf,
    _model_dir,
    _write_jsonl,
    bpe,
    write_model_dir,
)
from tests.test_cross_tokenizer import train_metaspace

__all__ = ["bpe"]  # the tokenizer fixture, shared with tests/test_chat.py

# Llama 3's template with a role for tool answers (as Llama 3.1 calls them, ipython).
LLAMA3_TOOLS = (
    "{% for message in messages %}{% set role = 'ipython' if message['role'] == 'tool' else "
    "message['role'] %}{% set content = '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = "
    "bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
S_HEAD, T_HEAD = "<|im_start|>assistant\n", "<|start_header_id|>assistant<|end_header_id|>\n\n"

CALL = {"type": "function", "function": {"name": "météo", "arguments": {"ville": "Paris"}}}
MORE = [
    [
        {"role": "system", "content": "Réponds en français 🙂, brièvement."},
        {"role": "user", "content": "Météo à Paris ?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": '{"ciel": "dégagé", "°C": 21}'},
        {"role": "assistant", "content": "  Ciel dégagé, 21 °C — parfait ✓  "},
    ],
    [
        {"role": "user", "content": "日本語で？"},
        {"role": "assistant", "content": "はい、日本語のテキストです。😀 and English mixed."},
    ],
]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """The teacher's model directory: a SentencePiece-style tokenizer.json (U+2581 spaces,
    byte-fallback pieces) with the chat specials and a Llama-3-style template."""
    texts = [m["content"] for c in CONVERSATIONS + MORE for m in c] * 20
    tok = train_metaspace(texts, 420, SPECIALS)
    root = tmp_path_factory.mktemp("teacher")
    tok.save(str(root / "tokenizer.json"))
    specials = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": LLAMA3_TOOLS}
    (root / "tokenizer_config.json").write_text(json.dumps({**config, **specials}))
    return root


def _corpus(tmp_path, student_dir, records, teacher, teacher_cfg, seq_len=512, **data):
    source = _write_jsonl(tmp_path / "chat.jsonl", records)
    cfg = DataConfig(source=str(source), tokenizer=str(student_dir), **data)
    return cross_example_corpus(cfg, seq_len, teacher, teacher_cfg)


def _decoder(tok):
    if isinstance(tok, ByteTokenizer):
        return tok.decode
    return lambda ids: tok._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _pieces(rows, r, t_side=False):
    """The id sequences of row r's pieces (the student's, or the teacher's)."""
    ids, starts, real = (
        (rows.t_ids, rows.t_starts, rows.t_real)
        if t_side
        else (rows.student.ids, rows.student.starts, rows.student.real)
    )
    bounds = [*np.flatnonzero(starts[r]), int(real[r].sum())]
    return [ids[r, a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _aligned_texts(corpus):
    """For every aligned (student j, teacher i): the text of each side's piece up to it."""
    dec_s, dec_t = _decoder(corpus.tokenizer), _decoder(corpus.teacher)
    for rows in (corpus.train, corpus.eval):
        b = rows.gather(np.arange(len(rows)))
        t = b.teacher.rows
        assert not ((b.teacher.align >= 0) & (b.mask == 0)).any()  # aligned: counted
        for r, j in np.argwhere(b.teacher.align >= 0):
            i = int(b.teacher.align[r, j])
            j0 = int(np.argmax(b.segment_ids[r] == b.segment_ids[r, j]))
            i0 = int(np.argmax(t.segment_ids[r] == t.segment_ids[r, i]))
            yield dec_s(b.tokens[r, j0 : j + 1]), dec_t(t.tokens[r, i0 : i + 1])


def _check_whole(corpus, t_head=T_HEAD):
    """Each aligned pair ends inside the same answer (as many answers before it) at the
    same character of it, the one side's leading whitespace aside."""
    n = 0
    for s_text, t_text in _aligned_texts(corpus):
        s_parts, t_parts = s_text.split(S_HEAD), t_text.split(t_head)
        assert len(s_parts) == len(t_parts) > 1, (s_text, t_text)
        assert s_parts[-1].lstrip() == t_parts[-1].lstrip(), (s_text, t_text)
        n += 1
    assert n > 0
    return n


def test_each_side_renders_its_own_template(tmp_path, bpe, teacher_dir):
    """The student's pieces are apply_chat_template of its ChatML tokenizer, the teacher's
    of its Llama-3-style one; answers align through their characters."""
    student_dir = _model_dir(tmp_path / "student", bpe, "chatml")
    teacher = load_tokenizer(str(teacher_dir))
    teacher_cfg = TeacherConfig(tokenizer=str(teacher_dir))
    records = [{"messages": c} for c in CONVERSATIONS + MORE]
    corpus = _corpus(tmp_path, student_dir, records, teacher, teacher_cfg, format="chat")
    want = {}  # the student's ids of each conversation -> the teacher's
    hf_s, hf_t = _hf(student_dir), _hf(teacher_dir)
    for c in CONVERSATIONS + MORE:
        s_ids, t_ids = (tuple(h.apply_chat_template(c, tokenize=True, return_dict=True)
                              ["input_ids"]) for h in (hf_s, hf_t))  # fmt: skip
        want[s_ids] = list(t_ids)
    seen = 0
    for rows in (corpus.train, corpus.eval):
        for r in range(len(rows)):
            for s_ids, t_ids in zip(_pieces(rows, r), _pieces(rows, r, True), strict=True):
                assert want[tuple(s_ids)] == t_ids
                seen += 1
    assert seen == len(want)
    _check_whole(corpus)
    assert 0.2 < corpus.train.aligned_fraction() < 1.0  # the boundaries both have
    # the teacher's loss counts its own answers: each closed by its end-of-turn token
    t = corpus.train.gather(np.arange(len(corpus.train))).teacher.rows
    eot = teacher._tok.token_to_id("<|eot_id|>")
    assert ((t.targets == eot) & (t.mask > 0)).sum() > 0


def test_a_template_that_splits_splits_both_sides(tmp_path, bpe, teacher_dir):
    """A student with Qwen3's template (one example per answer of a multi-turn conversation)
    and a Llama-3-style teacher: the teacher splits alike, each example its own
    apply_chat_template of the turns through the answer, aligned through that answer."""
    from tests.test_chat_templates import SHIPPED

    template = (SHIPPED / "qwen3.jinja").read_text()
    student_dir = write_model_dir(tmp_path / "student", bpe, template, {"eos_token": "<|im_end|>"})
    teacher = load_tokenizer(str(teacher_dir))
    records = [{"messages": c} for c in CONVERSATIONS]
    corpus = _corpus(tmp_path, student_dir, records, teacher,
                     TeacherConfig(tokenizer=str(teacher_dir)), format="chat")  # fmt: skip
    hf_s, hf_t = _hf(student_dir), _hf(teacher_dir)
    want = {}
    for c in CONVERSATIONS:
        for i in [i for i, m in enumerate(c) if m["role"] == "assistant"]:
            s_ids, t_ids = (tuple(h.apply_chat_template(c[: i + 1], tokenize=True, return_dict=True)
                                  ["input_ids"]) for h in (hf_s, hf_t))  # fmt: skip
            want[s_ids] = list(t_ids)
    seen = [
        (tuple(s_ids), t_ids)
        for rows in (corpus.train, corpus.eval)
        for r in range(len(rows))
        for s_ids, t_ids in zip(_pieces(rows, r), _pieces(rows, r, True), strict=True)
    ]
    assert len(seen) == len(want) == 5 and all(want[s] == t for s, t in seen)
    n = 0
    for s_text, t_text in _aligned_texts(corpus):  # the same stretch of the last answer
        s_answer = s_text.split(S_HEAD)[-1].split("</think>\n\n")[-1]
        assert s_answer.lstrip() == t_text.split(T_HEAD)[-1].lstrip(), (s_text, t_text)
        n += 1
    assert n > 0


def test_byte_teacher_aligns_every_whole_character(tmp_path, bpe):
    """Against a byte-level teacher (its template given by teacher.chat_template) every
    counted student position aligns, but those ending inside a character, inside a tool
    call or in the whitespace one template trims."""
    student_dir = _model_dir(tmp_path / "student", bpe, "chatml")
    template = tmp_path / "teacher.jinja"
    template.write_text(LLAMA3_TOOLS.replace("bos_token + content", "content"))
    teacher_cfg = TeacherConfig(tokenizer="bytes", chat_template=str(template))
    records = [{"messages": c} for c in CONVERSATIONS + MORE]
    corpus = _corpus(tmp_path, student_dir, records, ByteTokenizer(), teacher_cfg, format="chat")
    _check_whole(corpus)
    dec = _decoder(corpus.tokenizer)
    for rows in (corpus.train, corpus.eval):
        b = rows.gather(np.arange(len(rows)))
        for r, j in np.argwhere((b.teacher.align < 0) & (b.mask > 0)):
            j0 = int(np.argmax(b.segment_ids[r] == b.segment_ids[r, j]))
            parts = dec(b.tokens[r, j0 : j + 1]).split(S_HEAD)
            so_far = parts[-1]
            whole = dec(b.tokens[r][b.segment_ids[r] == b.segment_ids[r, j]]).split(S_HEAD)
            answer = whole[len(parts) - 1].split("<|im_end|>")[0]
            call = "<tool_call>" in answer
            lead = len(answer) - len(answer.lstrip())
            trimmed = len(so_far) < lead or len(so_far) > len(answer.rstrip())
            assert so_far.endswith("\ufffd") or call or trimmed, (so_far, answer)
    assert corpus.train.aligned_fraction() > 0.4  # the rest: bytes of CJK characters, a call


def test_cut_and_split_conversations_keep_the_same_stretch(tmp_path, bpe, teacher_dir):
    """A conversation cut at seq_len: the teacher's piece is a prefix of its own rendering
    ending no later in the answers than the student's; a split one's windows are stretches
    of it. Aligned pairs still end at the same character of the same answer."""
    student_dir = _model_dir(tmp_path / "student", bpe, "chatml")
    teacher = load_tokenizer(str(teacher_dir))
    teacher_cfg = TeacherConfig(tokenizer=str(teacher_dir))
    hf_t = _hf(teacher_dir)
    records = [{"messages": c} for c in CONVERSATIONS + MORE]
    full = [hf_t.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"]
            for c in CONVERSATIONS + MORE]  # fmt: skip
    for how in ("truncate", "split"):
        corpus = _corpus(
            tmp_path, student_dir, records, teacher, teacher_cfg, seq_len=80, format="chat",
            long_conversations=how, eval_fraction=0.3,
        )  # fmt: skip
        assert corpus.train.num_long + corpus.eval.num_long > 0
        for rows in (corpus.train, corpus.eval):
            for r in range(len(rows)):
                for t_ids in _pieces(rows, r, True):
                    if how == "truncate":
                        assert any(list(f[: len(t_ids)]) == t_ids for f in full), t_ids
                    else:
                        assert any(_contains(list(f), t_ids) for f in full), t_ids
        for s_text, t_text in _aligned_texts(corpus):
            s_answer, t_answer = s_text.split(S_HEAD)[-1], t_text.split(T_HEAD)[-1]
            assert s_answer.lstrip().endswith(t_answer.lstrip()), (s_text, t_text)


def _contains(seq, part):
    return any(seq[k : k + len(part)] == part for k in range(len(seq) - len(part) + 1))


def test_pairs_align_their_completions(tmp_path, bpe, teacher_dir):
    """A pair is the same text on both sides, each with its own BOS and EOS: the completion
    aligns (the position before it and its last, which predicts EOS, included)."""
    student_dir = _model_dir(tmp_path / "student", bpe, "chatml")
    teacher = load_tokenizer(str(teacher_dir))
    pairs = [
        {"prompt": f"Q{i}: où est le café n°{i} ?", "completion": f" Ici — {'é' * i}✓."}
        for i in range(6)
    ]
    corpus = _corpus(
        tmp_path, student_dir, pairs, teacher, TeacherConfig(tokenizer=str(teacher_dir)),
        seq_len=64, format="prompt_completion",
    )  # fmt: skip
    n = 0
    for s_text, t_text in _aligned_texts(corpus):
        s_answer, t_answer = s_text.split("?", 1)[1], t_text.split("?", 1)[1]
        assert s_answer == t_answer, (s_text, t_text)
        n += 1
    b = corpus.train.gather(np.arange(len(corpus.train)))
    t = b.teacher.rows
    before_eos = (b.targets == corpus.tokenizer.eos_id) & (b.teacher.align >= 0)
    assert before_eos.sum() == corpus.train.student.starts.sum()  # one per pair
    for r, j in np.argwhere(before_eos):
        assert t.targets[r, b.teacher.align[r, j]] == teacher.eos_id
    assert n > 0


def test_answers_found_as_they_are_or_stripped():
    """An answer one template trims is taken stripped on both sides; one that a side does
    not hold inside its answer spans is left out."""
    s = ("<a>\nfour\n</a><a>x</a>", [(3, 9), (16, 17)])
    t = ("[u]four[/u][x]four[/x]", [(14, 18)])
    s_lo, t_lo, length = regions(s, t, ["four\n", "x"])
    assert (s_lo.tolist(), t_lo.tolist(), length.tolist()) == ([4], [14], [4])
    s_lo, _, length = regions(s, s, ["four\n", "x"])
    assert (s_lo.tolist(), length.tolist()) == ([4, 16], [5, 1])


def test_teacher_template_errors_name_the_key(tmp_path, bpe):
    """A teacher tokenizer with no template beside it is one line naming the teacher's
    keys; the byte tokenizer, which has none of its own, renders distill's ChatML."""
    student_dir = _model_dir(tmp_path / "student", bpe, "chatml")
    records = [{"messages": c} for c in CONVERSATIONS]
    bare = tmp_path / "bare" / "tokenizer.json"
    bare.parent.mkdir()
    bare.write_bytes(bpe.read_bytes())
    with pytest.raises(DistillError) as info:
        _corpus(tmp_path, student_dir, records, load_tokenizer(str(bare)),
                TeacherConfig(tokenizer=str(bare)), format="chat")  # fmt: skip
    msg = str(info.value)
    assert msg.startswith("teacher.chat_template: chat data needs a chat template")
    assert f"teacher.tokenizer={bare}" in msg and len(msg.splitlines()) == 1
    _corpus(tmp_path, student_dir, records, ByteTokenizer(),
            TeacherConfig(tokenizer="bytes"), format="chat")  # fmt: skip


def _chat_run_config(teacher, tmp_path, bpe) -> dict:
    """A byte-level teacher (checkpoint ``teacher``) with a Llama-3-style template of its
    own, and a ChatML student with a BPE tokenizer, on conversations."""
    from tests.conftest import tiny_config

    student_dir = _model_dir(tmp_path / "student", bpe, "chatml")
    template = tmp_path / "teacher.jinja"
    template.write_text(LLAMA3_TOOLS.replace("bos_token + content", "content"))
    source = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS] * 8)
    data = {"source": str(source), "format": "chat", "tokenizer": str(student_dir)}
    cfg = tiny_config(str(source), str(tmp_path / "out"), data=data)
    cfg["data"].pop("include")
    cfg["teacher"].update(
        checkpoint=str(teacher), pretrain_steps=0, top_k=None,
        tokenizer="bytes", chat_template=str(template),
    )  # fmt: skip
    cfg["student"]["model"]["vocab_size"] = 320
    cfg["train"].update(steps=2, seq_len=128, log_every=1, eval_every=2, checkpoint_every=2)
    return cfg


def test_preflight_reads_chat_across_tokenizers(tmp_path, bpe):
    """The config's corpus of a chat run across tokenizers is the cross-tokenizer one (no
    refusal); the teacher's template set where it is not read is one line naming the key."""
    from distill.config.load import load_config
    from pipelines.preflight import _corpus, check_cross_tokenizer
    from tests.conftest import write_config

    tree = _chat_run_config(tmp_path / "teacher-ckpt", tmp_path, bpe)
    cfg = load_config(write_config(tmp_path, tree))
    check_cross_tokenizer(cfg)
    corpus = _corpus(cfg)
    assert corpus.teacher.kind == "bytes" and corpus.train.aligned_fraction() > 0.8
    tree["distill"] = {"on_policy": {"fraction": 0.5}}  # a sample is not re-rendered
    with pytest.raises(DistillError, match="^distill.on_policy.fraction: not supported"):
        check_cross_tokenizer(load_config(write_config(tmp_path, tree)))
    del tree["distill"]
    tree["teacher"]["tokenizer"] = None
    cfg = load_config(write_config(tmp_path, tree))
    with pytest.raises(DistillError, match="^teacher.chat_template: read only for data.format"):
        check_cross_tokenizer(cfg)


def test_short_run_on_chat_across_tokenizers(tiny_run, tmp_path, bpe):
    """`distill run` on conversations: the tiny run's byte-level teacher, rendering them with
    a Llama-3-style template of its own, teaches a ChatML student with a BPE tokenizer; the
    records report the aligned share, the evaluation bits per byte of the answers. Colocated
    (`mesh.placement: colocated`, both roles on two devices): the same losses and metrics."""
    from pipelines.commands.cli import main
    from tests.conftest import read_evals, read_train, write_config

    cfg = _chat_run_config(tiny_run.out / "teacher", tmp_path, bpe)
    assert main(["run", write_config(tmp_path, cfg)]) == 0
    train, evals = read_train(tmp_path / "out"), read_evals(tmp_path / "out")
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert np.isfinite(r["loss"]) and r["kd_loss"] > 0 and 0.8 < r["aligned_fraction"] <= 1
    for e in evals:
        assert 0 < e["student_bpb"] < 12 and 0 < e["teacher_bpb"] < 12
        assert 0.8 < e["aligned_fraction"] <= 1.0

    cfg["mesh"]["placement"] = "colocated"
    cfg["run"]["output_dir"] = str(tmp_path / "colocated")
    assert main(["run", write_config(tmp_path, cfg, "colocated.yaml")]) == 0
    both = tmp_path / "colocated"
    pairs = [*zip(train, read_train(both), strict=True), *zip(evals, read_evals(both), strict=True)]
    for a, b in pairs:
        assert a["step"] == b["step"]
        for key in ("loss", "kd_loss", "ce_loss", "student_loss", "student_bpb", "teacher_bpb"):
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-6, (a["step"], key)
