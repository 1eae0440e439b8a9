"""Conditions keep their transition time when nothing changed; settings reject bad env;
the backoff grows and is capped; the spec model reads the CRD's defaults."""

from __future__ import annotations

import datetime as dt

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from cachewarm.api import conditions
from cachewarm.api.conditions import Cond
from cachewarm.runtime.controller import backoff
from cachewarm.api.model import InvalidSpec, parse_spec
from cachewarm.runtime.settings import Settings

REPO = Path(__file__).resolve().parents[2]
T0 = dt.datetime(2026, 11, 22, 1, 0, tzinfo=dt.timezone.utc)
T1 = T0 + dt.timedelta(minutes=5)


def test_same_status_keeps_transition_time_new_status_moves_it() -> None:
    first = conditions.merge([], [Cond("Ready", False, "GCSUnavailable", "503")], generation=1, now=T0)
    same = conditions.merge(first, [Cond("Ready", False, "GCSUnavailable", "429")], generation=1, now=T1)
    assert same[0]["lastTransitionTime"] == "2026-11-22T01:00:00Z"
    assert same[0]["message"] == "429"
    flipped = conditions.merge(same, [Cond("Ready", True, "Reconciled", "ok")], generation=2, now=T1)
    assert flipped[0] == {
        "type": "Ready", "status": "True", "reason": "Reconciled", "message": "ok",
        "observedGeneration": 2, "lastTransitionTime": "2026-11-22T01:05:00Z",
    }


def test_merge_keeps_other_types_sorted() -> None:
    merged = conditions.merge([{"type": "Warmed", "status": "Unknown"}],
                              [Cond("Ready", None, "Pending", "")], generation=1, now=T0)
    assert [c["type"] for c in merged] == ["Ready", "Warmed"]
    assert merged[0]["status"] == "Unknown"


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHEWARM_NAMESPACES", "team-a, team-b")
    monkeypatch.setenv("CACHEWARM_RESYNC_SECONDS", "60")
    settings = Settings.from_env()
    assert settings.namespaces == ["team-a", "team-b"]
    assert settings.resync_seconds == 60.0
    assert settings.instance == "default"
    monkeypatch.setenv("CACHEWARM_INSTANCE", "eu-west_2")
    assert Settings.from_env().instance == "eu-west_2"


