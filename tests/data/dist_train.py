"""A multi-host training program for tests: every host runs this file, and the hosts form one
JAX distributed runtime (on the CPU here, as the testbed's TPU hosts are), each then running
a few training steps. `dist_train:targets` is its warmup target: the same jitted step,
lowered with abstract arguments of the same shapes, which the warmer compiles inside a
runtime of the same size.

Run on each host: python dist_train.py (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID set by the pod spec, as a multi-host training Job sets them).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

WIDTH = 256


@jax.jit
def train_step(w: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    def loss(w: jax.Array) -> jax.Array:
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    value, grad = jax.value_and_grad(loss)(w)
    return w - 0.1 * grad, value


def targets() -> Iterator[Any]:
    """Warmup target: the step, lowered with abstract arguments."""
    spec = jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)
    yield train_step.lower(spec, spec)


def main() -> None:
    events: Counter[str] = Counter()
    jax.monitoring.register_event_listener(lambda event, **_: events.update([event]))
    jax.distributed.initialize(
        coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
        num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
        process_id=int(os.environ["JAX_PROCESS_ID"]),
    )
    rng = np.random.default_rng(0)
    w = jax.device_put(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32))
    x = jax.device_put(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32))
    for _ in range(2):
        w, value = train_step(w, x)
    value.block_until_ready()
    requests = events["/jax/compilation_cache/compile_requests_use_cache"]
    hits = events["/jax/compilation_cache/cache_hits"]
    # JAX counts a miss only when this process writes the entry it compiled
    # (compilation_cache.put_executable_and_time): the entries this process wrote.
    misses = events["/jax/compilation_cache/cache_misses"]
    print(json.dumps({"process_index": jax.process_index(), "process_count": jax.process_count(),
                      "requests": requests, "cache_hits": hits, "compiled": requests - hits,
                      "cache_misses": misses, "cache_dir": jax.config.jax_compilation_cache_dir}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
