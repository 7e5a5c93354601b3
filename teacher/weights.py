"""Where the teacher's weights live and how they are read.

`teacher.checkpoint` is an Orbax checkpoint written by distill (by default the bootstrap's
`<output_dir>/teacher`) or a Hugging Face directory (`teacher.hf`). `load_teacher` reads it
straight into the layout of the inference mesh (split over `tp`, replicated over `dp`:
`teacher.sharding`); `random_teacher` makes random weights in that layout (benchmarks);
`student_init_params` reads what a student starts from straight into its placement, one
tensor at a time: a pretrained student's own Hugging Face checkpoint (`student.checkpoint`),
or the layers a `student.init: from_teacher` student keeps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from distill.checkpoint import abstract_like, load_param_part, load_params
from distill.config import Config
from distill.mesh import PP, TP
from distill.models import model, parts
from distill.outputs import teacher_path
from teacher import sharding, stages


def held_dtype(cfg: Config):
    """The dtype the teacher's weights are held in on its devices: bfloat16 with
    `teacher.dtype: bfloat16` (converted once, as they are read), else float32."""
    return jnp.bfloat16 if cfg.teacher.dtype == "bfloat16" else jnp.float32


def load_teacher(cfg: Config, mesh) -> dict:
    """Read the teacher checkpoint straight into the layout of the inference mesh (`dp` x
    `tp`): each device reads only its own slices, which every dp group shares. A Hugging
    Face directory is read by `teacher.hf`.

    With `teacher.dtype: bfloat16` the weights are converted once while they are read and
    held in bfloat16 (half the memory; the forward would cast them anyway); with float32
    they are held in float32."""
    mcfg = cfg.teacher.model
    held = held_dtype(cfg)
    if cfg.teacher.is_hf():
        from teacher.hf import load_hf_teacher

        return load_hf_teacher(cfg.teacher.checkpoint, mcfg, mesh, dtype=held)
    target = sharding.shardings(mcfg, mesh)
    pp = mesh.shape.get(PP, 1)
    padded = stages.stacked_layers(mcfg.n_layers, pp) != mcfg.n_layers
    if padded:  # read whole over pp, then padded with zero layers and split (small teachers)
        target = sharding.shardings(mcfg, mesh, pp=1)
    kvs = (mcfg.n_kv_heads, mcfg.global_kv_heads or mcfg.n_kv_heads)
    expand = min(kvs) < mesh.shape[TP]
    if expand:  # stored with n_kv_heads KV heads: read those replicated, then repeat per shard
        rep = NamedSharding(mesh, P())
        kv = {k: rep for k in sharding.KV_KEYS if k in target["layers"]}
        target = dict(target, layers=dict(target["layers"], **kv))
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, held), model.abstract_params(mcfg)
    )  # Orbax converts to the target dtype as it reads
    params = load_params(teacher_path(cfg), abstract_like(shapes, target))
    if padded:
        params = sharding.expand_kv_heads(params, mcfg, mesh.shape[TP]) if expand else params
        pad = functools.partial(stages.pad_layers, cfg=mcfg, pp=pp)
        return jax.jit(pad, out_shardings=sharding.shardings(mcfg, mesh))(params)
    return sharding.shard_params(params, mcfg, mesh) if expand else params


def random_teacher(cfg: Config, mesh) -> dict:
    """Random weights of the configured teacher's shape, made on `mesh` in the layout and
    dtype `load_teacher` gives (`distill bench --role teacher`: speed does not care what
    the weights are). No host ever holds them."""
    mcfg = cfg.teacher.model
    held = held_dtype(cfg)

    def init() -> dict:
        params = jax.tree.map(lambda x: x.astype(held), model.init_params(mcfg, cfg.run.seed))
        params = stages.pad_layers(params, mcfg, mesh.shape.get(PP, 1))
        return sharding.expand_kv_heads(params, mcfg, mesh.shape[TP])

    return jax.jit(init, out_shardings=sharding.shardings(mcfg, mesh))()


def student_init_params(cfg: Config, shardings=None) -> dict | None:
    """Float32 parameters the student starts from, each made in its placement: `shardings`
    (the student's parameter shardings on its mesh, a tree like its parameters; None: the
    host's CPU device). A pretrained student's checkpoint (`student.checkpoint`); with
    `student.init: from_teacher` the teacher's embeddings, final norm, head and the layers
    `cfg.init_layers()`; None: random.

    Only the tensors the student keeps are read, one at a time: a Hugging Face checkpoint
    each device's slice at a time (`teacher.hf.read_hf_layers`), a distill checkpoint one
    stored tensor at a time (the kept layers picked from its stacked layers, the rest
    dropped before the next)."""
    if cfg.student.checkpoint is not None:
        from teacher.hf import read_hf_layers

        scfg = cfg.student_model()
        return read_hf_layers(cfg.student.checkpoint, scfg, list(range(scfg.n_layers)), shardings)
    if cfg.student.init != "from_teacher":
        return None
    layers, mcfg = cfg.init_layers(), cfg.teacher.model
    if cfg.teacher.is_hf():
        from teacher.hf import read_hf_layers

        return read_hf_layers(cfg.teacher.checkpoint, mcfg, layers, shardings)
    return _kept_from_checkpoint(teacher_path(cfg), mcfg, layers, shardings)


def _kept_from_checkpoint(path: str, mcfg, layers: list[int], shardings) -> dict:
    """The student's starting parameters from a distill teacher checkpoint: each top-level
    tensor restored straight into its placement, each stacked layer tensor restored alone
    on the host, its kept layers placed and the rest dropped before the next."""
    host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    abstract = model.abstract_params(mcfg)

    def one(*keys: str, placed=None) -> jax.Array:
        """The stored tensor at `keys`, alone, in float32 on `placed` (None: where the
        student's parameter goes)."""
        where = placed or (host if shardings is None else _at(shardings, keys))
        part = jax.ShapeDtypeStruct(_at(abstract, keys).shape, jnp.float32, sharding=where)
        for k in reversed(keys):
            part = {k: part}
        return _at(load_param_part(path, part), keys)

    params: dict = {key: one(key) for key in abstract if key != "layers"}
    params["layers"] = {}
    for key in abstract["layers"]:
        holds = parts.part_layers(mcfg, parts.weight_part(key))
        slots = [parts.layer_slot(mcfg, key, i) for i in layers if holds[i]]
        if not slots:  # a part none of the kept layers holds
            continue
        kept = np.asarray(one("layers", key, placed=host))[np.asarray(slots)]
        where = host if shardings is None else shardings["layers"][key]
        params["layers"][key] = jax.device_put(kept, where)
        del kept
    return params


def _at(tree: dict, keys: tuple[str, ...]):
    for k in keys:
        tree = tree[k]
    return tree
