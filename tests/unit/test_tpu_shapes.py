"""TPU slice shapes: hosts and chips per host of GKE's TPU machine shapes, the overrides,
and the shapes the table does not know."""

from __future__ import annotations

import pytest

from cachewarm.builders.tpu import TPU_SHAPES, TpuShape, TpuShapeError, chips, table_hosts, tpu_shape

# (type, topology, hosts, chips per host, GKE machine type)
KNOWN = [
    ("tpu-v4-podslice", "2x2x1", 1, 4, "ct4p-hightpu-4t"),
    ("tpu-v4-podslice", "2x2x2", 2, 4, "ct4p-hightpu-4t"),
    ("tpu-v4-podslice", "2x2x4", 4, 4, "ct4p-hightpu-4t"),
    ("tpu-v4-podslice", "4x4x4", 16, 4, "ct4p-hightpu-4t"),
    ("tpu-v4-podslice", "8x8x16", 256, 4, "ct4p-hightpu-4t"),
    ("tpu-v5-lite-podslice", "1x1", 1, 1, "ct5lp-hightpu-1t"),
    ("tpu-v5-lite-podslice", "2x2", 1, 4, "ct5lp-hightpu-4t"),
    ("tpu-v5-lite-podslice", "2x4", 1, 8, "ct5lp-hightpu-8t"),
    ("tpu-v5-lite-podslice", "4x4", 4, 4, "ct5lp-hightpu-4t"),
    ("tpu-v5-lite-podslice", "4x8", 8, 4, "ct5lp-hightpu-4t"),
    ("tpu-v5-lite-podslice", "8x8", 16, 4, "ct5lp-hightpu-4t"),
    ("tpu-v5-lite-podslice", "8x16", 32, 4, "ct5lp-hightpu-4t"),
    ("tpu-v5-lite-podslice", "16x16", 64, 4, "ct5lp-hightpu-4t"),
    ("tpu-v5p-slice", "2x2x1", 1, 4, "ct5p-hightpu-4t"),
    ("tpu-v5p-slice", "2x2x2", 2, 4, "ct5p-hightpu-4t"),
    ("tpu-v5p-slice", "2x2x4", 4, 4, "ct5p-hightpu-4t"),
    ("tpu-v5p-slice", "2x4x4", 8, 4, "ct5p-hightpu-4t"),
    ("tpu-v5p-slice", "4x4x4", 16, 4, "ct5p-hightpu-4t"),
    ("tpu-v5p-slice", "16x16x24", 1536, 4, "ct5p-hightpu-4t"),
    ("tpu-v6e-slice", "1x1", 1, 1, "ct6e-standard-1t"),
    ("tpu-v6e-slice", "2x2", 1, 4, "ct6e-standard-4t"),
    ("tpu-v6e-slice", "2x4", 1, 8, "ct6e-standard-8t"),
    ("tpu-v6e-slice", "4x4", 4, 4, "ct6e-standard-4t"),
    ("tpu-v6e-slice", "8x16", 32, 4, "ct6e-standard-4t"),
    ("tpu-v6e-slice", "16x16", 64, 4, "ct6e-standard-4t"),
]


@pytest.mark.parametrize(("tpu_type", "topology", "hosts", "per_host", "machine"), KNOWN,
                         ids=[f"{t}-{topo}" for t, topo, *_ in KNOWN])
def test_known_shapes(tpu_type: str, topology: str, hosts: int, per_host: int, machine: str) -> None:
    assert tpu_shape(tpu_type, topology) == TpuShape(hosts, per_host, machine)


def test_every_table_row_covers_its_topology_exactly() -> None:
    for (tpu_type, topology), (_, per_host) in TPU_SHAPES.items():
        shape = tpu_shape(tpu_type, topology)
        assert shape.hosts * shape.chips_per_host == chips(topology), (tpu_type, topology)
        assert per_host in (1, 4, 8)


@pytest.mark.parametrize(("tpu_type", "topology", "named"), [
    ("tpu-v5p-slice", "3x3x3", "known topologies of tpu-v5p-slice: 2x2x1, 2x2x2, 2x2x4"),
    ("tpu-v5-lite-podslice", "2x2x1", "known topologies of tpu-v5-lite-podslice: 1x1, 2x2, 2x4, 4x4"),
    ("tpu-v6e-slice", "4x2", "known topologies of tpu-v6e-slice: 1x1, 2x2, 2x4, 4x4"),
    ("tpu-v9-slice", "2x2", "known TPU types: tpu-v4-podslice, tpu-v5-lite-podslice, tpu-v5p-slice, tpu-v6e-slice"),
])
def test_unknown_shapes_name_what_is_known(tpu_type: str, topology: str, named: str) -> None:
    with pytest.raises(TpuShapeError) as err:
        tpu_shape(tpu_type, topology)
    assert err.value.reason == "UnknownTpuShape"
    assert named in str(err.value)
    assert "set hosts and chipsPerHost" in str(err.value)


@pytest.mark.parametrize(("args", "expected"), [
    ({"chips_per_host": 4}, TpuShape(2, 4)),                 # v6e 2x4 as two 4-chip VMs (GKE allows it)
    ({"hosts": 2}, TpuShape(2, 4)),
    ({"hosts": 1}, TpuShape(1, 8)),                          # what the table derives, stated
    ({"hosts": 2, "chips_per_host": 4}, TpuShape(2, 4)),
])
def test_overrides(args: dict[str, int], expected: TpuShape) -> None:
    assert tpu_shape("tpu-v6e-slice", "2x4", **args) == expected


def test_overrides_make_a_shape_the_table_does_not_know_usable() -> None:
    assert tpu_shape("tpu-v9-slice", "4x4x4", chips_per_host=4) == TpuShape(16, 4)


@pytest.mark.parametrize(("tpu_type", "topology", "args", "message"), [
    ("tpu-v5p-slice", "2x2x2", {"hosts": 1}, "tpu-v5p-slice hosts have 4 chips, not 8: tpu-v5p-slice 2x2x2 (8 chips) is 2 hosts of 4 chips"),
    ("tpu-v5p-slice", "2x2x2", {"hosts": 3}, "cannot be split over 3 hosts"),
    ("tpu-v5p-slice", "2x2x2", {"hosts": 2, "chips_per_host": 2}, "hosts 2 x chipsPerHost 2 is not the 8 chips"),
    ("tpu-v9-slice", "2x2", {"chips_per_host": 3}, "not a whole number of hosts"),
])
def test_inconsistent_overrides_are_invalid(tpu_type: str, topology: str, args: dict[str, int], message: str) -> None:
    with pytest.raises(TpuShapeError) as err:
        tpu_shape(tpu_type, topology, **args)
    assert err.value.reason == "InvalidTpuShape"
    assert message in str(err.value)


def test_table_hosts() -> None:
    # What builders/job.pool_shape asks before reading a stored hosts: 1 as unset.
    assert (table_hosts("tpu-v5p-slice", "2x2x2"), table_hosts("tpu-v6e-slice", "2x4")) == (2, 1)
    assert table_hosts("tpu-v9-slice", "2x2x2") is None
