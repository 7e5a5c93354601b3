"""`distill.distributed`: two real processes join one JAX group with gloo collectives on
CPU; gloo's per-clique "[Gloo] Rank i is connected" lines never reach stdout, everything
else printed (from Python or C, whole lines or around gloo's) does, in order."""

import subprocess
import sys
import textwrap

from distill.distributed import free_port

MEMBER = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from distill.distributed import join

    join(sys.argv[1], 2, int(sys.argv[2]), "cpu")
    print("joined", jax.process_index(), len(jax.devices()), flush=True)
    os.write(1, b"from C\\n")
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices())
    x = jax.make_array_from_callback(
        (4, 4), NamedSharding(mesh, P("a", "b")), lambda i: np.ones((4, 4), np.float32)[i]
    )
    print("sum", float(jax.jit(jnp.sum)(x)))  # a clique over all 4 devices
    print("rows", jax.jit(lambda x: x.sum(0))(x).addressable_shards[0].data)  # 2-device ones
    print("end", end="")  # no newline: the filter passes it on at exit
    """
)


def test_two_processes_join_and_gloo_chatter_is_dropped(tmp_path):
    script = tmp_path / "member.py"
    script.write_text(MEMBER)
    address = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), address, str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for i, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, err.decode()[-2000:]
        text = out.decode()
        assert "Gloo" not in text
        assert text == f"joined {i} 4\nfrom C\nsum 16.0\nrows [4. 4.]\nend", text
