"""TPU slice shapes: how many hosts (pods) and chips per host a GKE TPU slice of a given
type and topology has. Pure: a table and a lookup, no I/O.

A warmer must compile for the same device count and topology as the training job (both
are in JAX's cache key), so a multi-host slice needs one warmer pod per host, each
requesting every chip of its host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cachewarm.api import constants as c


@dataclass(frozen=True)
class TpuShape:
    hosts: int
    chips_per_host: int
    machine_type: str = ""  # GKE machine type of the nodes, "" when the table was not used


class TpuShapeError(ValueError):
    """The shape cannot be derived: `reason` is a constants.Reason, the message says what
    the table knows."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# GKE's TPU machine shapes: (GKE accelerator label, topology) -> (machine type, chips per
# host); hosts = chips in the topology / chips per host. Multi-host v5e and v6e slices are
# made of 4-chip hosts; v4 and v5p hosts always have 4 chips.
# Sources (checked 2026-11):
#   https://cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus (GKE labels, machine types)
#   https://cloud.google.com/tpu/docs/supported-tpu-configurations (v5e topologies)
#   https://cloud.google.com/tpu/docs/v5p (v5p slice shapes, 4 chips per machine)
#   https://cloud.google.com/tpu/docs/v6e (v6e topologies, hosts, VMs and GKE machine types)
_V4 = ("ct4p-hightpu-4t", 4)
_V5P = ("ct5p-hightpu-4t", 4)
_V5E_4 = ("ct5lp-hightpu-4t", 4)
_V6E_4 = ("ct6e-standard-4t", 4)
TPU_SHAPES: dict[tuple[str, str], tuple[str, int]] = {
    # TPU v4
    **{("tpu-v4-podslice", t): _V4 for t in (
        "2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x12", "8x8x16",
        "8x16x16", "16x16x16")},
    # TPU v5e
    ("tpu-v5-lite-podslice", "1x1"): ("ct5lp-hightpu-1t", 1),
    ("tpu-v5-lite-podslice", "2x2"): _V5E_4,
    ("tpu-v5-lite-podslice", "2x4"): ("ct5lp-hightpu-8t", 8),
    **{("tpu-v5-lite-podslice", t): _V5E_4 for t in ("4x4", "4x8", "8x8", "8x16", "16x16")},
    # TPU v5p
    **{("tpu-v5p-slice", t): _V5P for t in (
        "2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16",
        "16x16x16", "16x16x24")},
    # TPU v6e (Trillium)
    ("tpu-v6e-slice", "1x1"): ("ct6e-standard-1t", 1),
    ("tpu-v6e-slice", "2x2"): _V6E_4,
    ("tpu-v6e-slice", "2x4"): ("ct6e-standard-8t", 8),
    **{("tpu-v6e-slice", t): _V6E_4 for t in ("4x4", "4x8", "8x8", "8x16", "16x16")},
}


def chips(topology: str) -> int:
    """Chips in a topology such as 2x2x4."""
    return math.prod(int(d) for d in topology.split("x"))


def known_topologies(tpu_type: str) -> list[str]:
    """The topologies the table knows for a type, smallest first."""
    return sorted((t for ty, t in TPU_SHAPES if ty == tpu_type), key=lambda t: (chips(t), t))


def known_types() -> list[str]:
    return sorted({ty for ty, _ in TPU_SHAPES})


def table_hosts(tpu_type: str, topology: str) -> int | None:
    """Hosts of a slice as the table knows it; None when the table does not know it."""
    known = TPU_SHAPES.get((tpu_type, topology))
    return None if known is None else chips(topology) // known[1]


def _host_sizes(tpu_type: str) -> set[int]:
    return {n for (ty, _), (_, n) in TPU_SHAPES.items() if ty == tpu_type}


def tpu_shape(tpu_type: str, topology: str, *, hosts: int | None = None,
              chips_per_host: int | None = None) -> TpuShape:
    """Hosts and chips per host of a slice; `hosts` / `chips_per_host` override the table.
    Raises TpuShapeError (reason UnknownTpuShape or InvalidTpuShape)."""
    total = chips(topology)
    where = f"{tpu_type} {topology} ({total} chips)"
    if hosts is None and chips_per_host is None:
        known = TPU_SHAPES.get((tpu_type, topology))
        if known is None:
            topologies = known_topologies(tpu_type)
            what = (f"known topologies of {tpu_type}: {', '.join(topologies)}" if topologies
                    else f"known TPU types: {', '.join(known_types())}")
            raise TpuShapeError(c.Reason.UNKNOWN_TPU_SHAPE,
                                f"No GKE machine shape known for {where}; {what}; "
                                "or set hosts and chipsPerHost on the pool")
        machine, per_host = known
        return TpuShape(hosts=total // per_host, chips_per_host=per_host, machine_type=machine)
    if hosts is not None and chips_per_host is not None:
        if hosts * chips_per_host != total:
            raise TpuShapeError(c.Reason.INVALID_TPU_SHAPE,
                                f"hosts {hosts} x chipsPerHost {chips_per_host} is not the {total} chips of {where}")
    elif hosts is not None:
        if total % hosts:
            raise TpuShapeError(c.Reason.INVALID_TPU_SHAPE, f"{where} cannot be split over {hosts} hosts")
        chips_per_host = total // hosts
    else:
        assert chips_per_host is not None
        if total % chips_per_host:
            raise TpuShapeError(c.Reason.INVALID_TPU_SHAPE,
                                f"{where} is not a whole number of hosts with chipsPerHost {chips_per_host}")
        hosts = total // chips_per_host
    sizes = _host_sizes(tpu_type)
    if sizes and chips_per_host not in sizes:
        layouts = ", ".join(f"{total // n} hosts of {n} chips" for n in sorted(sizes) if total % n == 0)
        raise TpuShapeError(c.Reason.INVALID_TPU_SHAPE,
                            f"{tpu_type} hosts have {' or '.join(str(n) for n in sorted(sizes))} chips, not "
                            f"{chips_per_host}: {where} is {layouts or 'not a valid slice'}")
    return TpuShape(hosts=hosts, chips_per_host=chips_per_host)
