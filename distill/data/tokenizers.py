"""Tokenizers for ``data.tokenizer``: the built-in bytes, a Hugging Face ``tokenizer.json``,
or a SentencePiece ``.model``.

Every tokenizer has ``vocab_size`` (one past its largest id), ``bos_id`` and ``eos_id``
(each document is packed as ``[BOS] + tokens + [EOS]``), ``pad_id`` (or None),
``encode(text) -> [n] int32`` without specials, ``encode_batch(texts)``, ``decode(ids)``
and ``files``: the files `distill export` copies next to the exported model.

BOS and EOS come from the tokenizer's own special tokens. For a ``tokenizer.json`` they are
the ``bos_token`` / ``eos_token`` of a ``tokenizer_config.json`` in the same directory when
there is one, else the first well-known name present in the vocabulary (``<s>``,
``<|begin_of_text|>``, ... and ``</s>``, ``<|end_of_text|>``, ``<|endoftext|>``, ...). For a
SentencePiece model they are its ``bos_id()`` / ``eos_id()``. A tokenizer with only one of
the two (GPT-2's ``<|endoftext|>``) uses it for both, as GPT-2 does between documents; a
tokenizer with neither is an error (documents must be delimited).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from distill.errors import DistillError

_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[CLS]", "<BOS>")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "[SEP]", "<EOS>")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<PAD>")


class ByteTokenizer:
    """UTF-8 bytes as tokens: PAD=0, BOS=1, EOS=2, byte b -> b + 3. Needs no vocabulary file."""

    kind = "bytes"
    pad_id = 0
    bos_id = 1
    eos_id = 2
    vocab_size = 259
    files: tuple[Path, ...] = ()

    def encode(self, text: str) -> np.ndarray:
        """Token ids [n] int32 of ``text``'s UTF-8 bytes, without BOS/EOS."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) + 3

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def encode_offsets(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids [n] int32, character offsets [n, 2] int64) of each text: every byte of a
        character spans that character."""
        out = []
        for t in texts:
            widths = np.fromiter((len(c.encode("utf-8")) for c in t), np.int64, count=len(t))
            char = np.repeat(np.arange(len(t), dtype=np.int64), widths)
            out.append((self.encode(t), np.stack([char, char + 1], axis=1)))
        return out

    def decode(self, ids) -> str:
        """Text of ``ids``; special ids are skipped, invalid UTF-8 becomes U+FFFD."""
        ids = np.asarray(ids).reshape(-1)
        ids = ids[(ids >= 3) & (ids < self.vocab_size)]
        return (ids - 3).astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _delimiters(path: Path, bos: int | None, eos: int | None) -> tuple[int, int]:
    if bos is None and eos is None:
        raise DistillError(
            f"data.tokenizer: {path} has no BOS or EOS special token to delimit documents"
            f" (looked for {', '.join(_BOS_NAMES + _EOS_NAMES)})"
        )
    return (eos if bos is None else bos), (bos if eos is None else eos)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library."""

    kind = "hf"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust loader raises plain Exception
            raise DistillError(
                f"data.tokenizer: {path} is not a loadable Hugging Face tokenizer.json"
                f" ({_one_line(exc)})"
            ) from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        named = _config_specials(path.parent / "tokenizer_config.json")
        self.bos_id, self.eos_id = _delimiters(
            path,
            _special_id(vocab, named.get("bos_token"), _BOS_NAMES),
            _special_id(vocab, named.get("eos_token"), _EOS_NAMES),
        )
        self.pad_id = _special_id(vocab, named.get("pad_token"), _PAD_NAMES)
        self.files = (path,)
        self.tokens = {  # id -> string of the specials, for export
            i: t for t, i in vocab.items() if i in (self.bos_id, self.eos_id, self.pad_id)
        }

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def encode_offsets(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids [n] int32, character offsets [n, 2] int64) of each text, without specials."""
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [
            (np.asarray(e.ids, np.int32), np.asarray(e.offsets, np.int64).reshape(-1, 2))
            for e in encs
        ]

    def decode(self, ids) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1) if 0 <= i < self.vocab_size]
        return self._tok.decode(ids, skip_special_tokens=True)


def _config_specials(path: Path) -> dict[str, str]:
    """bos/eos/pad token strings of a tokenizer_config.json beside tokenizer.json, if any."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        value = raw.get(key)
        if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _special_id(vocab: dict[str, int], configured: str | None, names) -> int | None:
    for name in (configured, *names):
        if name is not None and name in vocab:
            return vocab[name]
    return None


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` (``pip install sentencepiece``, in the ``hf`` extra)."""

    kind = "sentencepiece"

    def __init__(self, path: Path):
        try:
            import sentencepiece as spm
        except ImportError:
            raise DistillError(
                f"data.tokenizer: {path} is a SentencePiece model and needs the sentencepiece"
                " package (pip install 'distill[hf]')"
            ) from None
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except Exception as exc:
            raise DistillError(
                f"data.tokenizer: {path} is not a loadable SentencePiece model ({_one_line(exc)})"
            ) from None
        self.vocab_size = int(self._sp.get_piece_size())

        def _id(i: int) -> int | None:
            return int(i) if 0 <= i < self.vocab_size else None

        self.bos_id, self.eos_id = _delimiters(path, _id(self._sp.bos_id()), _id(self._sp.eos_id()))
        self.pad_id = _id(self._sp.pad_id())
        self.files = (path,)
        self.tokens = {
            i: self._sp.id_to_piece(i) for i in {self.bos_id, self.eos_id, self.pad_id} - {None}
        }

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int32) for ids in self._sp.encode(list(texts))]

    def encode_offsets(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids [n] int32, character offsets [n, 2] int64) of each text: SentencePiece gives
        each piece's UTF-8 byte span of the input, turned here into characters (a byte
        piece of a multi-byte character spans that character)."""
        out = []
        for text in texts:
            pieces = self._sp.encode_as_proto(text).pieces
            widths = np.fromiter((len(c.encode("utf-8")) for c in text), np.int64, len(text))
            char_of = np.repeat(np.arange(len(text), dtype=np.int64), widths)
            char_of = np.append(char_of, len(text))  # the end of the text
            begin = np.array([p.begin for p in pieces], np.int64)
            end = np.array([p.end for p in pieces], np.int64)
            last = np.maximum(end - 1, begin)  # the byte before the end: its character + 1
            spans = np.stack([char_of[begin], np.where(end > begin, char_of[last] + 1,
                                                       char_of[begin])], axis=1)  # fmt: skip
            out.append((np.array([p.id for p in pieces], np.int32), spans.reshape(-1, 2)))
        return out

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in np.asarray(ids).reshape(-1)])


Tokenizer = ByteTokenizer | HFTokenizer | SentencePieceTokenizer


def load_tokenizer(spec: str, key: str = "data.tokenizer") -> Tokenizer:
    """``'bytes'``, or the tokenizer file at ``spec``: a ``.model`` is SentencePiece, anything
    else a ``tokenizer.json``; a directory means its tokenizer.json (or tokenizer.model).
    ``key``: the config key that named it, for errors."""
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        found = [path / n for n in ("tokenizer.json", "tokenizer.model") if (path / n).is_file()]
        if not found:
            raise DistillError(
                f"{key}: directory {path} holds no tokenizer.json or tokenizer.model"
            )
        path = found[0]
    if not path.is_file():
        raise DistillError(f"{key}: no such file: {path}")
    if path.suffix == ".model":
        return SentencePieceTokenizer(path)
    return HFTokenizer(path)


def build_tokenizer(cfg) -> Tokenizer:
    """The tokenizer named by ``data.tokenizer`` (``cfg`` is the DataConfig)."""
    return load_tokenizer(cfg.tokenizer)


def vocab_limit(tokenizer: Tokenizer, *model_vocabs: int) -> int | None:
    """The ids the models must keep: the tokenizer's vocabulary size when any of the models'
    vocabularies (the teacher's and the student's, which may be padded differently) is
    padded past it (to a multiple of 64 or of ``tp``, as released checkpoints often are),
    else None. Logits of the padded ids are masked everywhere (teacher, student, evaluation),
    so no probability mass lands on ids the tokenizer never produces."""
    return tokenizer.vocab_size if tokenizer.vocab_size < max(model_vocabs) else None


# ----------------------------------------------------------------------------- export


def export_files(tok: Tokenizer, out_dir: Path, max_length: int) -> dict[str, dict]:
    """Copy a file tokenizer into the Hugging Face directory ``out_dir``; returns the JSON
    files still to write there (tokenizer_config.json, special_tokens_map.json).

    A tokenizer.json is copied as is, with its neighbouring tokenizer_config.json and
    special_tokens_map.json when present (they may hold a chat template); otherwise a
    PreTrainedTokenizerFast config naming the BOS/EOS/PAD tokens is written. A SentencePiece
    model becomes tokenizer.model with a LlamaTokenizer config (BOS added, as in training).
    """
    import shutil

    out_dir = Path(out_dir)
    (src,) = tok.files
    specials = {
        f"{name}_token": tok.tokens[i]
        for name, i in (("bos", tok.bos_id), ("eos", tok.eos_id), ("pad", tok.pad_id))
        if i is not None
    }
    if tok.kind == "sentencepiece":
        shutil.copyfile(src, out_dir / "tokenizer.model")
        config = {
            "tokenizer_class": "LlamaTokenizer",
            "add_bos_token": True,
            "add_eos_token": False,
            "model_max_length": max_length,
            **specials,
        }
        return {"tokenizer_config.json": config, "special_tokens_map.json": specials}
    shutil.copyfile(src, out_dir / "tokenizer.json")
    if (src.parent / "chat_template.jinja").is_file():  # transformers 5 keeps it apart
        shutil.copyfile(src.parent / "chat_template.jinja", out_dir / "chat_template.jinja")
    files = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (src.parent / name).is_file():
            shutil.copyfile(src.parent / name, out_dir / name)
        else:
            files[name] = specials
    if "tokenizer_config.json" in files:
        files["tokenizer_config.json"] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": max_length,
            **specials,
        }
    return files
