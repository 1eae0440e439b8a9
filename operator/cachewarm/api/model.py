"""Typed view of a CompilationCache. The CRD schema is the validation users see; these
models turn the body kopf hands us into typed values (with the CRD's defaults, so objects
stored before a default existed read the same)."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, Final, Literal

from croniter import CroniterBadDateError, croniter
from kubernetes.utils.quantity import parse_quantity
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, field_validator, model_validator


# A cron schedule as the CRD's pattern has it: an @alias or exactly five fields.
CRON_FORM = re.compile(r"^(@(hourly|daily|weekly|monthly|yearly)|(\S+\s+){4}\S+)$")
# croniter's random field `R` or `r` (alone or as R(a-b)): month and day names never stand alone as one letter.
RANDOM_FIELD = re.compile(r"(?:^|[\s,/-])R(?:$|[\s,/(-])", re.IGNORECASE)
CRON_PROBE = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)  # croniter searches 50 years on from here


class InvalidSpec(ValueError):
    """The object does not match the schema this operator understands."""


class _Model(BaseModel):
    model_config = ConfigDict(populate_by_name=True, frozen=True, extra="ignore")


class Lifecycle(_Model):
    delete_after_days: int = Field(default=30, alias="deleteAfterDays", ge=1)
    # At the bucket root GCS cannot tell a JAX entry from any other object whose name
    # ends in -cache/-atime, so a root rule needs the bucket owner's explicit yes.
    allow_bucket_root: bool = Field(default=False, alias="allowBucketRoot")


class GcsStorage(_Model):
    bucket: str
    location: str
    prefix: str = ""
    create: bool = True
    storage_class: str = Field(default="STANDARD", alias="storageClass")
    soft_delete_days: int = Field(default=7, alias="softDeleteDays")
    lifecycle: Lifecycle = Field(default_factory=Lifecycle)
    deletion_policy: Literal["Retain", "Delete"] = Field(default="Retain", alias="deletionPolicy")

    @property
    def url(self) -> str:
        """gs://bucket or gs://bucket/prefix, normalized: the same bytes everywhere."""
        return f"gs://{self.bucket}/{self.prefix}" if self.prefix else f"gs://{self.bucket}"

    @property
    def object_prefix(self) -> str:
        """Object-name prefix of this cache's entries ("" for the bucket root)."""
        return f"{self.prefix}/" if self.prefix else ""


class Storage(_Model):
    gcs: GcsStorage


class JaxSettings(_Model):
    min_compile_time_secs: float = Field(default=1.0, alias="minCompileTimeSecs", ge=0)
    min_entry_size_bytes: int = Field(default=0, alias="minEntrySizeBytes", ge=0)
    enable_xla_caches: str = Field(default="none", alias="enableXlaCaches")


# spec.torch (issue 31). The CRD's rules, to the letter, for objects stored without them.
TORCH_CACHE_DIR: Final = "/cachewarm-torch"
TORCH_MAX_ARCHIVE_SIZE: Final = "4Gi"
TORCH_MAX_ARCHIVE_LIMIT: Final = "64Gi"  # the CRD's maximum of spec.torch.maxArchiveSize
TORCH_CACHE_DIR_FORM = re.compile(r"^(/[A-Za-z0-9._-]+)+$")
# cachewarm's own mount paths in warmers and pods (the default cacheDir is the one of
# them a torch cache's directory may be): no cacheDir may be one of them or below one.
CACHEWARM_PATH = re.compile(r"^(/cachewarm[^/]*|/opt/cachewarm|/var/run/secrets/cachewarm)(/|$)")
# The system directories no cacheDir may be or lie below, and those it may lie below but not
# be: the writable emptyDir mounted there would hide what the image keeps there, in every
# labelled container. /tmp and below is fine (an emptyDir at /tmp is common practice).
SYSTEM_PATH = re.compile(r"^/(bin|boot|dev|etc|lib|lib32|lib64|libx32|proc|run|sbin|sys|usr|var/run)(/|$)")
SYSTEM_PARENT = re.compile(r"^/(root|home|opt|var|var/lib|srv|mnt)$")
# A Kubernetes quantity, as the apiserver's isQuantity() reads one (the Kubernetes client's
# parser alone also takes surrounding blanks).
QUANTITY_FORM = re.compile(r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+))?$")


