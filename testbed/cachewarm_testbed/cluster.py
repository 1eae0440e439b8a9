"""The local control plane and GCS emulator, started on loopback the way envtest does.

`Testbed` owns one working directory. `start()` brings up etcd, kube-apiserver (RBAC and
OwnerReferencesPermissionEnforcement on, as on OpenShift; serving certs made with
`cryptography`, a static admin token, service-account token signing) and the GCS emulator; `start_controller_manager()` adds kube-controller-manager
when a test needs Jobs, garbage collection or namespace deletion; `start_real_node()` a
real kubelet with containerd (cachewarm_testbed.realnode). The state is written to
`state.json` so another process (`make dev-down`) can stop what this one started.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import os
import secrets
import signal
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import yaml
from prometheus_client.parser import text_string_to_metric_families

from cachewarm.admission import certificates as certs
from cachewarm.agents import payload
from cachewarm_testbed import nodes, simimages
from cachewarm_testbed.processes import Proc, StartError, free_port, free_ports, start, wait_until
from cachewarm_testbed.realnode import NODE_IP, RealNode

T = TypeVar("T")

BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy", "kubectl")
ADMIN_USER = "cachewarm-testbed-admin"
SERVICE_CIDR = "10.96.0.0/16"
# Controllers a test may need: Jobs make Pods, owner references are collected, namespaces
# really go away, every namespace gets its `default` ServiceAccount, and nodes lose the
# not-ready taint once their (simulated) kubelet reports Ready.
CONTROLLERS = (
    "job-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "ttl-after-finished-controller",
    "node-lifecycle-controller",
    # The real node's pods mount a ServiceAccount token, which waits for kube-root-ca.crt.
    "root-ca-certificate-publisher-controller",
    # Selector Services (the webhook's) get EndpointSlices, which kube-proxy routes to.
    "endpointslice-controller",
    # The built-in edit/view roles take in manifests/rbac/user_roles.yaml by aggregation.
    "clusterrole-aggregation-controller",
)
# With a real node only: the operator installed from manifests/ is a Deployment (on
# simulated nodes its pod could never run; the operator runs as a local process there).
# The disruption controller keeps the operator's PodDisruptionBudget's status.
# With the real node, pods can have generic ephemeral volumes (spec.injection.localCopy's
# Ephemeral): the controller that makes their claims, the binder that binds them to a
# PersistentVolume, and the protections that let them go when the pod does.
REAL_NODE_CONTROLLERS = ("deployment-controller", "replicaset-controller", "disruption-controller",
                         "ephemeral-volume-controller", "persistentvolume-binder-controller",
                         "persistentvolume-protection-controller", "persistentvolumeclaim-protection-controller")


def repo_root() -> Path:
    """The checkout this package was installed from (editable install), or the cwd."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "hack" / "versions.env").is_file():
            return parent
    return Path.cwd()


def versions() -> dict[str, str]:
    """K8S_VERSION and ETCD_VERSION from hack/versions.env (the one place they are pinned)."""
    out: dict[str, str] = {}
    path = repo_root() / "hack" / "versions.env"
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            out[key.strip().removesuffix("?").strip()] = value.strip()
    return out


def bin_dir() -> Path:
    """Where the Go-built binaries are: $CACHEWARM_TESTBED_BIN or the versioned cache."""
    env = os.environ.get("CACHEWARM_TESTBED_BIN")
    if env:
        return Path(env)
    v = versions()
    return repo_root() / ".cache" / "bin" / f"k8s-v{v['K8S_VERSION']}_etcd-v{v['ETCD_VERSION']}"


