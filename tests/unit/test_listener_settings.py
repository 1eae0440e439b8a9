"""The listeners' settings refuse what they cannot use, at startup: a client CA that is not
a readable PEM file of certificates (a typo must not leave the admission listener open, nor
stop it later), and limits out of range."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from pydantic import ValidationError

from cachewarm.admission import certificates as certs
from cachewarm.runtime.settings import Settings


def test_a_client_ca_file_is_checked_at_startup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = tmp_path / "ca.crt"
    good.write_bytes(certs.make_ca("apiserver-client", now=dt.datetime.now(dt.timezone.utc)).cert_pem)
    monkeypatch.setenv("CACHEWARM_ADMISSION_CLIENT_CA", str(good))
    assert Settings.from_env().admission_client_ca == str(good)
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")
    for wrong in (str(tmp_path / "missing.crt"), str(garbage), str(tmp_path)):
        monkeypatch.setenv("CACHEWARM_ADMISSION_CLIENT_CA", wrong)
        with pytest.raises(ValidationError, match="not a readable PEM file of CA certificates"):
            Settings.from_env()


def test_defaults_put_reports_on_their_own_port_with_bounded_listeners() -> None:
    settings = Settings()
    assert settings.reports_port != settings.webhook_port
    assert ":9444/report/v1" in settings.report_url
    assert settings.admission_client_ca == ""


@pytest.mark.parametrize(("name", "value"), [
    ("CACHEWARM_REPORTS_PORT", "0"), ("CACHEWARM_REPORTS_PORT", "70000"), ("CACHEWARM_HTTP_HEADER_SECONDS", "0"),
    ("CACHEWARM_HTTP_BODY_SECONDS", "-1"), ("CACHEWARM_HTTP_KEEPALIVE_SECONDS", "301"),
    ("CACHEWARM_HTTP_MAX_CONNECTIONS", "0"), ("CACHEWARM_REPORT_REVIEW_QUEUE", "0"),
    ("CACHEWARM_HTTP_MAX_CONNECTIONS", "many"), ("CACHEWARM_HTTP_MAX_CONNECTIONS_PER_PEER", "0"),
    ("CACHEWARM_HTTP_MAX_CONNECTIONS_PER_PEER", "300"),  # above the listener's own cap (256): never applies
])
def test_listener_limits_out_of_range_are_refused(name: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError):
        Settings.from_env()


def test_the_per_peer_cap_defaults_below_the_listeners_and_an_old_smaller_cap_still_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings()
    assert 1 <= settings.http_max_connections_per_peer < settings.http_max_connections
    monkeypatch.setenv("CACHEWARM_HTTP_MAX_CONNECTIONS", "8")  # set before the per-peer cap existed
    assert Settings.from_env().http_max_connections == 8
    monkeypatch.setenv("CACHEWARM_HTTP_MAX_CONNECTIONS_PER_PEER", "9")
    with pytest.raises(ValidationError, match="http_max_connections_per_peer"):
        Settings.from_env()


@pytest.mark.parametrize(("name", "value"), [
    ("CACHEWARM_REPORTS_PORT", "9443"),  # the webhook's: the apiserver's calls would be split between both
    ("CACHEWARM_METRICS_PORT", "9444"),
])
def test_two_listeners_on_one_port_are_refused(name: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError, match="must differ"):
        Settings.from_env()


def test_the_admission_listener_keeps_idle_connections_longer_than_the_apiserver() -> None:
    # The apiserver keeps idle webhook connections 90 s (its HTTP transport's default): a
    # shorter keep-alive on the admission side closes them under it (a new TLS handshake per
    # burst of pods, and a request racing the close fails). Reports keep a short one.
    from cachewarm.runtime.main import listener_limits

    reports, admission = listener_limits(Settings())
    assert admission.keepalive_seconds > 90 >= reports.keepalive_seconds
    assert (admission.max_connections_per_peer, reports.max_connections_per_peer) == (16, 16)
    ours = Settings(http_max_connections_per_peer=4, admission_keepalive_seconds=200)
    reports, admission = listener_limits(ours)
    assert (admission.keepalive_seconds, admission.max_connections_per_peer, reports.max_connections_per_peer) == \
        (200, 4, 4)
