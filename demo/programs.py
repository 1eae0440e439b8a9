"""Ten small programs of one training run, for the local-copy benchmark (bench/local_copy.py).

An MLP classifier as a team would write it: parameters made by a jitted init with static
sizes, a training step that donates its parameters, a bf16 variant, evaluation, and a
predict with a static top-k, each its own compiled program (ten in all). Data is made with
numpy, so nothing else is compiled.

`python -m programs` runs each program once (the run's "first step": every program it
needs compiled or loaded) and prints one JSON line: when it finished (`done`, time.time()),
how many compiles hit the persistent cache, how many compiled. `programs:targets` is the
warmup target: the same ten programs lowered with abstract arguments.
"""

from __future__ import annotations

import time

STARTED = time.time()  # when python reached this module, before jax is imported

import json  # noqa: E402
from collections import Counter
from collections.abc import Iterator
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SIZES = (784, 512, 256, 10)
BATCH = 128


@partial(jax.jit, static_argnums=1)
def init(key: jax.Array, sizes: tuple[int, ...]) -> list[tuple[jax.Array, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [(jax.random.normal(k, (m, n)) / jnp.sqrt(m), jnp.zeros(n)) for k, m, n in zip(keys, sizes[:-1], sizes[1:])]


def _forward(params: Any, x: jax.Array) -> jax.Array:
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


forward = jax.jit(_forward)


def _loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(_forward(params, x)), y[:, None], axis=1))


loss = jax.jit(_loss)


@partial(jax.jit, donate_argnums=0)
def train_step(params: Any, x: jax.Array, y: jax.Array) -> tuple[Any, jax.Array]:
    value, grads = jax.value_and_grad(_loss)(params, x, y)
    return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads), value


@jax.jit
def to_bf16(params: Any) -> Any:
    return jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), params)


@jax.jit
def forward_bf16(params: Any, x: jax.Array) -> jax.Array:
    return _forward(params, x.astype(jnp.bfloat16)).astype(jnp.float32)


@jax.jit
def accuracy(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.argmax(_forward(params, x), axis=1) == y)


@jax.jit
def normalize(x: jax.Array) -> jax.Array:
    return (x - jnp.mean(x, axis=0)) / (jnp.std(x, axis=0) + 1e-6)


@partial(jax.jit, static_argnums=2)
def top_k(params: Any, x: jax.Array, k: int) -> jax.Array:
    return jax.lax.top_k(_forward(params, x), k)[1]


def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    key = np.array([0, 42], dtype=np.uint32)
    return key, rng.standard_normal((BATCH, SIZES[0]), dtype=np.float32), rng.integers(0, SIZES[-1], BATCH, dtype=np.int32)


def run() -> dict[str, Any]:
    """Each program once, in the order a run needs them."""
    key, x, y = data()
    params = init(key, SIZES)
    x = normalize(x)
    forward(params, x)
    loss(params, x, y)
    accuracy(params, x, y)
    top_k(params, x, 1)
    top_k(params, x, 3)
    half = to_bf16(params)
    forward_bf16(half, x)
    params, value = train_step(params, x, y)
    return {"loss": float(value)}


def targets() -> Iterator[Any]:
    """Warmup target: the ten programs lowered with abstract arguments of run()'s shapes."""
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    x = jax.ShapeDtypeStruct((BATCH, SIZES[0]), jnp.float32)
    y = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
    params = jax.eval_shape(init, key, SIZES)
    half = jax.eval_shape(to_bf16, params)
    yield init.lower(key, SIZES)
    yield normalize.lower(x)
    yield forward.lower(params, x)
    yield loss.lower(params, x, y)
    yield accuracy.lower(params, x, y)
    yield top_k.lower(params, x, 1)
    yield top_k.lower(params, x, 3)
    yield to_bf16.lower(params)
    yield forward_bf16.lower(half, x)
    yield train_step.lower(params, x, y)


def main() -> None:
    events: Counter[str] = Counter()
    jax.monitoring.register_event_listener(lambda event, **_: events.update([event]))
    result = run()
    done = time.time()
    requests = events["/jax/compilation_cache/compile_requests_use_cache"]
    hits = events["/jax/compilation_cache/cache_hits"]
    print(json.dumps({"started": STARTED, "done": done, "programs": requests, "cache_hits": hits, "compiled": requests - hits,
                      "cache_dir": jax.config.jax_compilation_cache_dir, **result}), flush=True)


if __name__ == "__main__":
    main()
