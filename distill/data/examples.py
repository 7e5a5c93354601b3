"""Conversations and prompt/completion pairs read from records, tokenised with loss flags.

``data.format: chat`` reads a list of ``{role, content}`` messages from
``data.messages_field`` of each JSONL line or Parquet row and renders it with the chat
template (``distill.data.chat``); ``data.format: prompt_completion`` reads the plain-text
strings ``data.prompt_field`` and ``data.completion_field`` and makes
``[BOS] + prompt + completion + [EOS]`` of them. Either way an example is its token ids
[n] int32 and a flag [n] bool per token: whether the loss counts predicting it (the
assistant's turns or the completion, with its end token; every token under
``data.train_on: all``).

A conversation is one example, or one per assistant turn where the template rewrites
earlier turns (``ChatTemplate.render_examples``); the examples of one record carry its
index, so that the record is held out whole.

Malformed records are counted per kind (``BadRecords``), each kind reported in one line
with its first file and line; the corpus is refused (before any device work) only when
nothing trainable is left or more than ``data.max_bad_fraction`` of the records are bad. A
conversation the template fails to render (its own ``raise_exception``, an undefined name,
an answer it cannot place) is such a bad record, counted by the template's message.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from distill.config import DataConfig
from distill.data.chat import ChatTemplate, load_template, trained_tokens
from distill.data.tokenizers import Tokenizer
from distill.errors import DistillError

log = logging.getLogger("distill")

_PARQUET_BATCH_ROWS = 1024
_ENCODE_CHUNK = 1024
Example = tuple[np.ndarray, np.ndarray]  # ids [n] int32, train [n] bool


class BadRecords:
    """Malformed records per kind: how many, and where the first one is."""

    def __init__(self):
        self.kinds: dict[str, list] = {}
        self.seen = 0  # records read, good and bad

    def add(self, kind: str, where: str) -> None:
        entry = self.kinds.setdefault(kind, [0, where])
        entry[0] += 1

    @property
    def count(self) -> int:
        return sum(n for n, _ in self.kinds.values())

    def lines(self) -> list[str]:
        return [f"{n} record(s) {kind} (first: {w})" for kind, (n, w) in self.kinds.items()]

    def check(self, kept: int, cfg: DataConfig) -> None:
        """Warn one line per kind; refuse the corpus when nothing is left or too much is bad."""
        total = self.seen
        for line in self.lines():
            log.warning("data.source: skipped %s", line)
        if kept == 0 or self.count > cfg.max_bad_fraction * total:
            summary = "; ".join(self.lines()) or "no records"
            raise DistillError(
                f"data.source: {self.count} of {total} records of '{cfg.source}' are unusable"
                f" (data.max_bad_fraction={cfg.max_bad_fraction}): {summary}"
            )


def _jsonl_records(path: Path, bad: BadRecords):
    for lineno, line in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        bad.seen += 1
        try:
            record = json.loads(line)
        except ValueError:
            bad.add("not valid JSON", where)
            continue
        yield where, record


def _parquet_records(path: Path, fields: list[str], key: str, bad: BadRecords, optional=()):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DistillError(f"data.source: {path} is not a readable Parquet file ({e})") from None
    missing = [f for f in fields if pf.schema_arrow.get_field_index(f) < 0]
    if missing:
        raise DistillError(
            f"data.source: {path} has no column '{missing[0]}' ({key}); its columns:"
            f" {', '.join(pf.schema_arrow.names)}"
        )
    columns = fields + [f for f in optional if pf.schema_arrow.get_field_index(f) >= 0]
    row = 0
    for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=columns):
        for record in batch.to_pylist():
            bad.seen += 1
            yield f"{path} row {row}", record
            row += 1


def records(
    cfg: DataConfig, paths: list[Path], fields: list[str], key: str, bad: BadRecords, optional=()
):
    """(where, record) of every JSONL line and Parquet row of ``paths``; of Parquet only the
    columns ``fields`` (each required) and those of ``optional`` the file has. Records
    routed to several teachers (``DataConfig._route``): only those of one teacher, each
    record's ``data.teacher_field`` checked to name a teacher."""
    route = cfg._route
    if route is not None:
        optional = (*optional, route[0])
    for path in paths:
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            found = _parquet_records(path, fields, key, bad, optional)
        elif suffix in (".jsonl", ".json"):
            found = _jsonl_records(path, bad)
        else:
            raise DistillError(
                f"data.format: {cfg.format} reads .jsonl/.json or .parquet records; {path} is"
                " neither (narrow data.include)"
            )
        yield from found if route is None else _routed(found, *route)


