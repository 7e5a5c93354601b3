"""`distill export --format hf`: the student as a Hugging Face directory of its own family
(`ModelConfig.family`: a pretrained student's, else its teacher's).

The directory holds what `AutoModelForCausalLM.from_pretrained` (as `Qwen3ForCausalLM`,
`Gemma3ForCausalLM`, ...: `distill.models.hf.export`) and `AutoTokenizer` load:
config.json, generation_config.json, the weights (float32, or bfloat16 on request: half
the bytes; one model.safetensors, or past `MAX_SHARD_BYTES` shards with the
model.safetensors.index.json transformers writes), the tokenizer, and
distill.json: the step, and the identities of the teacher and tokenizer the student was
distilled with (`distill.identity`; `recorded` false: taken from the config, the checkpoint
predating them). A student distilled with another teacher or tokenizer than its config's
is not exported unless `run.allow_teacher_change`.

The built-in byte tokenizer (PAD=0, BOS=1, EOS=2, byte b -> b + 3) is written as a
`tokenizers` BPE model with no merges over a byte-level alphabet, so the Hugging Face
tokenizer gives exactly distill's ids: one token per UTF-8 byte, BOS prepended as in
training (training also appends EOS after each document; generation stops there).
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
from etils import epath

from distill import storage
from distill.config import Config, ModelConfig
from distill.data.tokenizers import ByteTokenizer, export_files, load_tokenizer, vocab_limit
from distill.errors import DistillError
from distill.models import hf, parts
from distill.models.hf import export as hf_config
from distill.observability.metrics_log import dumps

PROVENANCE = "distill.json"  # the teacher and tokenizer the exported student was distilled with
MAX_SHARD_BYTES = 5 * 10**9  # a weights file's bytes, at most (transformers 4's 5GB default)
DTYPES = ("float32", "bfloat16")  # the exported weights' dtype (`--dtype`)


def hf_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """distill parameters (host or device) -> Hugging Face tensor name -> [out, in] array."""
    out, views, rows, cols, halves = {}, {}, {}, {}, {}
    for name, (key, layer, transposed) in hf.weight_names(cfg).items():
        w = np.asarray(params[key] if layer is None else _layer_slice(cfg, params, key, layer))
        w = np.swapaxes(w, -1, -2) if transposed else w  # [in, out] -> [out, in]
        base, view = hf.stored(name)
        if view is None:
            out[name] = np.ascontiguousarray(w)
        elif isinstance(view, tuple):  # rows of one fused tensor (Qwen3.5's in_proj_qkv)
            rows.setdefault(base, {})[view] = w
        elif isinstance(view, slice):  # columns of one (Gemma 4's per-layer embeddings)
            cols.setdefault(base, {})[view.start] = w
        elif isinstance(view, range):  # each expert's rows (Gemma 4's gate and up halves)
            halves.setdefault(base, {})[view.start] = w
        else:  # every other column of one fused tensor (gpt-oss's gate and up)
            views.setdefault(base, {})[view] = w
    for base, pieces in rows.items():
        out[base] = np.ascontiguousarray(np.concatenate([pieces[k] for k in sorted(pieces)]))
    for base, pieces in cols.items():  # contiguous: concatenate keeps the pieces' strides
        out[base] = np.ascontiguousarray(np.concatenate([pieces[k] for k in sorted(pieces)], -1))
    for base, pieces in halves.items():
        out[base] = np.ascontiguousarray(np.concatenate([pieces[k] for k in sorted(pieces)], 1))
    for base, pieces in views.items():
        fused = np.empty((*pieces[0].shape[:-1], 2 * pieces[0].shape[-1]), pieces[0].dtype)
        fused[..., 0::2], fused[..., 1::2] = pieces[0], pieces[1]
        out[base] = fused
    return out


def _layer_slice(cfg: ModelConfig, params: dict, key: str, layer) -> np.ndarray:
    """Weight `key` of layer `layer` (or of (layer, expert)) from its stack
    (`distill.models.parts.layer_slot`)."""
    i, *expert = layer if isinstance(layer, tuple) else (layer,)
    return params["layers"][key][(parts.layer_slot(cfg, key, i), *expert)]


def write_hf(
    out_dir: str | Path,
    cfg: ModelConfig,
    params: dict,
    *,
    max_position_embeddings: int,
    tokenizer: str = "bytes",
    provenance: dict | None = None,
    generation_from: tuple[str | Path, ...] = (),
    special: dict | None = None,
    dtype: str = "float32",
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write `params` as a Hugging Face directory of `cfg.family`; returns its path.

    generation_config.json is copied from the first of the tokenizer's directory and
    `generation_from` (e.g. a pretrained student's checkpoint) that holds one, so sampling
    defaults and stop ids survive; else it names the tokenizer's BOS, EOS and PAD.

    A vocabulary padded past the tokenizer's is trimmed to it: training masks the padded
    ids, so the trimmed model's softmax is exactly the trained one's, and a sampler can
    never draw an id the tokenizer cannot decode. `provenance` (what the student was
    distilled from) is written as distill.json. `special`: special ids that replace the
    tokenizer's in config.json (`special_ids`). `dtype`: the weights' (`DTYPES`; bfloat16
    rounds to nearest even, as torch casts); `max_shard_bytes`: see `save_tensors`."""
    if dtype not in DTYPES:
        raise DistillError(f"export --dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    tok = load_tokenizer(tokenizer)  # "bytes", or the run's tokenizer file (copied below)
    limit = vocab_limit(tok, cfg.vocab_size)
    if limit is not None:
        cfg = cfg.model_copy(update={"vocab_size": limit})
        params = dict(params, embed=np.asarray(params["embed"])[:limit])
        if "lm_head" in params:
            params["lm_head"] = np.asarray(params["lm_head"])[:, :limit]
        if "ple_embed" in params["layers"]:  # Gemma 4's per-layer tables [L, V, P]
            table = np.asarray(params["layers"]["ple_embed"])[:, :limit]
            params["layers"] = dict(params["layers"], ple_embed=table)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = {"bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id, **(special or {})}
    config = hf_config.to_hf_config(
        cfg, max_position_embeddings=max_position_embeddings, dtype=dtype, **ids
    )
    generation = _generation_config(tok, (*(Path(f).parent for f in tok.files), *generation_from))
    files = {
        hf.CONFIG: config,
        "generation_config.json": generation,
        **(
            _byte_tokenizer_files(tok, max_position_embeddings)
            if tok.kind == "bytes"
            else export_files(tok, out, max_position_embeddings)
        ),
    }
    if provenance is not None:
        files[PROVENANCE] = provenance
    for name, content in files.items():
        (out / name).write_text(dumps(content, indent=2, ensure_ascii=False) + "\n")
    as_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    tensors = {  # C order: safetensors writes an array's buffer as it lies
        k: np.ascontiguousarray(v.astype(np.float32).astype(as_dtype))
        for k, v in hf_tensors(cfg, params).items()
    }
    save_tensors(out, tensors, max_shard_bytes)
    return out


def save_tensors(out: Path, tensors: dict[str, np.ndarray], max_shard_bytes: int) -> None:
    """`tensors` as out/model.safetensors when they fit in `max_shard_bytes`, else as
    shards model-0000i-of-0000n.safetensors of at most that many bytes each (a larger
    tensor alone in its own), in order, with model.safetensors.index.json (total_size and
    each tensor's file), as transformers' `save_pretrained` writes them. Weights of an
    earlier export in `out` are removed first: a loader must not find both layouts."""
    from safetensors.numpy import save_file

    for old in [*out.glob("model*.safetensors"), out / hf.INDEX_FILE]:
        old.unlink(missing_ok=True)
    shards, size = [{}], 0
    for name, w in tensors.items():
        if shards[-1] and size + w.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = w
        size += w.nbytes
    if len(shards) == 1:
        save_file(tensors, str(out / hf.SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(w.nbytes for w in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / hf.INDEX_FILE).write_text(dumps(index, indent=2) + "\n")


def _generation_config(tok, dirs) -> dict:
    """The first generation_config.json found in `dirs`, else the tokenizer's special ids."""
    for d in dirs:
        found = Path(d) / "generation_config.json"
        if found.is_file():
            return json.loads(found.read_text())
    return {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}


def export_hf(cfg: Config, out_dir: str | Path | None = None, **write) -> Path | epath.Path:
    """Export the latest student checkpoint of the run `cfg` (default: <output_dir>/hf);
    the run and the destination may be local or in a gs:// bucket. `write`: `write_hf`'s
    dtype and max_shard_bytes."""
    import jax
    from jax.sharding import Mesh

    from distill import outputs
    from distill.checkpoint import Checkpointer, has_checkpoint
    from distill.identity import check_pinned, run_identity
    from distill.mesh import DP
    from student import optim, train

    where = outputs.checkpoint_dir(cfg)
    if not has_checkpoint(where):
        raise DistillError(f"run.output_dir: no student checkpoint in {where}")
    scfg = cfg.student_model()
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), (DP,))
    tx = optim.make_optimizer(cfg.optim, cfg.train.steps)
    ckpt = Checkpointer(where)
    try:
        stored, current = ckpt.stored_meta(), run_identity(cfg)
        how = (
            f"set run.allow_teacher_change: true in {cfg.run.output_dir.rstrip('/')}/"
            "config.yaml to export it anyway"
        )
        check_pinned(cfg, stored, current, how)
        state, _, step = ckpt.restore(train.saved(train.abstract_state(scfg, tx, mesh)))
    finally:
        ckpt.close()
    # what the student was distilled with: its checkpoint's record, else (a checkpoint from
    # before records) the run's teacher and tokenizer now
    provenance = {"step": step, "recorded": stored is not None, **(stored or current)}
    out = str(out_dir) if out_dir is not None else f"{cfg.run.output_dir.rstrip('/')}/hf"
    write = functools.partial(
        write_hf,
        cfg=scfg,
        params=jax.device_get(state.params),
        max_position_embeddings=context_length(cfg),
        tokenizer=cfg.data.tokenizer,
        provenance=provenance,
        generation_from=(cfg.student.checkpoint,) if cfg.student.checkpoint else (),
        special=special_ids(cfg),
        **write,
    )
    if not storage.is_remote(out):
        return write(Path(out))
    storage.check(out, "--out")  # a bucket: write the files here, then upload them
    with tempfile.TemporaryDirectory() as tmp:
        storage.upload_dir(write(Path(tmp)), out)
    return epath.Path(out)


def context_length(cfg: Config) -> int:
    """The exported config's `max_position_embeddings`: `train.seq_len`, the length the
    student was distilled at, or the longer context of the model it started from (a
    pretrained student's config.json, or the Hugging Face teacher it was cut from): the
    student keeps that model's positions (RoPE and its scaling), as fine-tuning at shorter
    rows keeps a model's context length."""
    lengths = [cfg.train.seq_len]
    for tree in _source_configs(cfg):
        n = tree.get("max_position_embeddings")
        lengths += [int(n)] if n else []
    return max(lengths)


def special_ids(cfg: Config) -> dict:
    """The exported config's special ids (`bos_id`, `eos_id`, `pad_id`) that the model the
    student started from names (its config.json, as `context_length` finds it), where that
    model has the student's vocabulary; the others stay the tokenizer's. A tokenizer
    without a BOS token (Qwen's) delimits documents with its EOS, but the model's own config
    names the id it was trained with (Qwen3: `<|endoftext|>`, 151643), and a user of the
    export expects that one."""
    for tree in _source_configs(cfg):
        if tree.get("vocab_size") != cfg.student_model().vocab_size:
            continue
        ids = {}
        for key in ("bos_id", "eos_id", "pad_id"):
            found = tree.get(f"{key[:-3]}_token_id")
            if isinstance(found, int) or (key == "eos_id" and _ints(found)):
                ids[key] = found  # Llama 3's instruct models stop at several
        return ids
    return {}


def _ints(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(i, int) for i in x)


def _source_configs(cfg: Config) -> list[dict]:
    """The config.json of each model the student started from, as one flat dict (Gemma 3's
    multimodal config nests the text model's): a pretrained student's checkpoint, or the
    Hugging Face teacher it was cut from; local directories only."""
    sources = [cfg.student.checkpoint]
    if cfg.student.init == "from_teacher":
        sources.append(cfg.teacher.checkpoint)
    trees = []
    for path in sources:
        found = Path(path) / hf.CONFIG if path and not storage.is_remote(path) else None
        if found is None or not found.is_file():
            continue
        tree = json.loads(found.read_text())
        trees.append({**tree, **(tree.get("text_config") or {})})
    return trees


# ----------------------------------------------------------------------------- tokenizer


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte: the alphabet of the ByteLevel pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _byte_tokenizer_files(tok: ByteTokenizer, max_length: int) -> dict[str, dict]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json for ByteTokenizer."""
    specials = {"<pad>": tok.pad_id, "<s>": tok.bos_id, "</s>": tok.eos_id}
    offset = tok.vocab_size - 256
    vocab = {**specials, **{c: b + offset for b, c in enumerate(_byte_alphabet())}}
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for text, i in specials.items()
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos]
            + [{"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [tok.bos_id], "tokens": ["<s>"]}},
        },
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }
    names = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        **names,
    }
    return {
        "tokenizer.json": tokenizer,
        "tokenizer_config.json": config,
        "special_tokens_map.json": names,
    }