@pytest.mark.parametrize("value", ['["team-a", "team-b"]', "team-a, team-b", "team-a,team-b,", ' ["team-a","team-b"] '])
def test_namespaces_parse_as_json_list_or_comma_separated(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CACHEWARM_NAMESPACES", value)
    assert Settings.from_env().namespaces == ["team-a", "team-b"]


def test_webhook_hosts_parse_as_json_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHEWARM_WEBHOOK_HOSTS", '["hook.example.svc", "127.0.0.1"]')
    assert Settings.from_env().webhook_hosts == ["hook.example.svc", "127.0.0.1"]


@pytest.mark.parametrize("value", ["", "[]"])
def test_empty_namespaces_watch_the_cluster(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CACHEWARM_NAMESPACES", value)
    assert Settings.from_env().namespaces == []


@pytest.mark.parametrize(("value", "message"), [
    ('["team-a", "team-b"', "not a valid JSON list"),
    ('["team-a", 2]', "must hold strings only"),
    ('[["team-a"]]', "must hold strings only"),
    ('["team.a"]', "not namespace names"),
    ("Team-A,team-b", "not namespace names"),
    ('["team-a" "team-b"]', "not a valid JSON list"),
])
def test_wrong_namespaces_say_what_is_wrong(monkeypatch: pytest.MonkeyPatch, value: str, message: str) -> None:
    monkeypatch.setenv("CACHEWARM_NAMESPACES", value)
    with pytest.raises(ValidationError) as info:
        Settings.from_env()
    assert "namespaces" in str(info.value)
    assert message in str(info.value)


@pytest.mark.parametrize(("var", "value"), [
    ("CACHEWARM_LOG_FORMAT", "xml"),
    ("CACHEWARM_LOG_LEVEL", "LOUD"),
    ("CACHEWARM_RESYNC_SECONDS", "0"),
    ("CACHEWARM_RESYNC_SECONDS", "soon"),
    ("CACHEWARM_GCS_TIMEOUT_SECONDS", "-1"),
    ("CACHEWARM_KUBE_TIMEOUT_SECONDS", "0"),
    ("CACHEWARM_REPORT_WINDOW_SECONDS", "-5"),
    ("CACHEWARM_REPORT_WINDOW_SECONDS", "an hour"),
    ("CACHEWARM_USAGE_FLUSH_SECONDS", "0"),
    ("CACHEWARM_METRICS_PORT", "70000"),
    ("CACHEWARM_METRICS_PORT", "metrics"),
    ("CACHEWARM_KUBE_TIMEOUT_SECONDS", "a minute"),
    ("CACHEWARM_INSTANCE", "Prod"),  # GCS label values are lowercase
    ("CACHEWARM_INSTANCE", "1"),  # the record of rules written before instances
    ("CACHEWARM_INSTANCE", "a" * 64),
    ("CACHEWARM_INSTANCE", "eu.west"),
    ("CACHEWARM_WORKERS", "0"),
    ("CACHEWARM_WORKERS", "65"),
    ("CACHEWARM_WORKERS", "many"),
    ("CACHEWARM_LEADER_ELECTION", "maybe"),
    ("CACHEWARM_LEADER_ELECTION_LEASE", ""),
    ("CACHEWARM_LEADER_ELECTION_LEASE", "Cachewarm"),  # object names are lowercase
    ("CACHEWARM_LEADER_ELECTION_LEASE", "cachewarm-"),
    ("CACHEWARM_WEBHOOK_CERT_SECRET", "webhook_tls"),
    ("CACHEWARM_WEBHOOK_CERT_SECRET", "-tls"),
    ("CACHEWARM_CERT_CHECK_SECONDS", "0"),
    ("CACHEWARM_CERT_CHECK_SECONDS", "hourly"),
    ("CACHEWARM_INVENTORY_SECONDS", "0"),
    ("CACHEWARM_INVENTORY_SECONDS", "hourly"),
    ("CACHEWARM_BUCKET_LOCATIONS", "us central1"),
    ("CACHEWARM_BUCKET_LOCATIONS", '["us-central1", 5]'),
    ("CACHEWARM_BUCKET_LOCATIONS", "[us-central1"),
    ("CACHEWARM_BUCKET_STORAGE_CLASSES", "STANDARD;NEARLINE"),
    ("CACHEWARM_BUCKETS_PER_NAMESPACE", "-1"),
    ("CACHEWARM_BUCKETS_PER_NAMESPACE", "ten"),
    ("CACHEWARM_BUCKETS_PER_NAMESPACE", "10001"),
    ("CACHEWARM_BUCKET_COUNT_SECONDS", "-1"),
    ("CACHEWARM_BUCKET_COUNT_SECONDS", "a minute"),
])
def test_bad_settings_are_rejected(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ValidationError):
        Settings.from_env()


def test_bucket_limits_parse_and_name_what_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHEWARM_BUCKET_LOCATIONS", "us-central1, europe-west4")
    monkeypatch.setenv("CACHEWARM_BUCKET_STORAGE_CLASSES", '["standard"]')
    settings = Settings.from_env()
    assert settings.bucket_locations == ["US-CENTRAL1", "EUROPE-WEST4"] and settings.bucket_storage_classes == ["STANDARD"]
    assert settings.buckets_per_namespace == 10
    monkeypatch.setenv("CACHEWARM_BUCKET_LOCATIONS", "us-central1,us east4")
    with pytest.raises(ValidationError, match=r"not GCS location or storage class names.*'us east4'"):
        Settings.from_env()


def test_backoff_doubles_and_caps() -> None:
    assert [backoff(15, r) for r in range(7)] == [15, 30, 60, 120, 240, 480, 600]
    assert backoff(15, 10_000) == 600


def test_spec_defaults_match_the_crd() -> None:
    cache = parse_spec({"storage": {"gcs": {"bucket": "b-1", "location": "US"}}})
    gcs = cache.storage.gcs
    assert (gcs.prefix, gcs.create, gcs.storage_class, gcs.soft_delete_days) == ("", True, "STANDARD", 7)
    assert (gcs.lifecycle.delete_after_days, gcs.deletion_policy) == (30, "Retain")
    assert gcs.url == "gs://b-1" and gcs.object_prefix == ""
    assert cache.injection.mode == "ReadOnly"


def test_mode_default_is_the_crds() -> None:
    # Readers by default (D6): the model's default is the CRD's, so a body kopf hands us
    # without the field reads as the apiserver would have stored it.
    crd = yaml.safe_load((REPO / "crds" / "cachewarm.dev_compilationcaches.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    mode = spec["properties"]["injection"]["properties"]["mode"]
    assert mode["default"] == "ReadOnly"
    assert parse_spec({"storage": {"gcs": {"bucket": "b-1", "location": "US"}}}).injection.mode == mode["default"]
    # An object stored while the default was ReadWrite carries it explicitly and keeps it.
    stored = parse_spec({"storage": {"gcs": {"bucket": "b-1", "location": "US"}}, "injection": {"mode": "ReadWrite"}})
    assert stored.injection.mode == "ReadWrite"


def test_stored_host_path_copy_still_parses() -> None:
    # The CRD refuses HostPath in new or changed specs, but ratcheting keeps stored objects
    # valid: the operator must still read them (their pods get an EmptyDir copy).
    cache = parse_spec({"storage": {"gcs": {"bucket": "b-1", "location": "US"}}, "injection": {
        "mode": "ReadOnly", "localCopy": {"volume": "HostPath", "hostPath": "/mnt/ssd/jax"}}})
    assert cache.injection.local_copy is not None and cache.injection.local_copy.volume == "HostPath"


def test_injection_mode_wrong_is_refused() -> None:
    with pytest.raises(InvalidSpec, match=r"spec\.injection\.mode"):
        parse_spec({"storage": {"gcs": {"bucket": "b-1", "location": "US"}}, "injection": {"mode": "WriteOnly"}})


def test_local_copy_is_on_by_default_where_the_cache_allows_one_and_reads_the_crd_defaults() -> None:
    gcs = {"bucket": "b-1", "location": "US"}
    warmup = {"image": "i", "targets": ["m:f"], "pools": [{"name": "a"}]}
    default = parse_spec({"storage": {"gcs": gcs}, "warmup": warmup}).injection
    assert default.local_copy == parse_spec({"storage": {"gcs": gcs}, "injection": {"localCopy": {}}}).injection.local_copy
    assert default.local_copy_by_default
    # Not where it cannot be: readFrom Bucket, ReadWrite pods, XLA's caches on; nor
    # without warmers (no manifest names what a copy would take).
    assert parse_spec({"storage": {"gcs": gcs}}).injection.local_copy is None
    for spec in ({"injection": {"readFrom": "Bucket"}}, {"injection": {"mode": "ReadWrite"}},
                 {"jax": {"enableXlaCaches": "all"}}):
        cache = parse_spec({"storage": {"gcs": gcs}, "warmup": warmup, **spec})
        assert cache.injection.local_copy is None and cache.read_path()[0] == "Bucket", spec
    # Named: the same copy, not "by default"; and a user cannot claim the default flag.
    named = parse_spec({"storage": {"gcs": gcs}, "warmup": warmup,
                        "injection": {"readFrom": "LocalCopy", "localCopyByDefault": True}})
    assert named.injection.local_copy == default.local_copy and not named.injection.local_copy_by_default
    cache = parse_spec({"storage": {"gcs": gcs}, "injection": {"mode": "ReadOnly", "localCopy": {}}})
    local = cache.injection.local_copy
    assert local is not None
    assert (local.volume, local.size_limit, local.workers, local.timeout_seconds) == ("EmptyDir", "10Gi", 16, 300)
    assert local.host_path is None and local.storage_class_name is None
    cache = parse_spec({"storage": {"gcs": gcs}, "injection": {"mode": "ReadOnly", "localCopy": {
        "volume": "Ephemeral", "sizeLimit": "50Gi", "storageClassName": "premium-rwo", "workers": 4, "timeoutSeconds": 60}}})
    local = cache.injection.local_copy
    assert local is not None
    assert (local.volume, local.size_limit, local.storage_class_name, local.workers, local.timeout_seconds) == (
        "Ephemeral", "50Gi", "premium-rwo", 4, 60)


def test_spec_missing_bucket_names_the_field() -> None:
    with pytest.raises(InvalidSpec, match=r"spec\.storage\.gcs\.bucket"):
        parse_spec({"storage": {"gcs": {"location": "US"}}})


@pytest.mark.parametrize(("schedule", "why"), [
    ("99 * * * *", "not a valid cron schedule"),
    # croniter takes a sixth (seconds) field: a wake-up every second; the CRD says 5 fields.
    ("* * * * * *", "not a valid cron schedule"),
    # croniter's R draws another minute at each parse: every reconcile another slot, another warmer.
    ("R * * * *", "random field"),
    ("0 R(1-5) * * *", "random field"),
    ("r * * * *", "random field"),  # croniter takes it lower-case too
    # No 30th of February: croniter raises at every reconcile.
    ("0 0 30 2 *", "never fires"),
])
def test_invalid_cron_schedule_names_the_field(schedule: str, why: str) -> None:
    spec = {"storage": {"gcs": {"bucket": "b-1", "location": "US"}},
            "warmup": {"image": "i", "targets": ["m:f"], "pools": [{"name": "p"}], "schedule": schedule}}
    with pytest.raises(InvalidSpec, match=rf"spec\.warmup\.schedule: .*{why}"):
        parse_spec(spec)


@pytest.mark.parametrize("schedule", ["0 3 * * *", "@daily", "*/5 * * * *", "0 0 29 2 *", "0 3 * MAR,APR FRI"])
def test_valid_cron_schedules_are_taken(schedule: str) -> None:
    spec = {"storage": {"gcs": {"bucket": "b-1", "location": "US"}},
            "warmup": {"image": "i", "targets": ["m:f"], "pools": [{"name": "p"}], "schedule": schedule}}
    warmup = parse_spec(spec).warmup
    assert warmup is not None and warmup.schedule == schedule


@pytest.mark.parametrize(("python", "ok"), [
    ("python", True), ("python3.11", True), ("/opt/venv/bin/python3", True), ("/usr/bin/python", True),
    ("/bin/sh", False), ("python -c 'import os'", False), ("bin/python3", False), ("/usr/bin/env", False),
    ("python3; id", False), ("/tmp/x/python\n", False),
])
def test_warmup_python_is_an_interpreters_name_or_absolute_path(python: str, ok: bool) -> None:
    """It runs in warmers and in training pods (the copier): a stored cache the CRD's rule
    would refuse now (kept by validation ratcheting) is an InvalidSpec, never run."""
    spec = {"storage": {"gcs": {"bucket": "b-1", "location": "US"}},
            "warmup": {"image": "i", "targets": ["m:f"], "pools": [{"name": "p"}], "python": python}}
    if ok:
        assert parse_spec(spec).warmup.python == python  # type: ignore[union-attr]
    else:
        with pytest.raises(InvalidSpec, match=r"spec\.warmup\.python"):
            parse_spec(spec)
