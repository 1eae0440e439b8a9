"""Warmup targets for tests: the image "test/targets:1" on the node agent is this folder."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp


@jax.jit
def step(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.tanh(x @ w).sum()


def broken_targets() -> Iterator[Any]:
    """Fails to lower: the shapes do not fit."""
    yield step.lower(jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((3, 5), jnp.float32))


def no_targets() -> list[Any]:
    """Yields nothing to compile."""
    return []


def slow_targets() -> Iterator[Any]:
    """A real target that takes a few seconds to start, so pods can be seen waiting."""
    time.sleep(6)
    yield step, (jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((8, 8), jnp.float32))


def stuck_targets() -> Iterator[Any]:
    """Never finishes in a test's lifetime (the Job's deadline or the test ends it)."""
    time.sleep(600)
    yield from ()


def quick_targets() -> Iterator[Any]:
    """The same program as slow_targets, without the wait."""
    yield step, (jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((8, 8), jnp.float32))


def held_targets() -> Iterator[Any]:
    """The same program as quick_targets, compiled once the file $WARM_RELEASE_FILE exists:
    a test holds the warm while it looks at what holding means and then lets it go (on the
    node agent every pod shares the host's files). Raises TimeoutError after 300 s."""
    release = Path(os.environ["WARM_RELEASE_FILE"])
    deadline = time.monotonic() + 300
    while not release.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{release} did not appear")
        time.sleep(0.05)
    yield step, (jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((8, 8), jnp.float32))