def quantity_bytes(value: int | str) -> int:
    """The bytes of a Kubernetes quantity (an int, or a string such as "4Gi" or "500M"),
    rounded down. Raises ValueError for anything that is not one."""
    if isinstance(value, bool) or not (isinstance(value, int) or QUANTITY_FORM.match(str(value))):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 4Gi, 500Mi or a number of bytes)")
    parsed: Decimal = parse_quantity(value)  # type: ignore[no-untyped-call]
    return int(parsed)


class TorchSettings(_Model):
    """spec.torch: present, the cache serves torch.compile's (Inductor's) caches; spec.jax
    does not apply then."""

    # TORCHINDUCTOR_CACHE_DIR of warmers and pods alike (a writable emptyDir there in both).
    cache_dir: str = Field(default=TORCH_CACHE_DIR, alias="cacheDir", max_length=200)
    # The most bytes the warmer uploads as one archive and a copier extracts from one.
    # An int-or-string, as in the CRD (strict: no float or bool read as a number).
    max_archive_size: StrictInt | StrictStr = Field(default=TORCH_MAX_ARCHIVE_SIZE, alias="maxArchiveSize")

    @field_validator("cache_dir")
    @classmethod
    def _cache_dir(cls, value: str) -> str:
        if not TORCH_CACHE_DIR_FORM.match(value):
            raise ValueError(f"{value!r} is not an absolute directory of segments of letters, digits, '.', '_' and '-' "
                             f"below '/', without a trailing '/' (e.g. {TORCH_CACHE_DIR})")
        if any(part in (".", "..") for part in value.split("/")):
            raise ValueError(f"{value!r} has a '.' or '..' segment")
        if CACHEWARM_PATH.match(value) and not (value == TORCH_CACHE_DIR or value.startswith(TORCH_CACHE_DIR + "/")):
            raise ValueError(f"{value!r} is one of cachewarm's own mount paths (/cachewarm*, /opt/cachewarm, "
                             f"/var/run/secrets/cachewarm) or below one; only {TORCH_CACHE_DIR} may be used")
        if SYSTEM_PATH.match(value) or SYSTEM_PARENT.match(value):
            raise ValueError(f"{value!r} is a system directory (/bin, /boot, /dev, /etc, /lib*, /proc, /run, /sbin, "
                             "/sys, /usr, /var/run or below one; /root, /home, /opt, /var, /var/lib, /srv or /mnt "
                             "itself): the writable emptyDir mounted there would hide what the image keeps there")
        return value

    @field_validator("max_archive_size")
    @classmethod
    def _max_archive_size(cls, value: int | str) -> int | str:
        size = quantity_bytes(value)
        if not 1 <= size <= quantity_bytes(TORCH_MAX_ARCHIVE_LIMIT):
            raise ValueError(f"{value!r} is not between 1 byte and {TORCH_MAX_ARCHIVE_LIMIT}")
        return value

    @property
    def max_archive_bytes(self) -> int:
        """max_archive_size in bytes (CACHEWARM_TORCH_MAX_ARCHIVE_BYTES)."""
        return quantity_bytes(self.max_archive_size)


class WaitForWarm(_Model):
    enabled: bool = False
    timeout_seconds: int = Field(default=1800, alias="timeoutSeconds", ge=1)


class LocalCopy(_Model):
    """spec.injection.localCopy: pods read the cache from a local copy an init container
    makes (builders/localcopy.py). The CRD refuses it with ReadWrite and with XLA caches."""

    # HostPath is withdrawn (the CRD refuses it in new or changed specs); objects stored
    # with it still parse, and their pods get an EmptyDir copy (builders/localcopy.py).
    volume: Literal["EmptyDir", "HostPath", "Ephemeral"] = "EmptyDir"
    size_limit: str = Field(default="10Gi", alias="sizeLimit")
    host_path: str | None = Field(default=None, alias="hostPath")
    storage_class_name: str | None = Field(default=None, alias="storageClassName")
    workers: int = Field(default=16, ge=1, le=64)
    timeout_seconds: int = Field(default=300, alias="timeoutSeconds", ge=1, le=3600)


ReadFrom = Literal["LocalCopy", "Bucket"]


class Injection(_Model):
    # The CRD's default; objects stored while it was ReadWrite carry that value explicitly.
    mode: Literal["ReadWrite", "ReadOnly"] = "ReadOnly"
    wait_for_warm: WaitForWarm = Field(default_factory=WaitForWarm, alias="waitForWarm")
    report: bool = True
    # The copy pods read, as the operator decided it (CacheSpec.read_path): the spec's
    # localCopy, or the default one, or None where pods read the bucket.
    local_copy: LocalCopy | None = Field(default=None, alias="localCopy")
    # What the user wrote in spec.injection.readFrom (None: not set, the operator decides).
    read_from: ReadFrom | None = Field(default=None, alias="readFrom")
    # Set by CacheSpec's parsing only (the CRD has no such field, so the apiserver prunes it
    # from what users write): local_copy is the default copy, not the spec's.
    local_copy_by_default: bool = Field(default=False, alias="localCopyByDefault")


