"""An ordinary JAX training script, as a user would write it: jit a step, call it with
real arrays. It reads the persistent-cache settings from the env the pod was given and
prints one JSON line with JAX's own cache counters (jax.monitoring events).

Usage: python jax_train.py [--steps N] [--extra]   (--extra also compiles a second program)
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

t_start = time.monotonic()
import jax  # noqa: E402  (env is read at import, as in a real pod)
import jax.numpy as jnp  # noqa: E402

events: Counter[str] = Counter()
jax.monitoring.register_event_listener(lambda name, **_: events.update([name]))


def init(key: jax.Array, width: int = 256, depth: int = 3) -> list[tuple[jax.Array, jax.Array]]:
    keys = jax.random.split(key, depth)
    return [(jax.random.normal(k, (width, width)) / width**0.5, jnp.zeros(width)) for k in keys]


def loss(params: list[tuple[jax.Array, jax.Array]], x: jax.Array, y: jax.Array) -> jax.Array:
    for w, b in params:
        x = jnp.tanh(x @ w + b)
    return jnp.mean((x - y) ** 2)


@jax.jit
def train_step(params, x, y):  # type: ignore[no-untyped-def]
    grads = jax.grad(loss)(params, x, y)
    return [(w - 0.01 * gw, b - 0.01 * gb) for (w, b), (gw, gb) in zip(params, grads)]


@jax.jit
def evaluate(params, x, y):  # type: ignore[no-untyped-def]
    return loss(params, x, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--extra", action="store_true", help="also compile and run evaluate()")
    args = parser.parse_args()
    key = jax.random.PRNGKey(0)
    params = init(key)
    x = jax.random.normal(key, (64, 256))
    y = jnp.zeros((64, 256))
    t0 = time.monotonic()
    params = train_step(params, x, y)
    jax.block_until_ready(params)
    first_step = time.monotonic() - t0
    for _ in range(args.steps - 1):
        params = train_step(params, x, y)
    if args.extra:
        jax.block_until_ready(evaluate(params, x, y))
    print(json.dumps({
        "cache_dir": jax.config.jax_compilation_cache_dir,
        "hits": events["/jax/compilation_cache/cache_hits"],
        "misses": events["/jax/compilation_cache/cache_misses"],
        "requests": events["/jax/compilation_cache/compile_requests_use_cache"],
        # Programs compiled here rather than loaded: JAX does not always emit a miss event.
        "compiled": events["/jax/compilation_cache/compile_requests_use_cache"]
        - events["/jax/compilation_cache/cache_hits"],
        "first_step_seconds": round(first_step, 3),
        "total_seconds": round(time.monotonic() - t_start, 3),
    }))


if __name__ == "__main__":
    main()
