"""Every cluster-visible string of cachewarm: API group, labels, annotations, finalizer,
condition types and reasons, env var names. Change them here or nowhere; the env names of
cachewarm's programs in pods are changed in the agent that reads them (below)."""

from __future__ import annotations

from typing import Final

# The env names cachewarm's programs in pods read are owned by those programs (the agents
# run without this package, so they cannot import it): each is spelled once, in the agent,
# and re-exported here for the builders that set it. JAX's own names are further down.
from cachewarm.agents.copier import ENV_COPY_BUCKET as ENV_COPY_BUCKET
from cachewarm.agents.copier import ENV_COPY_DEADLINE_SECONDS as ENV_COPY_DEADLINE_SECONDS
from cachewarm.agents.copier import ENV_COPY_DEST as ENV_COPY_DEST
from cachewarm.agents.copier import ENV_COPY_IN_PROCESS as ENV_COPY_IN_PROCESS
from cachewarm.agents.copier import ENV_COPY_MANIFESTS as ENV_COPY_MANIFESTS
from cachewarm.agents.copier import ENV_COPY_MAX_BYTES as ENV_COPY_MAX_BYTES
from cachewarm.agents.copier import ENV_COPY_PREFIX as ENV_COPY_PREFIX
from cachewarm.agents.copier import ENV_COPY_SUMMARY as ENV_COPY_SUMMARY
from cachewarm.agents.copier import ENV_COPY_WORKERS as ENV_COPY_WORKERS
from cachewarm.agents.reporter import ENV_CACHE as ENV_CACHE
from cachewarm.agents.reporter import ENV_LOCAL_COPY as ENV_LOCAL_COPY
from cachewarm.agents.reporter import ENV_POD_NAME as ENV_POD_NAME
from cachewarm.agents.reporter import ENV_POD_NAMESPACE as ENV_POD_NAMESPACE
from cachewarm.agents.reporter import ENV_POD_UID as ENV_POD_UID
from cachewarm.agents.reporter import ENV_REPORT_CA as ENV_REPORT_CA
from cachewarm.agents.reporter import ENV_REPORT_TOKEN_FILE as ENV_REPORT_TOKEN_FILE
from cachewarm.agents.reporter import ENV_REPORT_URL as ENV_REPORT_URL
from cachewarm.agents.reporter import ENV_RESTORE_IMAGE_PYTHONPATH as ENV_RESTORE_IMAGE_PYTHONPATH
# Warmers: the gs:// URL of the pool's manifest (builders/placement.manifest_url), where
# process 0 writes the entries its warm relied on.
from cachewarm.agents.warmer import ENV_MANIFEST as ENV_MANIFEST
# torch caches (spec.torch): the directory the copier extracts a torch cache's archives
# into (the pods' TORCHINDUCTOR_CACHE_DIR), and the most bytes of one archive (the copier's
# extraction bound, the warmer's upload bound).
from cachewarm.agents.copier import ENV_TORCH_DIR as ENV_TORCH_DIR
from cachewarm.agents.copier import ENV_TORCH_MAX_ARCHIVE_BYTES as ENV_TORCH_MAX_ARCHIVE_BYTES
# "torch" in a torch cache's warmers and pods; the gs:// URL the torch warmer uploads to.
from cachewarm.agents.warmer import ENV_CACHE_URL as ENV_CACHE_URL
from cachewarm.agents.warmer import ENV_FRAMEWORK as ENV_FRAMEWORK

GROUP: Final = "cachewarm.dev"
VERSION: Final = "v1alpha1"
PLURAL: Final = "compilationcaches"
KIND: Final = "CompilationCache"

