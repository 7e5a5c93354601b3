"""Mesh layout by topology (`distill.mesh.device_grid`), on stand-in devices: the layout
only reads a device's platform, kind, process, slice, id and TPU coordinates."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from distill.mesh import device_grid, granule_split


@dataclass(frozen=True)
class Dev:
    id: int
    process_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"
    coords: tuple[int, int, int] = (0, 0, 0)
    core_on_chip: int = 0
    slice_index: int = 0


def ids(grid) -> list[list[int]]:
    return [[d.id for d in row] for row in grid]


@pytest.mark.parametrize(
    "shape, granules, split",
    [
        ((4, 1), 2, ((2, 1), (2, 1))),  # student dp=4 over 2 hosts: dp crosses them
        ((1, 4), 2, ((1, 2), (1, 2))),  # teacher tp=4 over 2 hosts: tp must cross
        ((2, 4), 2, ((2, 1), (1, 4))),  # dp=2 x tp=4 on 2 hosts: each tp group on one host
        ((2, 4), 4, ((2, 2), (1, 2))),
        ((6, 2), 4, ((2, 2), (3, 1))),
    ],
)
def test_the_outer_axes_cross_hosts_first(shape, granules, split):
    assert granule_split(shape, granules) == split


def test_axes_that_cannot_split_over_the_hosts_are_refused():
    with pytest.raises(ValueError, match="3 hosts do not split the axes"):
        granule_split((2, 4), 3)


def test_cpu_devices_keep_their_order_grouped_by_process():
    """No topology on CPU: one process keeps the order given; several are grouped by
    process, in process order (what the multi-process tests' meshes get)."""
    one = [Dev(i, 0) for i in (3, 1, 2, 0)]
    assert ids(device_grid(one, (2, 2))) == [[3, 1], [2, 0]]
    two = [Dev(2, 1), Dev(3, 1), Dev(0, 0), Dev(1, 0)]
    assert ids(device_grid(two, (1, 4))) == [[0, 1, 2, 3]]
    assert ids(device_grid(two, (4, 1))) == [[0], [1], [2], [3]]


def test_gpu_hosts_keep_tensor_parallel_groups_on_one_host():
    """2 hosts x 4 GPUs: the inner axis stays on a host's NVLink where it fits, and the
    devices of a host are ordered by id."""
    gpus = [Dev(i, i // 4, "gpu", "NVIDIA H100") for i in (4, 5, 6, 7, 3, 2, 1, 0)]
    assert ids(device_grid(gpus, (2, 4))) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    fsdp = device_grid(gpus, (4, 2))  # student dp=4 x fsdp=2: each fsdp pair on one host
    assert all(len({d.process_index for d in row}) == 1 for row in fsdp)
    assert ids(device_grid(gpus, (1, 8))) == [[0, 1, 2, 3, 4, 5, 6, 7]]


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_pipeline_stages_are_hosts(platform):
    """A teacher in pp=2 stages of tp=4 over 2 hosts (`pipelines/llama3-405b-to-8b.yaml`'s
    layout, smaller): `pp`, the outermost axis, crosses the hosts, so stage s is process
    s's devices and each tp group stays on its host; over 4 hosts, each stage is 2 hosts."""
    devs = [Dev(i, i // 4, platform, "NVIDIA H100") for i in (4, 5, 6, 7, 3, 2, 1, 0)]
    grid = device_grid(devs, (2, 1, 1, 4))  # pp x dp x ep x tp
    assert [[d.process_index for d in stage.flat] for stage in grid] == [[0] * 4, [1] * 4]
    assert [sorted(row) for row in ids(grid.reshape(2, 4))] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    four = device_grid([Dev(i, i // 2, platform) for i in range(8)], (2, 1, 1, 4))
    assert [sorted({d.process_index for d in s.flat}) for s in four] == [[0, 1], [2, 3]]


def _v5e_slice(hosts_x: int, hosts_y: int) -> list[Dev]:
    """A TPU v5e slice of (2 hosts_x) x (2 hosts_y) chips, each host a 2 x 2 block, listed
    process by process as `jax.devices()` does."""
    devs = []
    for host in range(hosts_x * hosts_y):
        hx, hy = host % hosts_x, host // hosts_x
        for j in range(4):
            x, y = 2 * hx + j % 2, 2 * hy + j // 2
            devs.append(Dev(len(devs), host, "tpu", "TPU v5 lite", (x, y, 0)))
    return devs


def test_one_tpu_host_is_laid_out_by_jax_topology_rules():
    """v5e-8 (2 x 4 chips, one host): the layout is `mesh_utils`' (for a v5e tray, its
    known ring order), not the order `jax.devices()` lists the chips in."""
    from jax.experimental import mesh_utils

    chips = [Dev(i, 0, "tpu", "TPU v5 lite", (i % 2, i // 2, 0)) for i in range(8)]
    grid = device_grid(chips, (2, 4))
    expected = mesh_utils.create_device_mesh((2, 4), chips, allow_split_physical_axes=True)
    assert ids(grid) == ids(expected)
    assert ids(grid) != [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_multi_host_tpu_slice_is_laid_out_slice_wide_for_either_role():
    """v5e 4x4 (4 hosts of 2 x 2): any mesh over the slice is `mesh_utils`' layout of the
    whole torus, the student's too, though its hosts may then interleave in the flat
    order (dp=4 x fsdp=4: each fsdp ring a row of the torus, over two hosts): the row
    hand-off follows whichever rows a process holds."""
    from jax.experimental import mesh_utils

    chips = _v5e_slice(2, 2)
    for shape in ((4, 4), (2, 8), (1, 16)):
        whole = mesh_utils.create_device_mesh(shape, chips, allow_split_physical_axes=True)
        assert ids(device_grid(chips[::-1], shape)) == ids(whole)
    flat = [d.process_index for d in device_grid(chips, (4, 4)).flat]
    assert flat == [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]


def _hops(row) -> list[int]:
    """Chip-to-chip distances on the torus between neighbours of a ring over `row`."""
    xy = [d.coords[:2] for d in row]
    return [abs(a[0] - b[0]) + abs(a[1] - b[1]) for a, b in zip(xy, xy[1:] + xy[:1], strict=True)]


def test_tensor_parallelism_over_a_tpu_slice_is_one_ring():
    """tp=16 on a v5e 4x4 of 4 hosts is one ring of neighbouring chips; split host by host
    it would jump between hosts (hops of 3 to 6 chips). Two slices are split by slice."""
    from jax.experimental import mesh_utils

    chips = _v5e_slice(2, 2)
    assert _hops(device_grid(chips[::-1], (1, 16))[0]) == [1] * 16
    by_host = mesh_utils.create_hybrid_device_mesh(
        (1, 4), (1, 4), chips, process_is_granule=True, allow_split_physical_axes=True
    )
    assert max(_hops(by_host[0])) > 2
    two_slices = [Dev(d.id + 16 * s, d.process_index + 4 * s, "tpu", d.device_kind, d.coords,
                      slice_index=s) for s in (0, 1) for d in chips]  # fmt: skip
    grid = device_grid(two_slices, (2, 16))  # dp across the slices
    assert [{d.slice_index for d in row} for row in grid] == [{0}, {1}]


def test_hosts_that_the_axes_split_unevenly_interleave():
    """dp=6 x fsdp=2 on 4 hosts of 3: dp crosses the hosts as far as it divides them (2),
    fsdp the rest (2), and a host's 3 devices run along dp; the hosts interleave in the
    flat order, which the row hand-off follows (`ray_rows.row_owners`)."""
    devs = [Dev(i, i // 3) for i in range(12)]
    assert ids(device_grid(devs[::-1], (6, 2))) == [
        [2, 5], [1, 4], [0, 3], [8, 11], [7, 10], [6, 9]
    ]  # fmt: skip


def test_a_part_of_a_torus_that_is_no_box_keeps_the_given_order(caplog):
    chips = _v5e_slice(1, 1)[:3]  # 3 chips of a 2 x 2: a hole
    assert ids(device_grid(chips, (1, 3))) == [[0, 1, 2]]
    assert "kept the devices' order" in caplog.text
