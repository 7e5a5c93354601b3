"""The hop of teacher outputs to the training mesh is device to device: with JAX's transfer
guards refusing every host transfer, the local loop's hop and student step run on real
meshes, for inference and training meshes of the same and of different sizes.

On CPU devices the device-to-host guard never fires (their buffers already are host
memory), so a host round trip shows as its host-to-device leg; both guards are set, so on
accelerators either leg fails the test. The batch's own host-to-device puts happen before
the guard, as the loop makes them (they are not teacher output).
"""

import contextlib

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from distill import handoff
from distill.config.load import config_from_dict
from distill.mesh import build_meshes
from distill.models import model
from distill.types import Batch
from student import train
from student.executor import LocalExecutor
from teacher.forward import make_forward
from teacher.sharding import batch_sharding, shard_params
from tests.conftest import tiny_config

HOST_COPY = "Disallowed host-to-device transfer"


@contextlib.contextmanager
def no_host_transfers():
    with (
        jax.transfer_guard_host_to_device("disallow_explicit"),
        jax.transfer_guard_device_to_host("disallow_explicit"),
    ):
        yield


def _setup(corpus_dir, tmp_path, tdp, tp, sdp, fsdp, top_k, placement="split"):
    tree = tiny_config(str(corpus_dir), str(tmp_path), train={"batch_size": 8})
    tree["mesh"] = {"teacher": {"dp": tdp, "tp": tp}, "student": {"dp": sdp, "fsdp": fsdp}}
    tree["mesh"]["placement"] = placement
    tree["teacher"]["top_k"] = top_k
    tree["teacher"]["model"]["attention"] = "reference"  # compiles fastest; not what is tested
    cfg = config_from_dict(tree)
    cfg.resolve_dtypes("cpu")
    meshes = build_meshes(cfg)
    tcfg = cfg.teacher.model
    forward = make_forward(
        tcfg, meshes.teacher, mode="topk" if top_k else "dense", top_k=top_k, temperature=2.0
    )
    t_params = shard_params(model.init_params(tcfg, 0), tcfg, meshes.teacher)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (8, cfg.train.seq_len)).astype(np.int32)
    ones = np.ones_like(tokens)
    pos = np.tile(np.arange(cfg.train.seq_len, dtype=np.int32), (8, 1))
    host = Batch(tokens, np.roll(tokens, -1, 1), ones, pos, ones.astype(np.float32))
    out = forward(t_params, jax.device_put(host, batch_sharding(meshes.teacher)))
    return cfg, meshes, host, out


CASES = [  # teacher dp, tp; student dp, fsdp; top_k
    (1, 2, 2, 1, 8),  # the tiny config: one teacher row block per student device
    (2, 2, 2, 1, None),  # 4 blocks -> 2 devices: each student shard joins two, dense
    (2, 2, 2, 2, 8),  # a dp x fsdp student: 4 -> 4
    (1, 2, 4, 1, None),  # 2 blocks -> 4 devices: sliced on the teacher's devices first
]


@pytest.mark.parametrize("tdp,tp,sdp,fsdp,top_k", CASES)
def test_hop_and_step_never_touch_the_host(corpus_dir, tmp_path, tdp, tp, sdp, fsdp, top_k):
    cfg, meshes, host, out = _setup(corpus_dir, tmp_path, tdp, tp, sdp, fsdp, top_k)
    tx, step_fn = train.distill_step_for(cfg, meshes.student)
    state = train.init_state(cfg.student_model(), tx, 0, meshes.student)
    executor = LocalExecutor(meshes.student, lambda: (state, None, 0), step_fn)
    executor.start()
    split = train.batch_sharding(meshes.student)
    s_batch = jax.device_put(host, split)  # the batch's own put, as `executor.step` makes it
    jax.block_until_ready((out, s_batch))
    try:
        with no_host_transfers():
            moved = executor.hop(out)
            metrics = executor.step(1, s_batch, moved)
            jax.block_until_ready((moved, metrics))
    finally:
        executor.finish()
    assert np.isfinite(executor.read(metrics, True)["loss"])
    for got, sent in zip(jax.tree.leaves(moved), jax.tree.leaves(out), strict=True):
        assert got.sharding == split
        np.testing.assert_array_equal(np.asarray(got), np.asarray(sent))

    # the guard is live: a deliberate host round trip of the same output is refused
    with pytest.raises(Exception, match=HOST_COPY), no_host_transfers():
        jax.device_put(jax.device_get(out), split).block_until_ready()


@pytest.mark.parametrize("tdp,tp,sdp,fsdp", [(2, 1, 2, 1), (1, 2, 2, 1), (2, 2, 4, 1)])
def test_colocated_hop_keeps_each_devices_rows(corpus_dir, tmp_path, tdp, tp, sdp, fsdp):
    """Colocated meshes: where a device's teacher rows are its student rows the buffer is
    handed over as it is (no copy); where they cover them, sliced there; nothing crosses
    devices (each student shard stays on the device that held its rows) nor the host."""
    _, meshes, _, out = _setup(corpus_dir, tmp_path, tdp, tp, sdp, fsdp, 8, "colocated")
    split = train.batch_sharding(meshes.student)
    jax.block_until_ready(out)
    with no_host_transfers():
        moved = handoff.hop(out, split)
        jax.block_until_ready(moved)
    for got, sent in zip(jax.tree.leaves(moved), jax.tree.leaves(out), strict=True):
        assert got.sharding == split
        np.testing.assert_array_equal(np.asarray(got), np.asarray(sent))
        held = {s.device: s.data.unsafe_buffer_pointer() for s in sent.addressable_shards}
        same = [s.data.unsafe_buffer_pointer() == held[s.device] for s in got.addressable_shards]
        if tdp * tp == sdp and tp == 1:  # the agreeing layout: the very buffers
            assert all(same)


def test_other_layouts_would_go_through_the_host(corpus_dir, tmp_path):
    """What the batch-major layout and `handoff.hop` buy: `jax.device_put` onto the student
    reshards through the host when the row blocks differ (4 teacher devices, 2 student
    devices), and so does the vocabulary-sharded layout the dense output had before."""
    _, meshes, _, out = _setup(corpus_dir, tmp_path, 2, 2, 2, 1, None)
    split = train.batch_sharding(meshes.student)
    with pytest.raises(Exception, match=HOST_COPY), no_host_transfers():
        jax.device_put(out, split).logprobs.block_until_ready()
    vocab_sharded = jax.device_put(out.logprobs, NamedSharding(meshes.teacher, P(None, None, "tp")))
    with pytest.raises(Exception, match=HOST_COPY), no_host_transfers():
        jax.device_put(vocab_sharded, split).block_until_ready()
    with no_host_transfers():
        handoff.hop(out, split).logprobs.block_until_ready()
