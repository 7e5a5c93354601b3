"""A student's starting weights are read from a Hugging Face checkpoint straight into their
placement on the training mesh: equal to the checkpoint's tensors, with at most one
device's slice of one parameter (and one stored layer's slice) on the host at a time.
tracemalloc traces what Python and numpy allocate (the slices read, their float32
conversions), not the devices' buffers; reading whole tensors in float32 into a host tree
first, as the loader did, holds the whole kept model there."""

import tracemalloc

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from distill.mesh import student_mesh  # noqa: E402
from distill.models import hf  # noqa: E402
from student import train  # noqa: E402
from teacher import hf as teacher_hf  # noqa: E402
from teacher.hf import read_hf_layers  # noqa: E402

QWEN2 = dict(
    vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    tie_word_embeddings=False,
)  # fmt: skip
KEPT = [0, 3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(a tiny Qwen2 saved by transformers in bfloat16, its tensors in float32)."""
    path = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(0)
    ref = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN2)).to(torch.bfloat16)
    ref.save_pretrained(str(path))
    return path, {k: v.float().numpy() for k, v in ref.state_dict().items()}


def _expected(cfg, tensors: dict) -> dict:
    """distill's layout of the kept model, from the checkpoint's tensors by name: [out, in]
    transposed to [in, out], the kept layers stacked in order."""
    want: dict = {"layers": {}}
    for name, (key, layer, transposed) in hf.weight_names(cfg).items():
        x = tensors[name].T if transposed else tensors[name]
        if layer is None:
            want[key] = x
        elif layer in KEPT:
            want["layers"].setdefault(key, [None] * len(KEPT))[KEPT.index(layer)] = x
    want["layers"] = {k: np.stack(v) for k, v in want["layers"].items()}
    return want


def test_kept_layers_are_read_into_place_one_slice_at_a_time(checkpoint, monkeypatch):
    """Every read is one device's slice, allocating on the host that float32 slice and the
    stored slice it came from, once per distinct slice (a replica copies it device to
    device); nothing else stays on the host. (On CPU a placed slice may alias the numpy
    array it was read into, so what the parameters hold is traced too: the reads are
    watched one by one.)"""
    path, tensors = checkpoint
    cfg = hf.read_model_config(path)
    scfg = cfg.model_copy(update={"n_layers": len(KEPT)})
    where = train.param_shardings(scfg, student_mesh(jax.devices(), 2, 4))
    reads: list[tuple[tuple, int]] = []  # (shape read, host bytes allocated while reading)
    real = teacher_hf._kept_slices

    def watched(*args):
        read = real(*args)

        def one(index):
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            x = read(index)
            reads.append((x.shape, tracemalloc.get_traced_memory()[1] - before))
            return x

        return one

    monkeypatch.setattr(teacher_hf, "_kept_slices", watched)
    tracemalloc.start()
    try:
        params = read_hf_layers(path, cfg, KEPT, where)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()

    want = _expected(cfg, tensors)
    assert jax.tree.structure(params) == jax.tree.structure(want)
    leaves = jax.tree.leaves(params)
    for got, w, s in zip(leaves, jax.tree.leaves(want), jax.tree.leaves(where), strict=True):
        assert isinstance(got, jax.Array) and got.dtype == np.float32 and got.sharding == s
        np.testing.assert_array_equal(np.asarray(got), w)
    distinct = sum(
        len({str(i) for i in x.sharding.devices_indices_map(x.shape).values()}) for x in leaves
    )
    shards = {x.sharding.shard_shape(x.shape) for x in leaves}
    assert len(reads) == distinct  # one read per distinct slice: replicas are copied
    assert {shape for shape, _ in reads} <= shards  # each a device's slice, never whole
    for shape, allocated in reads:  # the float32 slice, the bfloat16 one read, small change
        assert allocated <= 1.5 * np.prod(shape) * 4 + 16 * 1024, (shape, allocated)
    assert held <= sum(x.nbytes for x in leaves)  # no host copy outlives the read
