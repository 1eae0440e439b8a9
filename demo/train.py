"""The demo's training program: a deep residual language model and its SGD step.

It stands for a team's training image. `python train.py --steps N` is the ordinary
training run (real arrays, plain jitted calls); `train:targets` is the warmup target that
lowers the very same jitted step with abstract arguments of the same shapes and dtypes,
so the warmed cache key is the key the training run asks for.

The step is built so that its compile dominates its first step, as an accelerator step's
compile does (minutes for a large model): the layers are a `lax.scan` unrolled into
straight-line code (as many large-model steps are, to let XLA fuse and schedule across
layers), so XLA compiles LAYERS residual blocks, forward and backward, while the arrays
stay small and one step runs in milliseconds. `make demo` runs it at DEMO_LAYERS=96: on the
real node of this project's 2-core machine the cold pod's step took 8.9 s (its compile), the
warm pod's 1.5 s (loading the entry and the first run), 9.9 s and 2.5 s from the pods'
create requests (64 layers gave 0.338 warm over cold, over the demo's 0.3 goal; compile
time grows faster than the layer count: 384 layers took 86 s). The default, 4 layers,
compiles in well under a second: the test suite's size.
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

VOCAB, SEQ, BATCH = 256, 16, 8
# Model size; the benchmarks (bench/warm_start.py, bench/local_copy.py) set these.
WIDTH = int(os.environ.get("DEMO_WIDTH", "32"))
LAYERS = int(os.environ.get("DEMO_LAYERS", "4"))

Params = dict[str, Any]


def init_params(seed: int = 0) -> Params:
    """Parameters made with numpy and moved to the device: no compile happens here."""
    rng = np.random.default_rng(seed)

    def dense(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32)

    layers = {"up": dense(LAYERS, WIDTH, 2 * WIDTH), "down": dense(LAYERS, 2 * WIDTH, WIDTH) * 0.1,
              "scale": np.ones((LAYERS, WIDTH), np.float32)}
    params = {"embed": dense(VOCAB, WIDTH), "layers": layers, "head": dense(WIDTH, VOCAB)}
    return jax.device_put(params)


def batch(seed: int = 0) -> tuple[jax.Array, jax.Array]:
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (BATCH, SEQ + 1), dtype=np.int32)
    return jax.device_put(tokens[:, :-1]), jax.device_put(tokens[:, 1:])


def _block(x: jax.Array, p: Params) -> tuple[jax.Array, None]:
    h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * p["scale"]
    return x + jax.nn.gelu(h @ p["up"]) @ p["down"], None


def loss_fn(params: Params, inputs: jax.Array, labels: jax.Array) -> jax.Array:
    x = params["embed"][inputs]
    x, _ = jax.lax.scan(_block, x, params["layers"], unroll=True)
    logp = jax.nn.log_softmax(x @ params["head"], axis=-1)
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