class Accelerator(_Model):
    type: str
    count: int = Field(ge=1)


class Tpu(_Model):
    type: str
    topology: str


class EnvVar(_Model):
    name: str
    value: str


class Pool(_Model):
    name: str
    accelerator: Accelerator | None = None
    tpu: Tpu | None = None
    # Unset: derived (TPU pools from the shape table, others 1). Objects stored while the
    # CRD defaulted hosts to 1 read as an explicit 1; builders/job.pool_shape reads that 1
    # as unset on a TPU slice the table knows to have more hosts.
    hosts: int | None = Field(default=None, ge=1)
    chips_per_host: int | None = Field(default=None, alias="chipsPerHost", ge=1)
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    # Quantities as the user wrote them (int or string); the Job builder sends strings.
    resources: dict[str, dict[str, int | str]] = Field(default_factory=dict)


class Warmup(_Model):
    image: str
    pools: list[Pool]
    command: list[str] | None = None
    targets: list[str] | None = None
    env: list[EnvVar] = Field(default_factory=list)
    # The CRD's rule, to the letter: an interpreter's name or absolute path, nothing else.
    python: str = Field(default="python", pattern=r"^(/[A-Za-z0-9._+-]+)*/?python[0-9.]*$")
    working_dir: str | None = Field(default=None, alias="workingDir")
    # The warmers' write threshold (the CRD has no default: 0, every program compiled).
    min_compile_time_secs: float = Field(default=0.0, alias="minCompileTimeSecs", ge=0)
    parallelism: int = Field(default=1, ge=1)
    backoff_limit: int = Field(default=1, alias="backoffLimit", ge=0)
    active_deadline_seconds: int = Field(default=3600, alias="activeDeadlineSeconds", ge=1)
    ttl_seconds_after_finished: int = Field(default=86400, alias="ttlSecondsAfterFinished", ge=0)
    schedule: str | None = None
    # The writer identity: warmer pods run as this ServiceAccount (e.g. bound through
    # Workload Identity to a Google service account that may write the cache); None: the
    # namespace's default, as training pods.
    service_account_name: str | None = Field(default=None, alias="serviceAccountName")

    @field_validator("schedule")
    @classmethod
    def _cron(cls, value: str | None) -> str | None:
        """Five fields or an @alias (the CRD's pattern; croniter alone takes a sixth,
        seconds, field), no random or hashed field (croniter's `R` draws a new value at
        each parse, so every reconcile would see another slot and replace the warmer), and
        a slot that exists (`0 0 30 2 *` never comes: croniter raises at each reconcile)."""
        if value is None:
            return value
        if not (CRON_FORM.match(value) and croniter.is_valid(value)):
            raise ValueError(f"{value!r} is not a valid cron schedule (5 fields, e.g. '0 3 * * *')")
        if RANDOM_FIELD.search(value):
            raise ValueError(f"{value!r} has a random field (R): a schedule's slots must be the same at every reading")
        try:
            croniter(value, CRON_PROBE).get_next(dt.datetime)
        except CroniterBadDateError:
            raise ValueError(f"{value!r} never fires (no such date)") from None
        return value