def local_images() -> dict[str, dict[str, Any]]:
    """The images the node agent knows (cachewarm_testbed.nodeagent's image map), each
    with content of its own (cachewarm_testbed.simimages), built from the Dockerfile that
    builds it for the real node where there is one:

    - the warmer image: warmer_image/Dockerfile's /opt/cachewarm (its files linked to this
      checkout's; `cp A B DIR` keeps the names), no python;
    - the demo's training image (demo/train:1, and cachewarm/demo-train:0.1.0 as
      cachewarm_testbed.images names it for the real node) and its stage `plain`
      (cachewarm/demo-train-plain:0.1.0: no GCS library): demo/Dockerfile's files, WORKDIR,
      ENV and a python holding what its `pip install` lines name;
    - demo/train:2: the same Dockerfile built again, a folder of its own;
    - test/targets:1: demo/Dockerfile's python and ENV with tests/data's programs in /app.

    Raises simimages.ImageError when this environment cannot give an image what its
    Dockerfile installs."""
    repo = repo_root()
    cache = simimages.default_cache(repo)
    # The warmer image's /opt/cachewarm, as warmer_image/Dockerfile lays it out (the file
    # names matter: `cp A B DIR` keeps them), linked to this checkout's files.
    stage = Path(tempfile.gettempdir()) / f"cachewarm-warmer-image-{uuid.uuid5(uuid.NAMESPACE_URL, str(repo)).hex[:12]}"
    stage.mkdir(exist_ok=True)
    agents = repo / "operator" / "cachewarm" / "agents"
    for name, source in (*((shipped, agents / module) for shipped, module in payload.MODULES.items()),
                         # The image's static busybox: here the host's (busybox-static, make node-deps).
                         (payload.BUSYBOX, Path(shutil.which("busybox") or "/bin/busybox"))):
        link = stage / name
        if not (link.is_symlink() and link.resolve() == source.resolve()):
            link.unlink(missing_ok=True)
            with contextlib.suppress(FileExistsError):  # another process of this run made it
                link.symlink_to(source)
    stages = simimages.parse_dockerfile(repo / "demo" / "Dockerfile", repo)
    train, plain = stages[""], stages["plain"]
    targets = train.copy()
    targets.files = {f"/app/{p.name}": p for p in sorted((repo / "tests" / "data").glob("*.py"))}
    return {
        "cachewarm/warmer:0.1.0": {"paths": {"/opt/cachewarm": str(stage)}, "workdir": "/"},
        "demo/train:1": simimages.image("demo/train:1", train, cache),
        # The name of the image demo/Dockerfile builds for the real node (cachewarm_testbed.images).
        "cachewarm/demo-train:0.1.0": simimages.image("cachewarm/demo-train:0.1.0", train, cache),
        "cachewarm/demo-train-plain:0.1.0": simimages.image("cachewarm/demo-train-plain:0.1.0", plain, cache),
        "demo/train:2": simimages.image("demo/train:2", train, cache),
        "test/targets:1": simimages.image("test/targets:1", targets, cache),
    }


def find_binaries() -> dict[str, Path]:
    """Paths of etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kubectl.

    Raises StartError naming the missing ones and the command that builds them.
    """
    where = bin_dir()
    found = {name: where / name for name in BINARIES}
    missing = [name for name, path in found.items() if not os.access(path, os.X_OK)]
    if missing:
        raise StartError(
            f"control-plane binaries missing in {where}: {', '.join(missing)}; "
            "build them with `make bin`"
        )
    return found


