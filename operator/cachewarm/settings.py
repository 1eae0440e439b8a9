"""The operator's one typed settings object; the only module that reads the environment.

Every field is read from an env var with the prefix CACHEWARM_ (e.g. CACHEWARM_LOG_FORMAT)
and validated at startup, so a bad value stops the operator with a message, not later.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    """Operator settings. Field descriptions are what `cachewarm run --help` shows."""

    model_config = SettingsConfigDict(env_prefix="CACHEWARM_", extra="ignore", frozen=True)

    namespaces: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Namespaces to watch, comma-separated or JSON list; empty watches the whole cluster.",
    )
    log_format: Literal["json", "console"] = Field(
        default="json", description="json for clusters (one object per line), console for terminals."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO", description="Minimum log level.")
    gcp_project: str = Field(
        default="",
        description="GCP project that owns buckets cachewarm creates; empty uses the credentials' default.",
    )
    resync_seconds: float = Field(
        default=300.0, gt=0, description="How often each cache is re-checked for drift on its bucket."
    )
    retry_delay_seconds: float = Field(
        default=15.0, gt=0, description="First delay before retrying a failed GCS call; doubles up to 10 minutes."
    )
    gcs_timeout_seconds: float = Field(default=30.0, gt=0, description="Timeout of one GCS request.")
    liveness_endpoint: str = Field(
        default="http://0.0.0.0:8080/healthz", description="Where kopf serves the liveness probe; empty turns it off."
    )

    @field_validator("namespaces", mode="before")
    @classmethod
    def _split_namespaces(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @classmethod
    def from_env(cls) -> Settings:
        """Settings from the environment. Raises pydantic.ValidationError on a bad value."""
        return cls()
