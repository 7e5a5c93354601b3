"""The row hand-off between groups (`pipelines.ray.rows`) across two real JAX processes
(gloo collectives on CPU), on layouts whose processes hold rows in no simple order: a
teacher `dp=2 x tp=2` whose dp runs from process 1 to process 0, and a student `dp=4`
that interleaves the processes (as a slice-wide TPU layout may). Each process sends the
other its pieces through files, as the actors do through Ray's object store; the global
arrays the student assembles hold the teacher's rows, checked against a single-process
reference by a jitted reduction over the whole student mesh."""

import json
import textwrap

from tests.conftest import run_jax_group

MEMBER = textwrap.dedent(
    """
    import json, os, pickle, sys, time
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from distill.distributed import join
    from distill.types import Batch, TeacherOutput
    from pipelines.ray import rows as ray_rows

    address, me, tmp = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    join(address, 2, me, "cpu")
    d = jax.devices()  # process 0's two, then process 1's
    B = 8
    values = np.arange(B * 3 * 5, dtype=np.float32).reshape(B, 3, 5)
    ids = (values % 7).astype(np.int32)

    def put(x, sharding):
        return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

    teacher = Mesh(np.array([d[2], d[3], d[0], d[1]]).reshape(2, 2), ("dp", "tp"))
    out = TeacherOutput(*(put(x, NamedSharding(teacher, P("dp"))) for x in (values, ids)))
    student = NamedSharding(Mesh(np.array([d[0], d[2], d[1], d[3]]), ("dp",)), P("dp"))
    owners = ray_rows.row_owners(student)
    mine = ray_rows.spans(owners, me, B)

    parts = ray_rows.teacher_parts(out, owners)
    with open(f"{tmp}/parts{me}.tmp", "wb") as f:
        pickle.dump(parts, f)
    os.rename(f"{tmp}/parts{me}.tmp", f"{tmp}/parts{me}")
    while not os.path.exists(f"{tmp}/parts{1 - me}"):
        time.sleep(0.05)
    sent = [pickle.load(open(f"{tmp}/parts{q}", "rb"))[me] for q in (0, 1)]
    rows, nbytes = ray_rows.student_rows(sent, mine)
    assert (rows.logprobs == ray_rows.take(values, mine)).all()
    got = ray_rows.global_arrays(rows, student, B)
    whole = NamedSharding(student.mesh, P())
    sums = jax.jit(lambda x: x.sum(axis=(1, 2)), out_shardings=whole)(got.logprobs)
    assert np.array_equal(np.asarray(sums), values.sum(axis=(1, 2))), np.asarray(sums)
    ids_back = jax.jit(lambda x: x, out_shardings=whole)(got.ids)
    assert np.array_equal(np.asarray(ids_back), ids)
    assert (ray_rows.local_rows(got.ids) == ray_rows.take(ids, mine)).all()
    print(json.dumps({"owners": owners, "mine": mine, "bytes": nbytes,
                      "pieces": [len(p) for p in sent]}))
    """
)


def test_rows_reach_an_interleaved_student_group(tmp_path):
    outs = run_jax_group(tmp_path, MEMBER, str(tmp_path))
    got = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    assert [g["owners"] for g in got] == [[0, 1, 0, 1]] * 2
    assert [g["mine"] for g in got] == [[[0, 2], [4, 6]], [[2, 4], [6, 8]]]
    # teacher process 1 holds rows 0-3, process 0 rows 4-7: each student process gets one
    # piece from each, 4 rows of 15 float32 logprobs and 15 int32 ids
    assert [g["pieces"] for g in got] == [[1, 1], [1, 1]]
    assert [g["bytes"] for g in got] == [4 * 15 * 8] * 2