# Pods opt in with this label; its value names a CompilationCache in the pod's namespace.
CACHE_LABEL: Final = f"{GROUP}/cache"
MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
MANAGED_BY: Final = "cachewarm"
# Labels cachewarm puts on GCS buckets it created (GCS label keys: lowercase, no dots).
GCS_LABEL_MANAGED_BY: Final = "managed-by"
GCS_LABEL_CACHE: Final = "cachewarm-cache"
GCS_LABEL_NAMESPACE: Final = "cachewarm-namespace"
# One label per lifecycle rule cachewarm wrote on a bucket: this prefix plus a hash of the
# rule's canonical JSON. GCS rules carry no labels of their own; a rule is cachewarm's only
# when its exact bytes are recorded here, never because of its shape.
GCS_LABEL_RULE_PREFIX: Final = "cachewarm-rule-"
# Which operator instance (setting CACHEWARM_INSTANCE) created a bucket or recorded a rule:
# the creation labels carry it under this key, a rule label carries it as its value. Each
# operator sees only its own cluster's caches, so another instance's rules are foreign.
GCS_LABEL_INSTANCE: Final = "cachewarm-instance"
# A bucket owner's consent (docs/bucket-and-data-safety.md#bucket-consent): a label
# `cachewarm-grant-<16 hex of sha256("<instance>/<namespace>/<prefix>")>` whose value is the
# namespace lets that operator instance act for caches of that namespace at that prefix and
# under it. Only whoever may change the bucket's labels can give it.
GCS_LABEL_GRANT_PREFIX: Final = "cachewarm-grant-"
DEFAULT_INSTANCE: Final = "default"
# The value of rule labels written before instances existed: the default instance's.
LEGACY_RULE_RECORD: Final = "1"

FINALIZER: Final = f"{GROUP}/data-cleanup"
# On pods the webhook injected: which cache, generation, mode and URL they got.
INJECTED_ANNOTATION: Final = f"{GROUP}/injected"
# Scheduling gate that holds opted-in pods until the cache is Warmed (waitForWarm).
WAIT_GATE: Final = f"{GROUP}/wait-for-warm"
# Set or change it on a CompilationCache to re-run its warmers.
REWARM_ANNOTATION: Final = f"{GROUP}/rewarm"
# Labels on warmer Jobs and their pods (never CACHE_LABEL: the webhook must not touch them).
LABEL_WARMER_FOR: Final = f"{GROUP}/warmer-for"
LABEL_POOL: Final = f"{GROUP}/pool"
LABEL_SPEC_HASH: Final = f"{GROUP}/spec-hash"
# On warmer Jobs: metadata.generation of the CompilationCache whose spec built the Job. A
# reconcile holding an older spec never deletes, nor adds beside, a Job of a newer one.
GENERATION_ANNOTATION: Final = f"{GROUP}/generation"
# On the ConfigMap of a cache's pod env (cachewarm-<cache>-env): which cache.
ENV_FOR_LABEL: Final = f"{GROUP}/env-for"
# Labels the Job controller puts on the pods of a Job (read, never written by us).
JOB_NAME_LABEL: Final = "job-name"


class Condition:
    """Condition types in status.conditions."""

    READY: Final = "Ready"
    BUCKET_READY: Final = "BucketReady"
    WARMED: Final = "Warmed"
    # Whether this cache's lifecycle rule (eviction by last use) is on the bucket.
    LIFECYCLE_READY: Final = "LifecycleReady"
    # Whether the bucket-wide soft delete policy is what this cache asks for.
    SOFT_DELETE_APPLIED: Final = "SoftDeleteApplied"
    # Whether the ConfigMap of the cache's pod env (for containers with envFrom) is current.
    INJECTION_READY: Final = "InjectionReady"
    # The kstatus conditions (Flux, kpt, cli-utils): Reconciling is True while the operator
    # works toward the spec (a warm under way, a retry pending), Stalled is True when only a
    # person can move the cache on. kstatus reads them as InProgress and Failed.
    RECONCILING: Final = "Reconciling"
    STALLED: Final = "Stalled"
    # Whether the training pods that reported compute their keys as the warmers did
    # (versions, devices, flags, cache dir); Unknown until both have reported.
    KEYS_MATCH: Final = "KeysMatch"
    # Whether the training pods that reported loaded every program they ran from the cache;
    # False with the cause of the costliest one they compiled (reconcile/misses.py).
    PROGRAMS_WARM: Final = "ProgramsWarm"
    # Whether training pods only read the cache (spec.injection.mode ReadOnly) or may write
    # entries every later reader runs (ReadWrite, False with how to switch).
    PODS_READ_ONLY: Final = "PodsReadOnly"
    # Whether pods get the local copy the spec names: False for a cache stored with the
    # withdrawn volume HostPath, whose pods get an EmptyDir copy instead.
    LOCAL_COPY_AS_SPECIFIED: Final = "LocalCopyAsSpecified"