def _routed(found, field: str, name: str, names: tuple[str, ...]):
    """The records of `found` whose `field` is `name`; one naming no teacher is an error."""
    for where, record in found:
        to = record.get(field) if isinstance(record, dict) else None
        if to not in names:
            got = "has none" if to is None else f"is {to!r}"
            raise DistillError(
                f"data.teacher_field: {where}: its '{field}' {got}; it must name one of the "
                f"teachers ({', '.join(names)})"
            )
        if to == name:
            yield where, record


def _message_problem(messages, roles: frozenset, train_on: str) -> str | None:
    """Why a conversation cannot be used (``roles``: those every template knows), or None."""
    if messages is None:
        return "without the field"
    if not isinstance(messages, list):
        return "whose field is not a list of messages"
    if not messages:
        return "with an empty conversation"
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return "with a message without a role"
        if not isinstance(m.get("content"), (str, list)) and not m.get("tool_calls"):
            return "with a message without content"
        if m["role"] not in roles:
            return f"with a role the template does not know ('{m['role']}')"
    if train_on == "assistant" and not any(m["role"] == "assistant" for m in messages):
        return "with no assistant turn (data.train_on: assistant)"
    return None


def _conversation(record, cfg: DataConfig, roles: frozenset, train_on: str):
    """(messages, tools, why the record cannot be used or None) of one record: ``tools`` is
    the record's ``data.tools_field`` (a list of JSON schemas, or one as a JSON string)."""
    if not isinstance(record, dict):
        return None, None, "without the field"
    messages, tools = record.get(cfg.messages_field), record.get(cfg.tools_field)
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            tools = False
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        return messages, None, "whose tools are not a list of JSON schemas (data.tools_field)"
    return messages, tools, _message_problem(messages, roles, train_on)


def _chat_records(cfg: DataConfig, paths, templates: tuple[ChatTemplate, ...], bad: BadRecords):
    """(where, messages, tools, problem or None) of every record of ``paths``, its roles
    known to each of ``templates``."""
    roles = frozenset.intersection(*(t.roles for t in templates))
    for where, record in records(
        cfg, paths, [cfg.messages_field], "data.messages_field", bad, [cfg.tools_field]
    ):
        yield where, *_conversation(record, cfg, roles, cfg.train_on)


def _render(templates: tuple[ChatTemplate, ...], messages: list, tools, train_on: str) -> list:
    """Each of ``templates``' examples of one conversation (``render_examples``), split
    alike: one per answer on every side when one template needs it (never under
    ``train_on: all``, which trains on the whole conversation once). A template's failure
    raises ``_Unrenderable`` naming it."""
    renders = []
    for split in (None, True) if train_on == "assistant" else (False,):
        renders = []
        for t in templates:
            try:
                renders.append(t.render_examples(messages, tools, split))
            except Exception as exc:  # the template's own errors: raise_exception, undefined
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise _Unrenderable(f"that {t.where} fails to render ({first})") from None
        if len({len(r) for r in renders}) == 1:
            break
    return renders


class _Unrenderable(Exception):
    """A conversation a template cannot render; its message is the bad record's kind."""


# One usable example: its (text, answer spans) through each template (one, for pairs, which
# have none), its answers' texts (the assistant's string contents; the completion), and the
# index of the record it comes from (a conversation may make one example per answer).
Rendered = tuple[tuple[tuple[str, list], ...], list[str], int]


def _chat_texts(cfg: DataConfig, paths, templates: tuple[ChatTemplate, ...], bad: BadRecords):
    """The ``Rendered`` of every usable conversation (``data.max_bytes`` counts the first
    template's texts)."""
    out: list[Rendered] = []
    budget, record = cfg.max_bytes, 0
    for where, messages, tools, problem in _chat_records(cfg, paths, templates, bad):
        renders = []
        if problem is None:
            try:
                renders = _render(templates, messages, tools, cfg.train_on)
            except _Unrenderable as exc:
                problem = str(exc)
        if (
            problem is None
            and cfg.train_on == "assistant"
            and not any(spans for _, spans in renders[0])
        ):
            problem = "with no assistant turn (data.train_on: assistant)"
        if problem is not None:
            bad.add(problem, where)
            continue
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        per_example = [answers] if len(renders[0]) == 1 else [[a] for a in answers]
        for n, texts in enumerate(zip(*renders, strict=True)):
            out.append((texts, [a for a in per_example[n] if isinstance(a, str)], record))
            if budget is not None:
                budget -= len(texts[0][0].encode("utf-8"))
        record += 1
        if budget is not None and budget <= 0:
            break
    return out