class CacheSpec(_Model):
    storage: Storage
    jax: JaxSettings = Field(default_factory=JaxSettings)
    injection: Injection = Field(default_factory=Injection)
    warmup: Warmup | None = None
    # Present: a torch.compile (Inductor) cache; absent: JAX's (spec.jax applies).
    torch: TorchSettings | None = None

    @property
    def framework(self) -> Literal["jax", "torch"]:
        """Whose compilation cache this is: spec.torch present makes it torch's."""
        return "torch" if self.torch is not None else "jax"

    @model_validator(mode="before")
    @classmethod
    def _default_read_path(cls, data: Any) -> Any:
        """The read path decided here, once, for every reader of the spec (webhook, status,
        Jobs): readFrom LocalCopy is a localCopy of LocalCopy's defaults; a ReadOnly cache
        with warmers (their manifests name what a copy takes; without them a copy would take
        the whole prefix, whoever wrote it) and XLA's caches off whose spec sets neither
        injection.localCopy nor injection.readFrom gets the default local copy (an EmptyDir
        of LocalCopy's defaults, `local_copy_by_default`). Not a CRD default: that would be
        written into stored objects as they are read, switching them silently and for good;
        here it is a decision the LocalCopyAsSpecified condition states (read_path)."""
        if not isinstance(data, Mapping):
            return data
        injection = data.get("injection")
        injection = dict(injection) if isinstance(injection, Mapping) else {}
        given = data.get("jax")
        jax: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
        injection.pop("localCopyByDefault", None)
        injection.pop("local_copy_by_default", None)
        if injection.get("localCopy") is None and injection.get("readFrom") == "LocalCopy":
            injection["localCopy"] = {}  # asked for by name, with LocalCopy's defaults
        elif injection.get("localCopy") is None and injection.get("readFrom") is None and data.get("warmup") \
                and injection.get("mode", "ReadOnly") == "ReadOnly" \
                and (jax.get("enableXlaCaches", "none") == "none" or data.get("torch") is not None):
            # A torch cache always: Inductor reads a local directory only (spec.jax does not apply).
            injection["localCopy"] = {}
            injection["localCopyByDefault"] = True
        return {**data, "injection": injection}

    @model_validator(mode="after")
    def _torch_rules(self) -> CacheSpec:
        """The CRD's rules of spec.torch, for objects stored without them (each message the CRD's)."""
        if self.torch is None:
            return self
        problems = []
        if self.warmup is None:
            problems.append("spec.torch needs spec.warmup: only warmers fill a torch cache (pods never write it)")
        if self.injection.mode != "ReadOnly":
            problems.append("spec.torch refuses spec.injection.mode ReadWrite: a torch cache is code (its artifacts "
                            "are pickles and shared objects that run when loaded), so pods only read (ReadOnly)")
        if self.injection.read_from == "Bucket":
            problems.append("spec.torch refuses spec.injection.readFrom Bucket: torch reads a local directory only, "
                            "so its pods always get a local copy")
        tpu = [pool.name for pool in (self.warmup.pools if self.warmup is not None else []) if pool.tpu is not None]
        if tpu:
            problems.append(f"spec.torch refuses TPU pools ({', '.join(tpu)} in spec.warmup.pools): torch on TPU is "
                            "torch_xla, which cachewarm does not support")
        env = [var.name for var in (self.warmup.env if self.warmup is not None else [])
               if var.name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")]
        if env:
            problems.append(f"spec.warmup.env of a torch cache must not set {' or '.join(env)}: cachewarm sets them "
                            "from spec.torch.cacheDir")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def read_path(self) -> tuple[ReadFrom, str]:
        """(where pods read the cache, why), in words for the LocalCopyAsSpecified condition."""
        injection = self.injection
        if injection.local_copy is not None:
            if injection.local_copy_by_default and self.torch is not None:
                return "LocalCopy", ("the default of a torch cache: Inductor reads a local directory only, so its "
                                     "pods always get a local copy (spec.injection.localCopy configures it)")
            if injection.local_copy_by_default:
                return "LocalCopy", ("the default: spec.injection sets neither localCopy nor readFrom; set "
                                     "spec.injection.readFrom to Bucket for pods to read gs:// directly")
            return "LocalCopy", "spec.injection.localCopy"
        if injection.read_from == "Bucket":
            return "Bucket", "spec.injection.readFrom is Bucket"
        if self.warmup is None:
            return "Bucket", ("the cache has no spec.warmup: no warmer's manifest names the entries a default copy "
                              "would take (set injection.localCopy to copy the whole prefix)")
        if injection.mode != "ReadOnly":
            return "Bucket", ("spec.injection.mode is ReadWrite: a pod's new entries must reach the bucket, so it "
                              "gets no local copy")
        return "Bucket", (f"spec.jax.enableXlaCaches is {self.jax.enable_xla_caches!r}: with XLA's caches on, the "
                          "cache directory is part of every key, so a local copy would never hit")


def parse_spec(spec: Mapping[str, Any]) -> CacheSpec:
    """The typed spec. Raises InvalidSpec naming the bad fields."""
    try:
        return CacheSpec.model_validate(dict(spec))
    except ValidationError as exc:
        problems = "; ".join(
            f"spec.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" if err["loc"] else f"spec: {err['msg']}"
            for err in exc.errors()
        )
        raise InvalidSpec(problems) from exc