class Reason:
    """Machine-readable reasons on conditions and events (CamelCase, Kubernetes style)."""

    RECONCILED: Final = "Reconciled"
    INVALID_SPEC: Final = "InvalidSpec"
    PREFIX_IN_USE: Final = "PrefixInUse"
    BUCKET_ROOT_NOT_ALLOWED: Final = "BucketRootNotAllowed"
    RULE_LIMIT_REACHED: Final = "RuleLimitReached"
    RULES_UNREADABLE: Final = "LifecycleRulesUnreadable"
    SET_BY_OWNER: Final = "SetByOwner"
    SOFT_DELETE_CONFLICT: Final = "SoftDeleteConflict"
    # The bucket also carries lifecycle rules another cachewarm operator instance recorded.
    SHARED_WITH_OTHER_OPERATOR: Final = "SharedWithOtherOperator"
    # The rule a cache needs is on the bucket already, identical but not recorded as ours.
    IDENTICAL_FOREIGN_RULE: Final = "IdenticalForeignRule"
    # A lifecycle rule that is not cachewarm's also deletes this cache's JAX entries (Event).
    FOREIGN_RULE_DELETES_ENTRIES: Final = "ForeignRuleDeletesEntries"
    # Soft delete of a bucket no cache of this operator created: its owner's, never written.
    NOT_MANAGED: Final = "NotManaged"
    BUCKET_BUSY: Final = "BucketChangedConcurrently"
    KUBERNETES_ERROR: Final = "KubernetesError"
    BUCKET_CREATED: Final = "BucketCreated"
    BUCKET_NOT_FOUND: Final = "BucketNotFound"
    LOCATION_MISMATCH: Final = "LocationMismatch"
    BUCKET_CONFIGURED: Final = "BucketConfigured"
    DRIFT_CORRECTED: Final = "DriftCorrected"
    ACCESS_DENIED: Final = "AccessDenied"
    NAME_TAKEN: Final = "BucketNameTaken"
    # The bucket exists and its owner has not consented to this namespace's use of the prefix.
    BUCKET_NOT_GRANTED: Final = "BucketNotGranted"
    # A new bucket outside what the operator's admin allows (location, class, count).
    CREATION_NOT_ALLOWED: Final = "BucketCreationNotAllowed"
    GCS_UNAVAILABLE: Final = "GCSUnavailable"
    BUCKET_NOT_READY: Final = "BucketNotReady"
    DATA_DELETED: Final = "DataDeleted"
    DATA_RETAINED: Final = "DataRetained"
    BUCKET_DELETED: Final = "BucketDeleted"
    BUCKET_KEPT: Final = "BucketKept"
    ENV_KEPT: Final = "UserEnvKept"
    # Warning: pods whose local copy (spec.injection.localCopy) failed started cold.
    LOCAL_COPY_COLD: Final = "LocalCopyCold"
    WARMER_CREATED: Final = "WarmerCreated"
    WARMER_STOPPED: Final = "WarmerStopped"
    WARMER_SUCCEEDED: Final = "WarmerSucceeded"
    WARMER_FAILED: Final = "WarmerFailed"
    # A warmer could not move its entries' customTime forward (e.g. no storage.objects.update);
    # the warm itself stands, but entries in use may expire.
    LAST_USE_NOT_REFRESHED: Final = "LastUseNotRefreshed"
    WARMING: Final = "Warming"
    WARMUP_FAILED: Final = "WarmupFailed"
    CACHE_EMPTY: Final = "CacheEmpty"
    # Entries a warmer reported are not (or no longer) in the bucket.
    ENTRIES_MISSING: Final = "EntriesMissing"
    # A failed warmer is run again after a backoff.
    WARMER_RETRIED: Final = "WarmerRetried"
    # Programs the warmer compiled that JAX did not write (below the size/time thresholds).
    PROGRAMS_NOT_CACHED: Final = "ProgramsNotCached"
    WARMED: Final = "Warmed"
    # Warmed stays True while a cache that was Warmed, and still holds entries, re-warms
    # (cron slot, rewarm annotation, new image): new pods read it and are not held.
    REWARMING: Final = "Rewarming"
    POD_RELEASED: Final = "PodReleased"
    # A tpu pool whose type and topology the shape table does not know (and no hosts or
    # chipsPerHost override), or overrides that do not fit the topology.
    UNKNOWN_TPU_SHAPE: Final = "UnknownTpuShape"
    INVALID_TPU_SHAPE: Final = "InvalidTpuShape"
    # A warmer pod the scheduler cannot place (PodScheduled=False, reason Unschedulable).
    UNSCHEDULABLE: Final = "Unschedulable"
    # An object the operator built was refused by the client library before it was sent.
    INVALID_OBJECT: Final = "InvalidObject"
    # A step failed in a way nothing else names (a bug, or a library raising the unexpected).
    RECONCILE_ERROR: Final = "ReconcileError"
    # On the operator's own Pod (Events): its MutatingWebhookConfiguration could not be
    # pointed at it (e.g. not installed), so pods are admitted without the cache env; and
    # once it could.
    WEBHOOK_NOT_CONFIGURED: Final = "WebhookNotConfigured"
    WEBHOOK_CONFIGURED: Final = "WebhookConfigured"
    # PodsReadOnly: True with READ_ONLY, False with READ_WRITE_CHOSEN.
    READ_ONLY: Final = "ReadOnly"
    READ_WRITE_CHOSEN: Final = "ReadWriteChosen"
    # LocalCopyAsSpecified: the copy is each pod's own, as the spec says; no copy asked for;
    # HostPath asked for but withdrawn (an EmptyDir copy instead).
    PER_POD_COPY: Final = "PerPodCopy"
    NO_LOCAL_COPY: Final = "NoLocalCopy"
    HOST_PATH_WITHDRAWN: Final = "HostPathWithdrawn"
    # Pools whose warmers recorded no manifest generation: their pods' copies are empty.
    NO_TRUSTED_MANIFEST: Final = "NoTrustedManifest"
    # The operator runs with no warmer image (CACHEWARM_WARMER_IMAGE empty): no pod can get a copy.
    NO_WARMER_IMAGE: Final = "NoWarmerImage"
    # A ConfigMap of the cache's name whose content is not what the operator wrote (D4).
    CONFIGMAP_NOT_OURS: Final = "ConfigMapNotOurs"
    # A pod labelled job-name=<warmer Job> that the Job does not own: its results are ignored.
    WARMER_POD_IGNORED: Final = "WarmerPodIgnored"
    # A Job under the cache's warmer label that the cache does not control: stopped, never read.
    WARMER_JOB_NOT_OURS: Final = "WarmerJobNotOurs"


