"""A new user's first try: the operator started with the CRD and RBAC installed but no
MutatingWebhookConfiguration still reconciles caches, and says loudly (a warning per retry,
an Event on its Pod) that the webhook is not configured, until it is installed."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachewarm.api import constants as c
from cachewarm.runtime.handlers import WEBHOOK_ID
from cachewarm_testbed.cluster import OperatorHandle, Testbed, eventually, repo_root

pytestmark = pytest.mark.e2e

REPO = repo_root()
CONFIGURATION = "cachewarm-pod-injector"
# The operator is not a Pod here; Events need no existing involvedObject, so the name the
# downward API would give is made up.
POD = "cachewarm-operator-7d9f8-abcde"
ENV = {"CACHEWARM_RESYNC_SECONDS": "3", "CACHEWARM_RETRY_DELAY_SECONDS": "0.5", "CACHEWARM_GCS_TIMEOUT_SECONDS": "2",
       "CACHEWARM_GCP_PROJECT": "testbed", "CACHEWARM_POD_NAME": POD, "CACHEWARM_POD_NAMESPACE": "cachewarm-system"}


@pytest.fixture(scope="module")
def bare() -> Iterator[Testbed]:
    """A control plane of its own: deleting the webhook configuration of the session's
    shared one would leave the session's operator unreachable for the webhook tests."""
    bed = Testbed().start()
    try:
        for args in (("apply", "-f", str(REPO / "crds")), ("apply", "-k", str(REPO / "manifests")),
                     ("wait", "--for=condition=Established", "--timeout=60s", "crd/compilationcaches.cachewarm.dev"),
                     ("delete", "mutatingwebhookconfiguration", CONFIGURATION)):
            done = bed.kubectl_run(*args)
            assert done.returncode == 0, (args, done.stderr)
        yield bed
    finally:
        bed.stop()


def test_operator_without_webhook_configuration_reconciles_and_reports_it(bare: Testbed, tmp_path: Path) -> None:
    kubeconfig = bare.service_account_kubeconfig("cachewarm-system", "cachewarm-operator", tmp_path / "kubeconfig")
    handle = OperatorHandle(bare, kubeconfig, ENV)
    try:
        namespace = f"t-{uuid.uuid4().hex[:10]}"
        assert bare.kubectl_run("create", "namespace", namespace).returncode == 0
        cache = {"apiVersion": "cachewarm.dev/v1alpha1", "kind": "CompilationCache", "metadata": {"name": "first"},
                 "spec": {"storage": {"gcs": {"bucket": f"first-{uuid.uuid4().hex[:8]}", "location": "us-central1"}}}}
        bare.apply(cache, namespace)

        def ready() -> bool:
            obj = bare.get_json("ccache", "first", namespace) or {}
            return any(cond["type"] == "Ready" and cond["status"] == "True"
                       for cond in (obj.get("status") or {}).get("conditions") or [])

        eventually(ready, timeout=60, what="Ready=True while the webhook configuration is missing")

        def warned() -> list[dict[str, object]]:
            return [e for e in bare.events_for(POD, "cachewarm-system")
                    if e["reason"] == c.Reason.WEBHOOK_NOT_CONFIGURED and e["type"] == "Warning"]

        [event] = eventually(warned, timeout=30, what="a WebhookNotConfigured Event on the operator's Pod")
        assert CONFIGURATION in str(event["message"])
        log = handle.log.read_text(errors="replace")
        assert "Failed to point webhook configuration at this operator" in log
        assert "warning" in log.lower()

        # Installed later, it is picked up by the retries without a restart.
        applied = bare.kubectl_run("apply", "-k", str(REPO / "manifests"))
        assert applied.returncode == 0, applied.stderr

        def pointed() -> bool:
            hooks = (bare.get_json("mutatingwebhookconfiguration", CONFIGURATION, "default") or {}).get("webhooks") or []
            return bool(hooks) and all(h["clientConfig"].get("caBundle")
                                       and h["clientConfig"].get("url") == f"{handle.webhook_url}/{WEBHOOK_ID}"
                                       for h in hooks)

        eventually(pointed, timeout=90, what="the webhook configuration pointed at the operator once installed")
    finally:
        handle.stop()
