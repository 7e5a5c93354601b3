"""A Hugging Face checkpoint's safetensors files: which file holds each tensor (the shard
index or the single file), an image-text checkpoint's text model read as a text
checkpoint's, the stored layers the decoder does not read, and `check_checkpoint`: every
tensor a load needs present with its shape, from the files' headers only."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from distill.config import ModelConfig
from distill.errors import DistillError
from distill.models import families
from distill.models.families.views import stored, view_shape
from distill.models.hf import INDEX_FILE, SINGLE_FILE, config_file, hf_shape, weight_names

log = logging.getLogger("distill")


def weight_files(path: str | Path) -> dict[str, str]:
    """Tensor name as the decoder names it -> safetensors file name, from the shard index or
    the single file: an image-text checkpoint's text model's tensors only, named as a text
    checkpoint's (`decoder_name`)."""
    files = stored_files(path)
    if not image_text(path):
        return files
    named = ((decoder_name(name), file) for name, file in files.items())
    return {name: file for name, file in named if name is not None}


def stored_files(path: str | Path) -> dict[str, str]:
    """Stored tensor name -> safetensors file name, from the shard index or the single file."""
    root = Path(path)
    if (root / INDEX_FILE).is_file():
        try:
            return dict(json.loads((root / INDEX_FILE).read_text())["weight_map"])
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise DistillError(f"{root / INDEX_FILE}: not a safetensors index: {e}") from None
    if (root / SINGLE_FILE).is_file():
        from safetensors import safe_open

        with safe_open(root / SINGLE_FILE, framework="numpy") as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE)
    raise DistillError(
        f"teacher.checkpoint: {root} has neither {SINGLE_FILE} nor {INDEX_FILE} (only "
        "safetensors weights are read; save with safe_serialization=True)"
    )


# Where an image-text checkpoint (`Family.image_text`) holds its text model's tensors.
TEXT_PREFIX = "model.language_model."


def image_text(path: str | Path) -> bool:
    """Whether `path` holds an image-text checkpoint whose text model is read."""
    try:
        kind = json.loads(config_file(path).read_text()).get("model_type")
    except (OSError, json.JSONDecodeError, AttributeError):
        return False
    return families.text_of(kind) is not None


def decoder_name(name: str) -> str | None:
    """An image-text checkpoint's tensor `name` as a text checkpoint names it
    (`model.language_model.X` -> `model.X`; the untied `lm_head.weight` as it is); None for
    what the text decoder does not read (the vision tower, multi-token prediction)."""
    if name.startswith(TEXT_PREFIX):
        return "model." + name.removeprefix(TEXT_PREFIX)
    return name if name == "lm_head.weight" else None


def stored_name(name: str, image: bool) -> str:
    """`decoder_name`'s inverse where `image` (an image-text checkpoint), else `name`."""
    if image and name.startswith("model."):
        return TEXT_PREFIX + name.removeprefix("model.")
    return name


def _note_unread(path: Path) -> None:
    if image_text(path):
        unread = [n for n in stored_files(path) if decoder_name(n) is None]
        kinds = sorted({".".join(n.split(".")[:2]) for n in unread})
        log.info(
            "%s: an image-text checkpoint: reading its text model (%s*); %d tensors of %s "
            "are not read", path, TEXT_PREFIX, len(unread), ", ".join(f"{k}.*" for k in kinds),
        )  # fmt: skip


def extra_layers(files: dict[str, str], cfg: ModelConfig) -> list[int]:
    """The stored layers past the decoder's `n_layers` (DeepSeek-V3's multi-token
    prediction layer), which are not read."""
    found = set()
    for name in files:
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            if i >= cfg.n_layers:
                found.add(i)
    return sorted(found)


def _note_extra_layers(files: dict[str, str], cfg: ModelConfig, path: Path) -> None:
    extra = extra_layers(files, cfg)
    if extra:
        log.info(
            "%s: skipping stored layer(s) %s past num_hidden_layers=%d (%s: "
            "multi-token prediction, not part of the decoder)",
            path, ", ".join(map(str, extra)), cfg.n_layers,
            families.get(cfg.family).extra_layers_key or "not in config.json",
        )  # fmt: skip


def check_checkpoint(
    path: str | Path, cfg: ModelConfig, tp: int, logical: dict[str, tuple] | None = None
) -> None:
    """Everything a load needs, from headers only: the shape divides over `tp`, and every
    tensor is present with its expected shape. `logical`: the quantized tensors' names and
    shapes once dequantized (`teacher.quantized.quantized_shapes`), present in their
    stored form. DistillError names the file at fault."""
    from safetensors import safe_open

    where = config_file(path)
    sizes = {"vocab_size": cfg.vocab_size, "num_attention_heads": cfg.n_heads}
    if cfg.has_dense_ffn():
        sizes["intermediate_size"] = cfg.d_ff
    if cfg.n_experts:
        sizes["moe_intermediate_size" if cfg.d_ff_expert else "intermediate_size"] = cfg.f_expert
    if cfg.f_shared:
        sizes["shared_expert_intermediate_size"] = cfg.f_shared
    for key, value in sizes.items():
        if value % tp:
            raise DistillError(f"{where}: {key}={value} is not divisible by mesh.teacher.tp={tp}")
    kvs = {"num_key_value_heads": cfg.n_kv_heads, "num_global_key_value_heads": cfg.global_kv_heads}
    for key, kv in kvs.items():
        if kv is not None and kv % tp and tp % kv:
            raise DistillError(
                f"{where}: {key}={kv} must divide or be a multiple of mesh.teacher.tp={tp}"
            )
    files, needed = weight_files(path), weight_names(cfg)
    _note_extra_layers(files, cfg, Path(path))
    _note_unread(Path(path))
    image = image_text(path)
    logical = logical or {}
    by_file: dict[str, list[str]] = {}
    for name in needed:
        base, view = stored(name)
        if base in logical:  # quantized: its stored tensors were checked with the scheme
            _check_shape(Path(path), name, view_shape(logical[base], view), cfg, needed)
            continue
        if base not in files:
            where = stored_name(base, image)
            raise DistillError(f"{Path(path)}: tensor {where} is missing from the checkpoint")
        by_file.setdefault(files[base], []).append(name)
    for file, names in sorted(by_file.items()):
        full = Path(path) / file
        if not full.is_file():
            raise DistillError(f"{full}: listed in {INDEX_FILE} but missing")
        with safe_open(full, framework="numpy") as f:
            present = set(f.keys())
            for name in names:
                base, view = stored(name)
                if stored_name(base, image) not in present:
                    raise DistillError(f"{full}: tensor {stored_name(base, image)} is missing")
                got = view_shape(tuple(f.get_slice(stored_name(base, image)).get_shape()), view)
                _check_shape(full, name, got, cfg, needed)


def _check_shape(where: Path, name: str, got: tuple, cfg: ModelConfig, needed: dict) -> None:
    want = hf_shape(cfg, needed[name][0])
    if tuple(got) != want:
        base, view = stored(name)
        part = "" if view is None else f" (its {'even' if view == 0 else 'odd'} columns)"
        part = f" (its columns {view.start}:{view.stop})" if isinstance(view, slice) else part
        raise DistillError(f"{where}: {base}{part} has shape {tuple(got)}, config.json says {want}")
