"""Programs of each kind a warm pod may still compile (issue 30), one per kind, and the
warm targets that leave them so. A warmer runs `targets` (warmup.minCompileTimeSecs 0.3);
a pod runs this file and compiles, against that cache:

- jit_train_step: warmed, and loaded (a slow one: ~1.5 s to compile on CPU);
- jit_eval_step: not in the targets (NotWarmed; slow to compile too, or it would read as
  BelowWriteThreshold: the operator knows the warmer's threshold, not the programs it ran);
- jit_callback_step: a jax.pure_callback, which JAX never writes (NotCacheable);
- jit_unstable_step: a custom_partitioning primitive, whose key changes in every process
  (KeyUnstable; slow to compile like train_step, so the warmer writes it);
- jit_small_step: compiles in well under 0.3 s (~0.04 s), so the warmer does not write it
  (BelowWriteThreshold).

It asks for two host devices itself (custom_partitioning's key is stable on one) when
XLA_FLAGS sets none. Usage: python miss_kinds.py (prints one JSON line: JAX's cache counters).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.custom_partitioning import custom_partitioning  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

LAYERS = 48  # about 1.5 s of XLA:CPU compile (0.75 s on a fast machine): well over the 0.3 s threshold
SHAPE = (8, 8)
events: Counter[str] = Counter()
jax.monitoring.register_event_listener(lambda name, **_: events.update([name]))


def _deep(x: jax.Array, w: jax.Array) -> jax.Array:
    for i in range(LAYERS):
        x = jnp.tanh(x @ w + i) * jnp.cos(x + i)
    return x


@jax.jit
def train_step(x: jax.Array, w: jax.Array) -> jax.Array:
    return _deep(x, w).sum()


@jax.jit
def eval_step(x: jax.Array, w: jax.Array) -> jax.Array:
    return _deep(x, w).max()


def _on_host(x: Any) -> Any:
    return np.asarray(x) * 2


@jax.jit
def callback_step(x: jax.Array) -> jax.Array:
    return jax.pure_callback(_on_host, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1


@custom_partitioning
def _double(x):  # type: ignore[no-untyped-def]
    return x * 2


def _partition(mesh, arg_shapes, result_shape):  # type: ignore[no-untyped-def]
    return mesh, (lambda x: x * 2), arg_shapes[0].sharding, (arg_shapes[0].sharding,)


_double.def_partition(partition=_partition, sharding_rule="i j -> i j")


def _unstable(x: jax.Array, w: jax.Array) -> jax.Array:
    return _double(_deep(x, w)) + 1


_unstable.__name__ = "unstable_step"  # JAX names the program jit_unstable_step


@jax.jit
def small_step(x: jax.Array) -> jax.Array:
    return x * 3 + 1


def _sharding() -> NamedSharding:
    return NamedSharding(jax.make_mesh((jax.device_count(),), ("x",)), P("x"))


def unstable_step() -> Any:
    """jit_unstable_step: jitted over the devices (the sharding needs them, so it is made when asked)."""
    sharding = _sharding()
    return jax.jit(_unstable, in_shardings=(sharding, None), out_shardings=sharding)


def targets() -> Iterator[Any]:
    """What the warmer compiles: every program above but eval_step."""
    spec = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    yield train_step, (spec, spec)
    yield callback_step, (spec,)
    yield unstable_step().lower(jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=_sharding()), spec)
    yield small_step, (spec,)


def main() -> None:
    x, w = jnp.ones(SHAPE), jnp.full(SHAPE, 0.01)
    train_step(x, w).block_until_ready()
    eval_step(x, w).block_until_ready()
    callback_step(x).block_until_ready()
    unstable_step()(jax.device_put(x, _sharding()), w).block_until_ready()
    small_step(x).block_until_ready()
    print(json.dumps({"devices": jax.device_count(), "cache_dir": jax.config.jax_compilation_cache_dir,
                      "requests": events["/jax/compilation_cache/compile_requests_use_cache"],
                      "hits": events["/jax/compilation_cache/cache_hits"]}))


if __name__ == "__main__":
    main()
