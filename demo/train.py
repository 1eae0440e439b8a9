"""The demo's training program: a small decoder-only transformer LM and its SGD step.

It stands for a team's training image. `python train.py --steps N` is the ordinary
training run (real arrays, plain jitted calls); `train:targets` is the warmup target that
lowers the very same jitted step with abstract arguments of the same shapes and dtypes,
so the warmed cache key is the key the training run asks for.
"""

from __future__ import annotations

import time

STARTED = time.time()  # when python reached this module, before jax is imported

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from collections import Counter
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

VOCAB, SEQ, BATCH, HEADS = 512, 128, 8, 4
# Model size; the benchmark (bench/warm_start.py) sets these to measure bigger steps.
WIDTH = int(os.environ.get("DEMO_WIDTH", "256"))
LAYERS = int(os.environ.get("DEMO_LAYERS", "4"))

Params = dict[str, Any]


def init_params(seed: int = 0) -> Params:
    """Parameters made with numpy and moved to the device: no compile happens here."""
    rng = np.random.default_rng(seed)

    def dense(fan_in: int, fan_out: int) -> np.ndarray:
        return (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32)

    layers = [
        {"qkv": dense(WIDTH, 3 * WIDTH), "out": dense(WIDTH, WIDTH),
         "up": dense(WIDTH, 4 * WIDTH), "down": dense(4 * WIDTH, WIDTH),
         "ln1": np.ones(WIDTH, np.float32), "ln2": np.ones(WIDTH, np.float32)}
        for _ in range(LAYERS)
    ]
    params = {"embed": dense(VOCAB, WIDTH), "layers": layers, "head": dense(WIDTH, VOCAB)}
    return jax.device_put(params)


def batch(seed: int = 0) -> tuple[jax.Array, jax.Array]:
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (BATCH, SEQ + 1), dtype=np.int32)
    return jax.device_put(tokens[:, :-1]), jax.device_put(tokens[:, 1:])


def _norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _block(x: jax.Array, p: Params) -> jax.Array:
    b, s, _ = x.shape
    q, k, v = jnp.split(_norm(x, p["ln1"]) @ p["qkv"], 3, axis=-1)
    heads = lambda t: t.reshape(b, s, HEADS, WIDTH // HEADS).transpose(0, 2, 1, 3)  # noqa: E731
    att = heads(q) @ heads(k).transpose(0, 1, 3, 2) / np.sqrt(WIDTH // HEADS)
    att = jnp.where(np.tril(np.ones((s, s), bool)), att, -1e9)
    y = (jax.nn.softmax(att, axis=-1) @ heads(v)).transpose(0, 2, 1, 3).reshape(b, s, WIDTH)
    x = x + y @ p["out"]
    return x + jax.nn.gelu(_norm(x, p["ln2"]) @ p["up"]) @ p["down"]


def loss_fn(params: Params, inputs: jax.Array, labels: jax.Array) -> jax.Array:
    x = params["embed"][inputs]
    for layer in params["layers"]:
        x = _block(x, layer)
    logits = x @ params["head"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


@jax.jit
def train_step(params: Params, inputs: jax.Array, labels: jax.Array) -> tuple[Params, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(params, inputs, labels)
    return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads), loss


def targets() -> Iterator[Any]:
    """Warmup target: the training step lowered with abstract arguments."""
    params = jax.eval_shape(init_params)
    inputs = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    yield train_step.lower(params, inputs, inputs)


def main() -> None:
    parser = argparse.ArgumentParser(description="Train the demo model for a few steps.")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    events: Counter[str] = Counter()
    jax.monitoring.register_event_listener(lambda event, **_: events.update([event]))
    params = init_params()
    inputs, labels = batch()
    t0 = time.monotonic()
    params, loss = train_step(params, inputs, labels)
    loss.block_until_ready()
    first = time.monotonic() - t0
    done = time.time()  # when the first step was done, by the node's clock (bench/local_copy.py)
    for _ in range(args.steps - 1):
        params, loss = train_step(params, inputs, labels)
    requests = events["/jax/compilation_cache/compile_requests_use_cache"]
    hits = events["/jax/compilation_cache/cache_hits"]
    print(json.dumps({"first_step_seconds": round(first, 3), "started": STARTED, "done": done, "loss": round(float(loss), 4),
                      "cache_hits": hits, "compiled": requests - hits,
                      "cache_dir": jax.config.jax_compilation_cache_dir}), flush=True)


if __name__ == "__main__":
    main()
