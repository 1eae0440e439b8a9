"""A program whose persistent-cache key changes in every process (issue 30): a jitted step
that calls a custom_partitioning primitive, sharded over two devices. With jax 0.10.2 on
CPU each process computes another key for `jit_unstable_step` (the primitive's callback
is a per-process value in the lowered program), so a warmed entry is never hit; its other
programs' keys are stable. Run with more than one device (it asks for two host devices
itself when XLA_FLAGS sets none: the flag is left out of keys, so it changes nothing else).

Usage: python unstable_program.py   (prints one JSON line: JAX's cache counters)
"""

from __future__ import annotations

import json
import os
from collections import Counter

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.custom_partitioning import custom_partitioning  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

events: Counter[str] = Counter()
jax.monitoring.register_event_listener(lambda name, **_: events.update([name]))


@custom_partitioning
def double(x):  # type: ignore[no-untyped-def]
    return x * 2


def _infer(mesh, arg_shapes, result_shape):  # type: ignore[no-untyped-def]
    return arg_shapes[0].sharding


def _partition(mesh, arg_shapes, result_shape):  # type: ignore[no-untyped-def]
    return mesh, (lambda x: x * 2), arg_shapes[0].sharding, (arg_shapes[0].sharding,)


double.def_partition(infer_sharding_from_operands=_infer, partition=_partition, sharding_rule="i -> i")


def unstable_step(x):  # type: ignore[no-untyped-def]
    return double(x) + 1


def main() -> None:
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    step = jax.jit(unstable_step, in_shardings=sharding, out_shardings=sharding)
    out = step(jnp.ones((8,)))
    print(json.dumps({"sum": float(out.sum()), "devices": jax.device_count(),
                      "requests": events["/jax/compilation_cache/compile_requests_use_cache"],
                      "hits": events["/jax/compilation_cache/cache_hits"]}))


if __name__ == "__main__":
    main()
