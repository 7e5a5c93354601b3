"""`distill.distributed`: two real processes join one JAX group with gloo collectives on
CPU; gloo's per-clique "[Gloo] Rank i is connected" lines never reach stdout, whole or in
the pieces its threads interleave, and everything else printed (from Python, in order, or
from C) does."""

import random
import textwrap

import pytest

from distill.distributed import GlooChatter
from tests.conftest import run_jax_group

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
    for i, text in enumerate(run_jax_group(tmp_path, MEMBER)):
        assert "Gloo" not in text and "peer ranks" not in text, text
        lines = text.split("\n")
        assert lines.count("from C") == 1, text  # C's own text passes the filter ...
        lines.remove("from C")  # ... in its own stream, so in any order with Python's
        assert lines == [f"joined {i} 4", "sum 16.0", "rows [4. 4.]", "end"], text


def gloo_pieces(rank: int, peers: int) -> list[bytes]:
    """One gloo message as its thread writes it: one write per `<<`, then `std::endl`."""
    return [
        b"[Gloo] Rank ", str(rank).encode(), b" is connected to ", str(peers).encode(),
        b" peer ranks. ", b"Expected number of connected peer ranks is : ",
        str(peers).encode(), b"\n",
    ]  # fmt: skip


@pytest.mark.parametrize("seed", range(40))
def test_interleaved_gloo_messages_are_dropped_whole(seed):
    """Bursts of 1-3 messages whose threads' writes interleave at random, between lines of
    other C text; only those lines come through (fed line by line, as the pipe is read)."""
    rng = random.Random(seed)
    stream, wanted = [], []
    for burst in range(4):
        threads = [
            gloo_pieces(rng.randrange(8), rng.randrange(1, 16)) for _ in range(rng.randint(1, 3))
        ]
        while threads:
            thread = rng.choice(threads)
            stream.append(thread.pop(0))
            if not thread:
                threads.remove(thread)
        wanted.append(f"C line {burst} 1\n".encode())
        stream.append(wanted[-1])
    keep = GlooChatter()
    lines = b"".join(stream).splitlines(keepends=True)
    assert b"".join(keep(line) for line in lines) == b"".join(wanted)
    assert keep.open == 0


def test_gloo_chatter_keeps_text_before_it_and_digits_when_no_message_is_open():
    keep = GlooChatter()
    assert keep(b"partial " + b"".join(gloo_pieces(0, 1))) == b"partial "
    assert keep(b"7\n") == b"7\n"
    assert keep.open == 0
