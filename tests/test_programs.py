"""distill.programs: a process builds each distinct program once, and only once."""

import jax
import numpy as np

from distill import programs
from distill.config import DistillLossConfig, ModelConfig, OptimConfig
from distill.mesh import teacher_mesh
from distill.models import attention, model
from distill.types import Batch
from student import eval_programs, train
from teacher.forward import forward_for
from teacher.sharding import batch_sharding, shard_params

CFG = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)


def test_equal_arguments_give_the_same_program_and_others_a_new_one(monkeypatch):
    """Config sections compare by value (a copy is the same key), every argument counts, and
    so does attention's platform."""
    built = []

    def build(cfg, mesh, *, k):
        built.append(k)
        return object()

    mesh = teacher_mesh(jax.devices()[:2], 1, 2)
    first = programs.cached(build, CFG, mesh, k=1)
    assert programs.cached(build, CFG.model_copy(), mesh, k=1) is first
    assert programs.cached(build, CFG, mesh, k=2) is not first
    assert programs.cached(build, CFG.model_copy(update={"d_ff": 64}), mesh, k=1) is not first
    assert programs.cached(build, CFG, teacher_mesh(jax.devices()[2:4], 1, 2), k=1) is not first
    monkeypatch.setattr(attention, "_platform", "tpu")
    assert programs.cached(build, CFG, mesh, k=1) is not first
    assert built == [1, 2, 1, 1, 1]


def test_the_least_recently_used_program_is_dropped_past_the_limit(monkeypatch):
    monkeypatch.setattr(programs, "MAX_PROGRAMS", 2)
    monkeypatch.setattr(programs, "_built", type(programs._built)())

    def make(i):
        return object()

    a = programs.cached(make, 0)
    b = programs.cached(make, 1)
    assert programs.cached(make, 0) is a  # used again: 1 is now the oldest
    programs.cached(make, 2)
    assert programs.cached(make, 0) is a
    assert programs.cached(make, 1) is not b  # dropped, built again


def test_a_runs_programs_are_shared_with_the_next_run_of_equal_settings():
    """The builders runs use (`train.step_for`, `eval_programs.eval_fn_for`, `forward_for`) give one
    jitted function for equal settings, which then compiles once: a second call of the
    same shapes finds its executable in the function's own cache."""
    mesh = teacher_mesh(jax.devices()[:2], 1, 2)
    loss = DistillLossConfig()
    tx, step = train.step_for(CFG, OptimConfig(), 10, mesh, loss_cfg=loss, with_teacher=True)
    again = train.step_for(
        CFG, OptimConfig(), 10, mesh, loss_cfg=loss.model_copy(), with_teacher=True
    )
    assert again[0] is tx and again[1] is step
    other = train.step_for(
        CFG, OptimConfig(), 10, mesh, loss_cfg=DistillLossConfig(loss="jsd"), with_teacher=True
    )
    assert other[1] is not step
    assert eval_programs.eval_fn_for(CFG, mesh) is eval_programs.eval_fn_for(CFG.model_copy(), mesh)
    fwd = forward_for(CFG, mesh, mode="dense")
    assert forward_for(CFG, mesh, mode="logits") is not fwd

    params = shard_params(model.init_params(CFG, 0), CFG, mesh)
    tokens = np.arange(2 * 8, dtype=np.int32).reshape(2, 8) % CFG.vocab_size
    ones = np.ones_like(tokens)
    batch = Batch(tokens, tokens, ones, np.tile(np.arange(8, dtype=np.int32), (2, 1)), ones * 1.0)
    first = fwd(params, jax.device_put(batch, batch_sharding(mesh)))
    second = forward_for(CFG.model_copy(), mesh, mode="dense")  # the next run's build
    assert second is fwd
    again = second(params, jax.device_put(batch, batch_sharding(mesh)))
    assert fwd._cache_size() == 1  # one trace and compile for both runs
    np.testing.assert_array_equal(np.asarray(first.logprobs), np.asarray(again.logprobs))
