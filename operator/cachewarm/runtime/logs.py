"""Logging: structlog key-value events, JSON in a cluster and readable in a terminal.

kopf and the Kubernetes/GCS libraries log through the standard library; their records go
through the same structlog renderer, so every line of the operator has one format.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog


def configure(fmt: str = "json", level: str = "INFO") -> None:
    """Route structlog and stdlib logging to stderr as JSON lines or console text."""
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder(allow=("k8s_ref", "cache")), _object_ref],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Chatty libraries stay at WARNING unless we debug.
    # kopf says "Handler ... succeeded" for every timer tick; our own lines say what changed.
    for noisy in ("urllib3", "google", "aiohttp.access", "kubernetes", "kopf.objects"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if level == "DEBUG" else logging.WARNING)


def _object_ref(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """kopf's k8s_ref extra as one short field: object=Kind/namespace/name."""
    ref = event.pop("k8s_ref", None)
    if isinstance(ref, dict):
        event["object"] = "/".join(str(p) for p in (ref.get("kind"), ref.get("namespace"), ref.get("name")) if p)
    return event


def get(name: str) -> structlog.stdlib.BoundLogger:
    logger: structlog.stdlib.BoundLogger = structlog.stdlib.get_logger(name)
    return logger