def _pair_texts(cfg: DataConfig, paths, bad: BadRecords):
    """The ``Rendered`` of every usable pair: prompt + completion, the completion's span."""
    fields = [cfg.prompt_field, cfg.completion_field]
    out, budget = [], cfg.max_bytes
    for where, record in records(cfg, paths, fields, "data.prompt_field", bad):
        values = [record.get(f) if isinstance(record, dict) else None for f in fields]
        if not all(isinstance(v, str) for v in values):
            missing = fields[0] if not isinstance(values[0], str) else fields[1]
            bad.add(f"without a string field '{missing}'", where)
            continue
        prompt, completion = values
        if not completion:
            bad.add("with an empty completion", where)
            continue
        text = prompt + completion
        out.append((((text, [(len(prompt), len(text))]),), [completion], len(out)))
        if budget is not None:
            budget -= len(text.encode("utf-8"))
            if budget <= 0:
                break
    return out


def read_examples(
    cfg: DataConfig, paths: list[Path], templates: tuple[ChatTemplate, ...] = ()
) -> list[Rendered]:
    """The ``Rendered`` of every usable record of ``paths`` in order: conversations through
    each of ``templates`` (chat), or pairs; malformed records counted and reported."""
    bad = BadRecords()
    if cfg.format == "chat":
        texts = _chat_texts(cfg, paths, templates, bad)
    else:
        texts = _pair_texts(cfg, paths, bad)
    bad.check(len(texts), cfg)
    return texts


def _check_offsets(cfg: DataConfig, tokenizer: Tokenizer) -> None:
    if not hasattr(tokenizer, "encode_offsets"):
        raise DistillError(
            f"data.tokenizer: data.format={cfg.format} needs character offsets, which a "
            f"{tokenizer.kind} tokenizer does not give; use a tokenizer.json or 'bytes'"
        )


def tokenise_examples(
    cfg: DataConfig, tokenizer: Tokenizer, renders: list[tuple[str, list]]
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Token ids [n] int32, loss flags [n] bool and character offsets [n, 2] int64 of each
    rendered (text, answer spans); a pair is ``[BOS] + text + [EOS]`` (BOS at (0, 0), EOS at
    (len, len)), its EOS trained on."""
    _check_offsets(cfg, tokenizer)
    chat = cfg.format == "chat"
    out = []
    for lo in range(0, len(renders), _ENCODE_CHUNK):
        chunk = renders[lo : lo + _ENCODE_CHUNK]
        encoded = tokenizer.encode_offsets([t for t, _ in chunk])
        for (text, spans), (ids, offsets) in zip(chunk, encoded, strict=True):
            counted = spans if cfg.train_on == "assistant" else [(0, len(text))]
            train = trained_tokens(offsets, counted)
            if not chat:  # a pair is one document: [BOS] + text + [EOS], EOS trained on
                ids = np.concatenate([[tokenizer.bos_id], ids, [tokenizer.eos_id]])
                train = np.concatenate([[False], train, [True]])
                offsets = np.concatenate([[[0, 0]], offsets.reshape(-1, 2), [[len(text)] * 2]])
            out.append((ids.astype(np.int32), train, offsets.astype(np.int64).reshape(-1, 2)))
    return out


def load_examples(
    cfg: DataConfig, paths: list[Path], tokenizer: Tokenizer
) -> tuple[list[Example], np.ndarray]:
    """Every usable example of ``paths`` in order, tokenised with its loss flags, and the
    index [n] of the record each comes from."""
    _check_offsets(cfg, tokenizer)
    templates = (load_template(cfg, tokenizer),) if cfg.format == "chat" else ()
    texts = read_examples(cfg, paths, templates)
    renders = [r[0] for r, _, _ in texts]
    examples = [(ids, train) for ids, train, _ in tokenise_examples(cfg, tokenizer, renders)]
    return examples, np.array([rec for _, _, rec in texts], dtype=np.int64)


def conversation_prompts(cfg: DataConfig, paths: list[Path], tokenizer: Tokenizer) -> list[str]:
    """On-policy prompts of chat data: each usable conversation up to its last assistant
    turn, rendered with the template's generation prompt (the student answers from there)."""
    template, bad = load_template(cfg, tokenizer), BadRecords()
    out = []
    for _, messages, tools, problem in _chat_records(cfg, paths, (template,), bad):
        if problem is not None or not any(m["role"] == "assistant" for m in messages):
            continue  # counted and reported when the corpus was read
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        try:
            out.append(template.render(messages[:last], add_generation_prompt=True, tools=tools))
        except Exception:  # noqa: S112 - a bad record, counted when the corpus was read
            continue
    return out
