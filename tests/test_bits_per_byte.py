"""Held-out bits per byte across tokenizers, against an independent count.

The evaluation (`student.evaluate`) divides each model's summed NLL of the held-out targets
by the UTF-8 bytes those targets spell (`distill.data.token_bytes.byte_lengths`), each model
in its own tokens. Here the same held-out rows are scored another way: each document
stretch of each student row alone, by transformers (the models exported with
`student.export.write_hf`), the student on its own ids, the teacher on the UTF-8 bytes of
the same text; the bytes are counted from the text (the GPT-2 byte alphabet of
transformers, not distill's table), specials (BOS, EOS) spelling none.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

TEXTS = [
    "naïve café — déjà vu 😀 over the lazy dog\n    return x + 1\n" * 3,
    "def f(x):\n\treturn x ** 2  # ünïcödé 🎉 spaces   here\n" * 4,
    "the quick brown fox jumps over the lazy dog " * 6,
    "日本語のテキストと English mixed 中文 text.\n" * 3,
    "import numpy as np\nfor i in range(10):\n    print(i, i * i)\n" * 3,
    "class A:\n    pass\n\nclass B(A):\n    x = 'ü'\n" * 4,
]


def _sharpen(params: dict, scale: float) -> dict:
    """Random weights whose predictions depend on the context (a fresh model's are near
    uniform, which would hide a position or segment mistake)."""
    return jax.tree.map(lambda w: np.asarray(w) * scale, params)


def _nll(model, ids: list[int]) -> float:
    """Summed nats of each id after the first, given the ones before (transformers)."""
    import torch

    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)
    return float(-logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())


def _complete(text: bytes, after: list[bytes]) -> bytes:
    """`text` with the rest of a character it ends inside, taken from the bytes `after`."""
    lead = max((k for k, b in enumerate(text) if not 0x80 <= b < 0xC0), default=None)
    if lead is None or text[lead] < 0xC0:
        return text
    need = (2 if text[lead] < 0xE0 else 3 if text[lead] < 0xF0 else 4) - (len(text) - lead)
    return text + b"".join(after)[: max(need, 0)]


def _reference(stream: np.ndarray, rows: np.ndarray, seq_len: int, student_dir, teacher_dir):
    """(student, teacher) bits per byte of rows `rows` of the packed student `stream` (row
    r: slots r * seq_len to (r + 1) * seq_len), each document stretch scored alone: the
    student on its ids, the byte teacher (PAD 0, BOS 1, EOS 2, byte b -> b + 3) on the
    bytes of the same text, whole characters only (a row opening inside a character gives
    the teacher the text after it; one ending inside a character, the whole character)."""
    import transformers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    student = transformers.AutoModelForCausalLM.from_pretrained(student_dir).eval()
    teacher = transformers.AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(student_dir)
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    special = set(tok.all_special_ids)
    spell = [b"" if i in special else bytes(to_byte[c] for c in p) for i, p in enumerate(pieces)]
    bos, eos = tok.bos_token_id, tok.eos_token_id
    s_nll = t_nll = s_bytes = t_bytes = 0.0
    cut = {"mid_document": 0, "opens_inside": 0, "ends_inside": 0}
    for r in rows:
        row = stream[r * seq_len : (r + 1) * seq_len + 1].tolist()
        after = [spell[i] for i in stream[(r + 1) * seq_len + 1 :][:4].tolist()]
        cuts = [k for k, i in enumerate(row) if i == bos and k > 0]
        for a, z in zip([0, *cuts], [*cuts, len(row)], strict=True):
            seg = row[a:z]
            if len(seg) < 2:
                continue
            s_nll += _nll(student, seg)
            s_bytes += sum(len(spell[i]) for i in seg[1:])
            whole = b"".join(spell[i] for i in seg)
            opened = whole.lstrip(bytes(range(0x80, 0xC0)))
            text = _complete(opened, after) if z == len(row) else opened
            cut["mid_document"] += seg[0] != bos
            cut["opens_inside"] += len(opened) < len(whole)
            cut["ends_inside"] += len(text) > len(opened)
            ids = [1] * (seg[0] == bos) + [b + 3 for b in text] + [2] * (seg[-1] == eos)
            if len(ids) > 1:
                t_nll += _nll(teacher, ids)
                t_bytes += sum(1 for i in ids[1:] if i >= 3)
    return s_nll / (math.log(2) * s_bytes), t_nll / (math.log(2) * t_bytes), cut


def test_bits_per_byte_match_transformers_on_the_same_text(tmp_path):
    """A BPE student and a byte-level teacher (random weights, sharpened) on held-out rows
    that open mid-document and mid-character: the evaluation's `student_bpb` and
    `teacher_bpb` are transformers' summed NLL over the text's own byte count, to 1e-4."""
    from distill.checkpoint import save_params
    from distill.config.load import config_from_dict
    from distill.data.bpe import train_bpe
    from distill.data.cross.rows import cross_corpus
    from distill.data.tokenizers import ByteTokenizer, vocab_limit
    from distill.mesh import student_mesh, teacher_mesh
    from distill.models import model
    from pipelines.evaluation import eval_batches
    from student.evaluate import StudentEval
    from student.executor import eval_byte_lengths
    from student.export import write_hf
    from teacher.online import OnlineTeacher
    from tests.conftest import tiny_config

    docs = tmp_path / "docs"
    docs.mkdir()
    for i, text in enumerate(TEXTS):
        (docs / f"d{i}.txt").write_text(text)
    bpe = str(train_bpe(TEXTS * 10, 320, tmp_path / "bpe" / "tokenizer.json"))
    tree = tiny_config(str(docs), str(tmp_path / "out"))
    tree["teacher"].update(tokenizer="bytes", top_k=None, pretrain_steps=0)
    tree["student"]["model"]["vocab_size"] = 320
    tree["data"].update(tokenizer=bpe, eval_fraction=0.34, eval_batches=3)
    tree["train"]["seq_len"] = 24
    cfg = config_from_dict(tree)
    cfg.resolve_dtypes("cpu")
    corpus = cross_corpus(cfg.data, cfg.train.seq_len, ByteTokenizer())
    batches = eval_batches(cfg, corpus)

    tcfg, scfg = cfg.teacher.model, cfg.student_model()
    t_params = _sharpen(model.init_params(tcfg, 1), 6.0)
    s_params = _sharpen(model.init_params(scfg, 2), 6.0)
    save_params(cfg.teacher.checkpoint, t_params)
    devices = jax.devices()
    teacher = OnlineTeacher(cfg, teacher_mesh(devices[:2], 1, 2), ByteTokenizer())
    limit = vocab_limit(corpus.tokenizer, *cfg.vocab_sizes())  # as pipelines.local's
    evaluate = StudentEval(cfg, student_mesh(devices[2:4], 2, 1), limit,
                           eval_byte_lengths(cfg, corpus))  # fmt: skip
    got = evaluate(s_params, batches, teacher.eval_logits(batches), keep=False)

    student_dir = write_hf(tmp_path / "s", scfg, s_params, max_position_embeddings=64,
                           tokenizer=bpe)  # fmt: skip
    teacher_dir = write_hf(tmp_path / "t", tcfg, t_params, max_position_embeddings=256)
    rows = np.arange(sum(len(b.tokens) for b in batches)) % len(corpus.eval)  # as eval_batches
    want = _reference(corpus.eval.stream, rows, cfg.train.seq_len, student_dir, teacher_dir)
    student_bpb, teacher_bpb, cut = want
    assert min(cut.values()) > 0, cut  # rows open mid-document and at both kinds of cut
    assert got["student_bpb"] == pytest.approx(student_bpb, rel=1e-4)
    assert got["teacher_bpb"] == pytest.approx(teacher_bpb, rel=1e-4)
    # the two differ by more than the tolerance: a swapped or shared count would show
    assert abs(student_bpb - teacher_bpb) > 0.05 * teacher_bpb