def _http_ok(url: str, *, token: str | None = None, ca: Path | None = None) -> bool:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    ctx = ssl.create_default_context(cafile=str(ca)) if ca else None
    with urllib.request.urlopen(req, timeout=2, context=ctx) as resp:
        return 200 <= int(resp.status) < 300


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so a script's `finally: bed.stop()` still runs when
    it is killed politely (Python's default would leave the testbed's processes behind)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def eventually(check: Callable[[], T | None], *, timeout: float = 60.0, what: str = "condition") -> T:
    """Poll `check` until it returns something truthy; return it. Raises AssertionError
    with `what` and the last exception when time runs out."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except (AssertionError, RuntimeError, KeyError, TypeError) as exc:
            last = exc
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}" + (f": {last}" if last else ""))


def scrape(url: str, name: str, **labels: str) -> float:
    """The sum of metric samples `name` whose labels include `labels`, read from a
    Prometheus text endpoint (0.0 when none has been recorded yet)."""
    with urllib.request.urlopen(url, timeout=10) as answer:  # noqa: S310 - our own loopback endpoint
        text = answer.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


@dataclass
class State:
    """What a running testbed is: ports, files and pids. Serialized to state.json."""

    workdir: str
    owns_workdir: bool
    etcd_port: int = 0
    apiserver_port: int = 0
    gcs_port: int = 0
    gcs_emulator_port: int = 0
    admin_token: str = ""
    # Where the apiserver and the GCS proxy listen: loopback, or the real node's address
    # (on `lo`) when its pods must reach them.
    host: str = "127.0.0.1"
    pids: dict[str, int] = field(default_factory=dict)


class Testbed:
    """etcd + kube-apiserver (+ kube-controller-manager) + GCS emulator on loopback."""

    __test__ = False  # not a pytest class, despite the name

    def __init__(self, workdir: Path | None = None) -> None:
        if workdir is None:
            self.state = State(workdir=tempfile.mkdtemp(prefix="cachewarm-testbed-"), owns_workdir=True)
        else:
            workdir.mkdir(parents=True, exist_ok=True)
            self.state = State(workdir=str(workdir.resolve()), owns_workdir=False)
        self.procs: dict[str, Proc] = {}
        self.real_node: RealNode | None = None

    # -- paths ---------------------------------------------------------------------------

    @property
    def workdir(self) -> Path:
        return Path(self.state.workdir)

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def ca_file(self) -> Path:
        return self.workdir / "pki" / "ca.crt"

    @property
    def webhook_client_ca(self) -> Path:
        """The CA of the client certificate the apiserver presents to admission webhooks
        (its --admission-control-config-file): the operator's CACHEWARM_ADMISSION_CLIENT_CA."""
        return self.workdir / "pki" / "webhook-client-ca.crt"

    @property
    def webhook_client_cert(self) -> tuple[Path, Path]:
        """The apiserver's webhook client certificate and key (files), for a test that
        speaks to the webhook as the apiserver does."""
        return self.workdir / "pki" / "webhook-client.crt", self.workdir / "pki" / "webhook-client.key"

    @property
    def server(self) -> str:
        return f"https://{self.state.host}:{self.state.apiserver_port}"

    @property
    def storage_emulator_host(self) -> str:
        """The GCS endpoint clients use: the fidelity/fault proxy in front of the emulator."""
        return f"http://{self.state.host}:{self.state.gcs_port}"

    @property
    def kubectl(self) -> Path:
        return bin_dir() / "kubectl"

    def env(self) -> dict[str, str]:
        """Variables a client needs: kubeconfig, the emulator, binaries on PATH."""
        return {
            "KUBECONFIG": str(self.kubeconfig),
            "STORAGE_EMULATOR_HOST": self.storage_emulator_host,
            # gcsfs 2026.x probes bucket types over gRPC first, which stalls ~60 s against
            # an emulator.
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "PATH": f"{bin_dir()}{os.pathsep}{os.environ.get('PATH', '')}",
        }

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, *, controller_manager: bool = False, real_node: bool = False) -> Testbed:
        """Start etcd, kube-apiserver and the GCS emulator; wait until each is ready.

        With `real_node`, the machine is claimed for a real node first (start_real_node()
        then brings it up) and the apiserver and the GCS proxy listen on its address, where
        its pods reach them (the apiserver through the `kubernetes` Service).

        Raises StartError naming the process that failed, with the tail of its log;
        everything already started is stopped first.
        """
        try:
            if real_node:
                self.real_node = RealNode(self.workdir / "realnode", self.kubeconfig, bin_dir(), SERVICE_CIDR).claim()
                self.state.host = NODE_IP
            bins = find_binaries()
            self._write_pki()
            self._start_etcd(bins["etcd"])
            self._start_apiserver(bins["kube-apiserver"])
            self._write_kubeconfig(self.kubeconfig, token=self.state.admin_token, user=ADMIN_USER)
            self.start_gcs()
            if controller_manager:
                self.start_controller_manager()
        except BaseException:
            self.stop()
            raise
        self.save()
        return self

    def start_controller_manager(self) -> None:
        """Add kube-controller-manager (Jobs, GC, namespaces, service accounts)."""
        if "kube-controller-manager" in self.procs and self.procs["kube-controller-manager"].alive():
            return
        bins = find_binaries()
        pki = self.workdir / "pki"
        proc = start(
            "kube-controller-manager",
            [
                str(bins["kube-controller-manager"]),
                f"--kubeconfig={self.kubeconfig}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                f"--controllers={','.join(CONTROLLERS + (REAL_NODE_CONTROLLERS if self.real_node else ()))}",
                "--leader-elect=false",
                "--secure-port=0",
                # Each controller as its own ServiceAccount in kube-system (kubeadm and GKE
                # do the same): manifests/policy/ lets only the Job controller
                # (system:serviceaccount:kube-system:job-controller) make pods that name a
                # Job as their controller. The admin kubeconfig above only makes their tokens.
                "--use-service-account-credentials=true",
                f"--root-ca-file={self.ca_file}",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                "--concurrent-job-syncs=5",
                "--v=1",
            ],
            self.workdir / "logs" / "kube-controller-manager.log",
        )
        self._track(proc)
        # Ready once the serviceaccount controller has made `default` in `default`.
        wait_until(
            proc,
            lambda: self.kubectl_run("get", "serviceaccount", "default", "-n", "default").returncode == 0,
            timeout=60,
            what="ready (no default ServiceAccount appeared)",
        )
        self.save()

    def stop(self) -> None:
        """Stop every process (reverse start order) and remove a workdir we created
        (kept for debugging when $CACHEWARM_TESTBED_KEEP is set). A real node goes first,
        while the apiserver can still tell its kubelet to stop the pods."""
        if self.real_node is not None:
            self.real_node.stop()
            self.real_node = None
        for name in reversed(list(self.procs)):
            self.procs[name].stop()
        self.procs.clear()
        self.state.pids.clear()
        if self.state.owns_workdir and not os.environ.get("CACHEWARM_TESTBED_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)
        else:
            state_file = self.workdir / "state.json"
            if state_file.exists():
                state_file.unlink()

    def save(self) -> None:
        self.state.pids = {name: proc.pid for name, proc in self.procs.items()}
        (self.workdir / "state.json").write_text(json.dumps(asdict(self.state), indent=2))

    @classmethod
    def load(cls, workdir: Path) -> Testbed | None:
        """The testbed described by workdir/state.json, or None if there is none."""
        path = workdir / "state.json"
        if not path.is_file():
            return None
        bed = cls.__new__(cls)
        bed.state = State(**json.loads(path.read_text()))
        bed.real_node = None
        bed.procs = {
            name: Proc(name=name, pid=pid, log=workdir / "logs" / f"{name}.log")
            for name, pid in bed.state.pids.items()
        }
        return bed

    def healthy(self) -> bool:
        """True when every recorded process lives and the apiserver answers /readyz."""
        if not self.procs or not all(p.alive() for p in self.procs.values()):
            return False
        try:
            return _http_ok(f"{self.server}/readyz", token=self.state.admin_token, ca=self.ca_file)
        except OSError:
            return False

    def __enter__(self) -> Testbed:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- clients -------------------------------------------------------------------------

    def kubectl_run(
        self, *args: str, input: str | None = None, kubeconfig: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this testbed (admin unless `kubeconfig` names another)."""
        return subprocess.run(
            [str(self.kubectl), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def apply(self, obj: dict[str, Any], namespace: str) -> str:
        """`kubectl apply` one object; returns kubectl's output. Raises RuntimeError on failure."""
        result = self.kubectl_run("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj))
        if result.returncode != 0:
            raise RuntimeError(result.stderr.strip())
        return result.stdout

    def get_json(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        """The object as the apiserver stores it, or None when it does not exist."""
        result = self.kubectl_run("get", kind, name, "-n", namespace, "-o", "json", "--ignore-not-found")
        if result.returncode != 0:
            raise RuntimeError(result.stderr.strip())
        return json.loads(result.stdout) if result.stdout.strip() else None

    def events_for(self, name: str, namespace: str) -> list[dict[str, Any]]:
        """Core Events whose involvedObject is `name` in `namespace`."""
        result = self.kubectl_run("get", "events", "-n", namespace, "-o", "json",
                                  f"--field-selector=involvedObject.name={name}")
        items: list[dict[str, Any]] = json.loads(result.stdout)["items"] if result.returncode == 0 else []
        return items

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path) -> Path:
        """A kubeconfig that authenticates as ServiceAccount namespace/name.

        The token comes from the TokenRequest API, so the identity is exactly the one a pod
        of that ServiceAccount would have, with only the RBAC bound to it.
        Raises RuntimeError when the ServiceAccount does not exist.
        """
        result = self.kubectl_run("create", "token", name, "-n", namespace, "--duration=24h")
        if result.returncode != 0:
            raise RuntimeError(f"could not mint a token for {namespace}/{name}: {result.stderr.strip()}")
        self._write_kubeconfig(path, token=result.stdout.strip(), user=f"{namespace}/{name}")
        return path

    def start_operator(self, kubeconfig: Path, env: dict[str, str] | None = None) -> Proc:
        """Run `cachewarm run` as its own process with `kubeconfig`'s identity, its webhook
        on a loopback port; wait until its liveness endpoint answers. The caller stops it
        (Proc.stop); `proc.webhook_url` is where its webhook listens."""
        # Distinct, and apart from the ports a restart keeps (its webhook and reports ports).
        kept = frozenset(int(v) for k, v in (env or {}).items()
                         if k in ("CACHEWARM_WEBHOOK_PORT", "CACHEWARM_REPORTS_PORT") and v.isdigit())
        port, webhook_port, reports_port, metrics_port = free_ports(4, kept)
        full_env = {
            **os.environ,
            **self.env(),
            "KUBECONFIG": str(kubeconfig),
            "CACHEWARM_LOG_FORMAT": "console",
            "CACHEWARM_LIVENESS_ENDPOINT": f"http://127.0.0.1:{port}/healthz",
            # The apiserver reaches the webhook on loopback; the operator points the
            # installed webhook configuration there with its own CA.
            "CACHEWARM_WEBHOOK_ADDRESS": "127.0.0.1",
            "CACHEWARM_WEBHOOK_PORT": str(webhook_port),
            "CACHEWARM_WEBHOOK_URL": f"https://127.0.0.1:{webhook_port}",
            # Only the apiserver (its admission configuration's client certificate) is answered.
            "CACHEWARM_ADMISSION_CLIENT_CA": str(self.webhook_client_ca),
            "CACHEWARM_METRICS_PORT": str(metrics_port),
            # Pods of the node agent share the host's network: they reach the operator's
            # reports listener here.
            "CACHEWARM_REPORTS_PORT": str(reports_port),
            "CACHEWARM_REPORT_URL": f"https://127.0.0.1:{reports_port}/report/v1",
            # As the downward API's status.podIP: where another replica forwards reports to
            # this one while it leads (its webhook port is its own unless the caller shares one).
            "CACHEWARM_POD_IP": "127.0.0.1",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        n = sum(1 for name in self.procs if name.startswith("operator"))
        proc = start(f"operator-{n}", [sys.executable, "-m", "cachewarm", "run"],
                     self.workdir / "logs" / f"operator-{n}.log", env=full_env)
        self.procs[proc.name] = proc
        proc.webhook_url = full_env["CACHEWARM_WEBHOOK_URL"]
        proc.report_url = full_env["CACHEWARM_REPORT_URL"]
        proc.metrics_url = f"http://127.0.0.1:{full_env['CACHEWARM_METRICS_PORT']}/metrics"
        wait_until(proc, lambda: _http_ok(f"http://127.0.0.1:{port}/healthz"), timeout=60, what="live (/healthz)")
        return proc

    def start_scheduler(self) -> None:
        """Add kube-scheduler (same version as the apiserver): pods are placed on nodes by
        the real scheduler, with node selectors, taints and GPU/TPU capacity."""
        if "kube-scheduler" in self.procs and self.procs["kube-scheduler"].alive():
            return
        bins = find_binaries()
        port = free_port()
        proc = start(
            "kube-scheduler",
            [
                str(bins["kube-scheduler"]),
                f"--kubeconfig={self.kubeconfig}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={self.workdir / 'pki' / 'scheduler'}",
                "--v=1",
            ],
            self.workdir / "logs" / "kube-scheduler.log",
        )
        self._track(proc)
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE  # its own self-signed serving cert, on loopback

        def healthy() -> bool:
            with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", timeout=2, context=insecure) as resp:
                return int(resp.status) == 200
        wait_until(proc, healthy, timeout=60, what="healthy (/healthz)")
        self.save()

    def start_node_agent(self, images: dict[str, dict[str, Any]],
                         node_specs: Sequence[nodes.NodeSpec] = nodes.DEFAULT_NODES) -> Proc:
        """Start kube-scheduler (if needed) and the stand-in kubelet (cachewarm_testbed.nodeagent)
        for simulated GKE nodes; return once every node is Ready. Pods on those nodes get the
        env their spec resolves to, their image's env and the GCS endpoint (the node's
        stand-in for GKE's metadata server), never this process's environment. Needs
        kube-controller-manager for Jobs to make pods."""
        self.start_scheduler()
        n = sum(1 for name in self.procs if name.startswith("nodeagent"))
        node_env = {
            "STORAGE_EMULATOR_HOST": self.storage_emulator_host,
            # gcsfs 2026.x probes bucket types over gRPC first, which stalls ~60 s against
            # an emulator.
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }
        proc = start(
            f"nodeagent-{n}",
            [sys.executable, "-m", "cachewarm_testbed.nodeagent", f"--kubeconfig={self.kubeconfig}",
             f"--workdir={self.workdir / 'pods'}", f"--image-map={json.dumps(images)}",
             f"--nodes={json.dumps([spec.to_dict() for spec in node_specs])}",
             f"--node-env={json.dumps(node_env)}"],
            self.workdir / "logs" / f"nodeagent-{n}.log",
            env={**os.environ, **self.env(), "PYTHONUNBUFFERED": "1"},
        )
        self._track(proc)
        names = [spec.name for spec in node_specs]

        def ready() -> bool:
            out = self.kubectl_run("get", "nodes", *names, "-o",
                                   "jsonpath={range .items[*]}{.status.conditions[?(@.type=='Ready')].status}{' '}{end}")
            return out.returncode == 0 and out.stdout.split() == ["True"] * len(names)
        wait_until(proc, ready, timeout=30, what=f"registered ({', '.join(names)} Ready)")
        self.save()
        return proc

    def start_real_node(self) -> RealNode:
        """Add a real node (containerd + runc + CNI bridge + kubelet, cachewarm_testbed.realnode)
        with kube-controller-manager and kube-scheduler; return once it is Ready. Needs root
        and `make node-deps`; one per machine. `stop()` removes it and restores the host.
        Raises StartError."""
        if self.real_node is not None and self.real_node.running:
            return self.real_node
        self.start_controller_manager()
        self.start_scheduler()
        node = self.real_node or RealNode(self.workdir / "realnode", self.kubeconfig, bin_dir(), SERVICE_CIDR)
        self.real_node = node
        node.start()
        return node

    def pod_log(self, namespace: str, name: str, container: str) -> str:
        """What a container of a pod run by the node agent wrote (kubectl logs, in effect)."""
        return (self.workdir / "pods" / namespace / name / f"{container}.log").read_text(errors="replace")

    # -- pieces --------------------------------------------------------------------------

    def _track(self, proc: Proc) -> None:
        self.procs[proc.name] = proc
        self.state.pids[proc.name] = proc.pid

    def _write_pki(self) -> None:
        pki = self.workdir / "pki"
        pki.mkdir(parents=True, exist_ok=True)
        now = dt.datetime.now(dt.timezone.utc)
        ca = certs.make_ca("cachewarm-testbed-ca", now=now)
        serving = certs.make_serving_cert(
            ca, ["127.0.0.1", "localhost", "kubernetes.default.svc", "10.96.0.1", NODE_IP], now=now
        )
        sa_private, sa_public = certs.make_signing_key()
        for fname, data in {
            "ca.crt": ca.cert_pem,
            "ca.key": ca.key_pem,
            "apiserver.crt": serving.cert_pem,
            "apiserver.key": serving.key_pem,
            "sa.key": sa_private,
            "sa.pub": sa_public,
        }.items():
            (pki / fname).write_bytes(data)
            (pki / fname).chmod(0o600)
        self.state.admin_token = secrets.token_hex(24)
        (pki / "tokens.csv").write_text(
            f'{self.state.admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n'
        )
        self._write_admission_config(pki, now)

    def _write_admission_config(self, pki: Path, now: dt.datetime) -> None:
        """The apiserver's admission configuration, as an admin sets it up on a cluster
        whose apiserver flags they own: every admission webhook call presents a client
        certificate of its own CA (kubeconfig user '*': any webhook host), so a webhook
        can tell the apiserver from anyone else who reaches its port."""
        client_ca = certs.make_ca("cachewarm-testbed-webhook-client-ca", now=now)
        client = certs.make_client_cert(client_ca, "kube-apiserver-webhook-client", now=now)
        (pki / "webhook-client-ca.crt").write_bytes(client_ca.cert_pem)
        # Also as files: a test that calls the webhook as the apiserver would presents them.
        (pki / "webhook-client.crt").write_bytes(client.cert_pem)
        (pki / "webhook-client.key").write_bytes(client.key_pem)
        (pki / "webhook-client.key").chmod(0o600)
        kubeconfig = {
            "apiVersion": "v1", "kind": "Config",
            "users": [{"name": "*", "user": {
                "client-certificate-data": base64.b64encode(client.cert_pem).decode(),
                "client-key-data": base64.b64encode(client.key_pem).decode()}}],
        }
        (pki / "webhook-client.kubeconfig").write_text(yaml.safe_dump(kubeconfig, sort_keys=False))
        (pki / "webhook-client.kubeconfig").chmod(0o600)
        plugin = {"apiVersion": "apiserver.config.k8s.io/v1", "kind": "WebhookAdmissionConfiguration",
                  "kubeConfigFile": str(pki / "webhook-client.kubeconfig")}
        config = {"apiVersion": "apiserver.config.k8s.io/v1", "kind": "AdmissionConfiguration",
                  "plugins": [{"name": "MutatingAdmissionWebhook", "configuration": plugin},
                              {"name": "ValidatingAdmissionWebhook", "configuration": plugin}]}
        (pki / "admission.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

    def _start_etcd(self, binary: Path) -> None:
        self.state.etcd_port = free_port()
        peer = free_port()
        client_url = f"http://127.0.0.1:{self.state.etcd_port}"
        peer_url = f"http://127.0.0.1:{peer}"
        proc = start(
            "etcd",
            [
                str(binary),
                "--name=testbed",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=testbed={peer_url}",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
            self.workdir / "logs" / "etcd.log",
        )
        self._track(proc)
        wait_until(proc, lambda: _http_ok(f"{client_url}/health"), timeout=30, what="healthy")

    def _start_apiserver(self, binary: Path) -> None:
        self.state.apiserver_port = free_port()
        pki = self.workdir / "pki"
        proc = start(
            "kube-apiserver",
            [
                str(binary),
                f"--etcd-servers=http://127.0.0.1:{self.state.etcd_port}",
                f"--bind-address={self.state.host}",
                # The `kubernetes` Service's endpoint: a loopback address gets none.
                f"--advertise-address={self.state.host}",
                f"--secure-port={self.state.apiserver_port}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--token-auth-file={pki / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                # As on OpenShift: blockOwnerDeletion needs update on the owner's
                # finalizers, so manifests/ must grant it.
                "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
                # Webhook calls carry a client certificate (see _write_admission_config).
                f"--admission-control-config-file={pki / 'admission.yaml'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--allow-privileged=true",
                # logs/exec on a real node go to its InternalIP, not its (unresolvable) name.
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                f"--cert-dir={pki}",
                "--v=1",
            ],
            self.workdir / "logs" / "kube-apiserver.log",
        )
        self._track(proc)
        wait_until(
            proc,
            lambda: _http_ok(f"{self.server}/readyz", token=self.state.admin_token, ca=self.ca_file),
            timeout=90,
            what="ready (/readyz)",
        )

    def start_gcs(self) -> Testbed:
        """Start the GCS emulator and its proxy only (tests of GCS behaviour need no
        control plane). Raises StartError."""
        self._start_gcs_emulator()
        return self

    def _start_gcs_emulator(self) -> None:
        self.state.gcs_emulator_port = free_port()
        upstream = f"http://127.0.0.1:{self.state.gcs_emulator_port}"
        proc = start(
            "gcs-emulator",
            [sys.executable, "-m", "cachewarm_testbed.gcsemulator", "start", "--host=127.0.0.1", f"--port={self.state.gcs_emulator_port}", "--in-memory"],
            self.workdir / "logs" / "gcs-emulator.log",
        )
        self._track(proc)
        wait_until(proc, lambda: _http_ok(f"{upstream}/storage/v1/b?project=testbed"),
                   timeout=30, what="answering /storage/v1/b")
        self.state.gcs_port = free_port()
        proxy = start(
            "gcs-proxy",
            [sys.executable, "-m", "cachewarm_testbed.gcsproxy", f"--host={self.state.host}",
             f"--port={self.state.gcs_port}", f"--upstream={upstream}"],
            self.workdir / "logs" / "gcs-proxy.log",
        )
        self._track(proxy)
        wait_until(proxy, lambda: _http_ok(f"{self.storage_emulator_host}/storage/v1/b?project=testbed"),
                   timeout=30, what="answering /storage/v1/b")

    def _write_kubeconfig(self, path: Path, *, token: str, user: str) -> None:
        ca_data = base64.b64encode(self.ca_file.read_bytes()).decode()
        config: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "testbed", "cluster": {"server": self.server, "certificate-authority-data": ca_data}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "testbed", "context": {"cluster": "testbed", "user": user}}],
            "current-context": "testbed",
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        path.chmod(0o600)


class OperatorHandle:
    """The operator process under test; `restart()` kills it (SIGKILL, as a node loss
    would) and starts a new one with the same identity and settings."""

    def __init__(self, bed: Testbed, kubeconfig: Path, env: dict[str, str]) -> None:
        self.bed = bed
        self.kubeconfig = kubeconfig
        # One name across restarts, as a Pod's name is across container restarts: a
        # restarted leader takes its own Lease back at once.
        self.env = {"CACHEWARM_POD_NAME": f"cachewarm-operator-{uuid.uuid4().hex[:6]}", **env}
        self.proc = bed.start_operator(kubeconfig, self.env)
        self.logs = [self.proc.log]

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log(self) -> Path:
        return self.proc.log

    @property
    def webhook_url(self) -> str:
        return self.proc.webhook_url

    @property
    def metrics_url(self) -> str:
        return self.proc.metrics_url

    @property
    def report_url(self) -> str:
        """The reports listener's /report/v1 (its own port, apart from the webhook's)."""
        return self.proc.report_url

    def restart(self) -> None:
        """SIGKILL, then the same process again on the same webhook port, as a Pod's
        restarted container keeps its IP and port: its Lease identity (name@address) is
        the one it held, and it takes its own Lease back at once."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.stop(timeout=5)
        url, report_url = self.proc.webhook_url, self.proc.report_url
        self.env = {**self.env, "CACHEWARM_WEBHOOK_PORT": url.rsplit(":", 1)[1], "CACHEWARM_WEBHOOK_URL": url,
                    "CACHEWARM_REPORTS_PORT": report_url.rsplit(":", 1)[1].split("/", 1)[0],
                    "CACHEWARM_REPORT_URL": report_url}
        self.proc = self.bed.start_operator(self.kubeconfig, self.env)
        self.logs.append(self.proc.log)

    def stop(self) -> None:
        self.proc.stop()