# JAX reads these once, at `import jax`; they must be in the pod spec.
ENV_CACHE_DIR: Final = "JAX_COMPILATION_CACHE_DIR"
ENV_MIN_COMPILE_TIME: Final = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
ENV_MIN_ENTRY_SIZE: Final = "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"
ENV_ENABLE_XLA_CACHES: Final = "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES"
# Multi-host warmers: where process 0's coordinator listens, how many processes, and this
# process's index (jax.distributed.initialize arguments; see README "Multi-host warmers").
ENV_COORDINATOR_ADDRESS: Final = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES: Final = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID: Final = "JAX_PROCESS_ID"
# spec.injection.localCopy: the directory pods read the cache from (their
# JAX_COMPILATION_CACHE_DIR) and the init container that fills it (builders/localcopy.py).
LOCAL_COPY_DIR: Final = "/cachewarm-cache"
LOCAL_COPY_CONTAINER: Final = "cachewarm-copy"

# torch.compile caches (spec.torch): Inductor and Triton read these at their first use;
# the operator sets them, the same in warmers and pods (spec.torch.cacheDir), so no path
# differs between them. The volume at that path is a writable emptyDir in both.
ENV_TORCHINDUCTOR_CACHE_DIR: Final = "TORCHINDUCTOR_CACHE_DIR"
ENV_TRITON_CACHE_DIR: Final = "TRITON_CACHE_DIR"
TRITON_SUBDIR: Final = "triton"
TORCH_VOLUME: Final = "cachewarm-torch"
