"""Test tooling: a stand-in kubelet for simulated GKE nodes, running pods as local processes.

This machine has no container runtime for these tests, so the agent plays the kubelet of
every node in `--nodes` (GKE-shaped Node objects from cachewarm_testbed.nodes). It never
binds a pod: kube-scheduler places pods on those nodes (node selectors, taints, GPU/TPU
capacity), and the agent runs only what is bound to its nodes. What it does like a kubelet:

- registers the Nodes and keeps their status Ready, with capacity (nvidia.com/gpu,
  google.com/tpu) as GKE reports it;
- runs init containers one after another, then the containers at once; reports phase,
  conditions, container states, pod and host IPs through pods/status;
- gives a container exactly the env its spec resolves to (value, fieldRef, configMap and
  secret refs, envFrom) on top of the image's own env (the image map's `env`, like
  Dockerfile ENV) and the node's environment (`--node-env`: the GCS endpoint, standing in
  for the metadata server a GKE node gives pods). The test runner's environment never
  reaches a container, so a variable the operator forgets fails a test;
- sets the pod's hostname (own UTS namespace) and gives the container, in its own mount
  namespace, a /dev of its own (a tmpfs with the usual device nodes, as runc makes one)
  holding a per-container /dev/termination-log (read back as the termination message with the kubelet's limits and
  FallbackToLogsOnError) and a per-pod /etc/hosts: the pod's own name, plus the records
  cluster DNS would serve for headless Services in its namespace
  (`<hostname>.<service>`, only for pods that are Ready or when the Service has
  publishNotReadyAddresses);
- ends the containers of a deleted pod as a kubelet does (SIGTERM, SIGKILL after the
  pod's deletion grace period) and then removes the pod object, as a kubelet confirms a
  deletion; a Job deleted with foreground propagation therefore goes away only when its
  pods have really stopped.

What it is not (said here so no test leans on it): an image is a local folder
(`--image-map`, built by cachewarm_testbed.simimages from the image's Dockerfile: its files
under their image paths, its WORKDIR and ENV, and a python holding only what its Dockerfile
installs; the host's tools run for anything but `python`, which an image without one does
not have: the container fails to start, as runc's exec would); pods of unknown images wait
with ErrImageNeverPull; image paths and volume mount paths in arguments, the working
directory and env values are rewritten to local ones (a container sees no /app, but the
folder that stands for it); in the container's own mount namespace each such folder is
overlaid with a writable layer of the container's own (overlayfs, as containerd's
snapshotter does), so what one container writes into its image's files no other container
sees; each volume mount is bound, in the container's own mount
namespace, from the volume's directory or the file or directory its subPath names (a
missing one made a directory), read-only where the mount is readOnly, so the container
cannot write there while the pod's other containers can (subPathExpr is refused); a
projected serviceAccountToken volume gets a token the apiserver issues for the pod
(TokenRequest with the volume's audience and expiry, bound to the Pod, as a kubelet asks for
it; never refreshed, since pods here live minutes); a configMap volume gets the ConfigMap's
keys (or its items) as files, once, at the pod's start (project_configmaps); the other projected sources (the CA
bundle and namespace of the automounted kube-api-access volume) are left out, which no
test reads; every pod shares the
host's network (pod IPs are loopback addresses, so two pods cannot listen on one port, and a
server listening on all addresses, like JAX's coordinator, answers on every pod IP: the
testbed proves that a pod's name resolves, not which pod answers);
JAX runs on the CPU where a GPU or TPU would be; pods get no KUBERNETES_SERVICE_* env and no
automounted ServiceAccount token (nothing in a pod can reach the apiserver); containers are not restarted
(restartPolicy is treated as Never); no probes run (a pod with a readinessProbe never turns
Ready); resource limits are not enforced.

Where it is still used, and why not the real node (cachewarm_testbed.realnode): the
session's `node_agent` fixture (tests/conftest.py) serves tests/e2e/test_accelerator_pools.py,
test_warmup.py and test_node_agent.py, and `make dev-up` and
`demo/run.py --simulated` start it too. They need what one real kubelet cannot give: many
nodes at once, GKE-shaped, with `nvidia.com/gpu` and `google.com/tpu` capacity and TPU
topologies (a kubelet reports only the devices it has, and only one real node runs per
machine), and no root. What a user's first cluster install does (images from our
Dockerfiles, `kubectl apply -k manifests/`, the webhook through its Service, the warmer's
init container, the kubelet's termination message) is proven on the real node:
tests/e2e/test_real_install.py and `make demo`.

Run: python -m cachewarm_testbed.nodeagent --kubeconfig K --workdir D --image-map JSON --nodes JSON
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from cachewarm_testbed.nodes import NodeSpec, node_object, node_status

MESSAGE_LIMIT = 4096  # kubelet: at most 4096 bytes of a container's termination message
FALLBACK_LINES = 80  # kubelet: FallbackToLogsOnError takes at most 80 lines or 2048 bytes
FALLBACK_BYTES = 2048
TERMINATION_LOG = "/dev/termination-log"
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")  # what runc puts in a container's /dev
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
KUBELET_VERSION = "v0.0.0-cachewarm-testbed"
HEARTBEAT_SECONDS = 10.0
START_ERROR_CODE = 128  # containerd: a container whose process could not be started


def _rewrite(value: str, rewrites: dict[str, str]) -> str:
    """`value` with a leading container path (an argument, an env value) made the local one."""
    for path, local in sorted(rewrites.items(), key=lambda kv: -len(kv[0])):
        if value == path or value.startswith(path.rstrip("/") + "/"):
            return local + value[len(path):]
    return value


def _rewrite_list(value: str, rewrites: dict[str, str]) -> str:
    """An env value with each of its ':'-separated parts rewritten (PYTHONPATH, PATH)."""
    return ":".join(_rewrite(part, rewrites) for part in value.split(":"))


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod_ip(namespace: str, name: str) -> str:
    """A loopback address for the pod, stable for its name (127.64.0.0/10, unused elsewhere)."""
    digest = hashlib.sha256(f"{namespace}/{name}".encode()).digest()
    return f"127.{64 + digest[0] % 64}.{digest[1]}.{max(1, digest[2] % 255)}"


class ContainerConfigError(Exception):
    """What a kubelet reports as CreateContainerConfigError."""


class Agent:
    def __init__(self, workdir: Path, images: dict[str, dict[str, Any]], nodes: list[NodeSpec],
                 node_env: dict[str, str]) -> None:
        self.workdir = workdir
        self.images = images
        self.nodes = {n.name: n for n in nodes}
        self.node_env = node_env
        self.api = client.CoreV1Api()
        self.taken: set[tuple[str, str]] = set()
        self.procs: dict[tuple[str, str], list[subprocess.Popen[bytes]]] = {}
        self.terminating: dict[tuple[str, str], float] = {}  # deleted pods -> when SIGTERM turns to SIGKILL
        self.running: dict[tuple[str, str], Any] = {}  # pods whose containers may be alive: their /etc/hosts is kept
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    # -- nodes ---------------------------------------------------------------------------

    def register_nodes(self) -> None:
        for spec in self.nodes.values():
            body = node_object(spec)
            try:
                self.api.create_node(body)  # type: ignore[arg-type]
            except ApiException as exc:
                if exc.status != 409:
                    raise
                self.api.patch_node(spec.name, {"metadata": {"labels": body["metadata"]["labels"]},
                                                "spec": body["spec"] or {"taints": None}})
            self.heartbeat(spec)

    def heartbeat(self, spec: NodeSpec) -> None:
        self.api.patch_node_status(spec.name, {"status": node_status(spec, now=now(), kubelet_version=KUBELET_VERSION)})

    def heartbeats(self) -> None:
        while not self.stopping.wait(HEARTBEAT_SECONDS):
            for spec in self.nodes.values():
                try:
                    self.heartbeat(spec)
                except Exception as exc:  # noqa: BLE001 - the next beat retries
                    print(f"nodeagent: heartbeat of {spec.name} failed: {exc}", flush=True)

    # -- the pod loop --------------------------------------------------------------------

    def loop(self) -> None:
        while not self.stopping.is_set():
            try:
                listed: list[Any] = self.api.list_pod_for_all_namespaces(field_selector="spec.nodeName!=").items
                pods = [p for p in listed if p.spec.node_name in self.nodes]
            except Exception as exc:  # noqa: BLE001 - keep polling through apiserver hiccups
                print(f"nodeagent: listing pods failed: {exc}", flush=True)
                self.stopping.wait(1.0)
                continue
            present = {(p.metadata.namespace, p.metadata.name): p for p in pods}
            for key, pod in present.items():
                if pod.metadata.deletion_timestamp is not None:
                    self.finalize(key, pod)
                elif key not in self.taken and pod.status.phase not in ("Succeeded", "Failed"):
                    self.taken.add(key)
                    threading.Thread(target=self.run_pod, args=(pod,), daemon=True).start()
            for key in list(self.procs):
                if key not in present:
                    self.kill(key)
            self.update_dns(pods)
            self.stopping.wait(0.5)

    def kill(self, key: tuple[str, str]) -> None:
        with self.lock:
            procs = list(self.procs.get(key, []))
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    def finalize(self, key: tuple[str, str], pod: Any) -> None:
        """A deleted pod, as a kubelet ends it: SIGTERM to its containers, SIGKILL once its
        deletion grace period has passed, then the object is removed (grace period 0)
        when no process of it is left."""
        grace = pod.metadata.deletion_grace_period_seconds
        deadline = self.terminating.setdefault(key, time.monotonic() + (30 if grace is None else grace))
        with self.lock:
            procs = list(self.procs.get(key, []))
        alive = [p for p in procs if p.poll() is None]
        for proc in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL if time.monotonic() >= deadline else signal.SIGTERM)
        if alive:
            return
        with contextlib.suppress(ApiException):
            self.api.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0,
                                           body=client.V1DeleteOptions(grace_period_seconds=0,
                                                                       preconditions=client.V1Preconditions(
                                                                           uid=pod.metadata.uid)))
            print(f"nodeagent: {key[0]}/{key[1]} stopped and removed", flush=True)
        self.terminating.pop(key, None)

    # -- cluster DNS stand-in ------------------------------------------------------------

    def update_dns(self, pods: list[Any]) -> None:
        """Rewrite (in place: the file is bind-mounted) the /etc/hosts of every pod whose
        containers run, with the headless-Service records of its namespace."""
        with self.lock:
            running = dict(self.running)
        if not running:
            return
        namespaces = {ns for ns, _ in running}
        records: dict[str, list[str]] = {ns: [] for ns in namespaces}
        for ns in namespaces:
            try:
                services: list[Any] = self.api.list_namespaced_service(ns).items
            except Exception:  # noqa: BLE001 - keep the old records until the next round
                continue
            for svc in services:
                if svc.spec.cluster_ip != "None" or not svc.spec.selector:
                    continue
                for pod in pods:
                    if (pod.metadata.namespace != ns or pod.spec.subdomain != svc.metadata.name
                            or not pod.spec.hostname or (pod.metadata.namespace, pod.metadata.name) not in running):
                        continue
                    labels = pod.metadata.labels or {}
                    if any(labels.get(k) != v for k, v in svc.spec.selector.items()):
                        continue
                    ready = running[(pod.metadata.namespace, pod.metadata.name)].get("ready", False)
                    if not ready and not svc.spec.publish_not_ready_addresses:
                        continue
                    ip = pod_ip(pod.metadata.namespace, pod.metadata.name)
                    base = f"{pod.spec.hostname}.{svc.metadata.name}"
                    records[ns].append(f"{ip}\t{base} {base}.{ns} {base}.{ns}.svc {base}.{ns}.svc.cluster.local")
        for (ns, name), info in running.items():
            text = info["own"] + "# cluster DNS records (cachewarm testbed)\n" + "".join(
                f"{r}\n" for r in sorted(records.get(ns, [])))
            path: Path = info["hosts"]
            if info.get("text") != text:
                with open(path, "r+") as out:  # in place: containers see the same inode
                    out.truncate(0)
                    out.write(text)
                info["text"] = text

    # -- running a pod -------------------------------------------------------------------

    def status(self, pod: Any, body: dict[str, Any]) -> None:
        self.api.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, {"status": body})

    def run_pod(self, pod: Any) -> None:
        key = (pod.metadata.namespace, pod.metadata.name)
        root = self.workdir / key[0] / key[1]
        shutil.rmtree(root, ignore_errors=True)
        (root / "volumes").mkdir(parents=True)
        node = self.nodes[pod.spec.node_name]
        ip = pod_ip(*key)
        hostname = pod.spec.hostname or pod.metadata.name
        own = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
        own += (f"{ip}\t{hostname}.{pod.spec.subdomain}.{key[0]}.svc.cluster.local\t{hostname}\n"
                if pod.spec.subdomain else f"{ip}\t{hostname}\n")
        hosts = root / "etc-hosts"
        hosts.write_text(own)
        started = now()
        base = {"hostIP": node.address, "podIP": ip, "podIPs": [{"ip": ip}], "startTime": started}
        try:
            missing = [c.image for c in [*(pod.spec.init_containers or []), *pod.spec.containers]
                       if c.image not in self.images]
            if missing:
                self.waiting(pod, base, "ErrImageNeverPull",
                             f'Container image "{missing[0]}" is not present with pull policy of Never')
                return
            try:
                self.project_tokens(pod, root)
                self.project_configmaps(pod, root)
            except ContainerConfigError as exc:
                self.waiting(pod, base, "ContainerCreating", f"MountVolume.SetUp failed: {exc}")
                return
            try:
                plans = {c.name: self.plan(pod, c, root, hostname) for c in
                         [*(pod.spec.init_containers or []), *pod.spec.containers]}
            except ContainerConfigError as exc:
                self.waiting(pod, base, "CreateContainerConfigError", str(exc))
                return
            with self.lock:
                self.running[key] = {"hosts": hosts, "own": own, "ready": False}
            self.status(pod, {**base, "phase": "Pending", "conditions": [
                {"type": "PodReadyToStartContainers", "status": "True", "lastTransitionTime": started},
                {"type": "Initialized", "status": "False", "reason": "ContainersNotInitialized",
                 "lastTransitionTime": started}]})
            for init in pod.spec.init_containers or []:
                code, message = self.run_container(key, plans[init.name], init)
                if code != 0:
                    self.finish(pod, base, [], f"init container {init.name} exited {code}",
                                init_state=self.terminated(init, code, message, started))
                    return
            ready = not any(c.readiness_probe for c in pod.spec.containers)
            t0 = now()
            with self.lock:
                self.running[key]["ready"] = ready
            self.status(pod, {**base, "phase": "Running", "conditions": self.conditions(t0, ready),
                              "containerStatuses": [
                                  {"name": c.name, "image": c.image, "imageID": "", "ready": ready, "restartCount": 0,
                                   "started": True, "state": {"running": {"startedAt": t0}}}
                                  for c in pod.spec.containers]})
            results: dict[str, tuple[int, str]] = {}
            threads = [threading.Thread(target=lambda c=c: results.__setitem__(
                c.name, self.run_container(key, plans[c.name], c))) for c in pod.spec.containers]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            states = [self.terminated(c, *results[c.name], t0) for c in pod.spec.containers]
            failed = any(code != 0 for code, _ in results.values())
            self.finish(pod, base, states, "", phase="Failed" if failed else "Succeeded")
        except Exception as exc:  # noqa: BLE001 - report, do not die
            print(f"nodeagent: running {key[0]}/{key[1]} failed: {exc!r}", flush=True)
            with contextlib.suppress(Exception):
                self.finish(pod, base, [], f"node agent error: {exc}")
        finally:
            with self.lock:
                self.running.pop(key, None)

    @staticmethod
    def conditions(at: str, ready: bool) -> list[dict[str, Any]]:
        flag = "True" if ready else "False"
        return [{"type": t, "status": s, "lastTransitionTime": at} for t, s in (
            ("PodReadyToStartContainers", "True"), ("Initialized", "True"), ("ContainersReady", flag),
            ("Ready", flag))]

    @staticmethod
    def terminated(container: Any, code: int, message: str, started: str) -> dict[str, Any]:
        reason = "Completed" if code == 0 else "StartError" if code == START_ERROR_CODE else "Error"
        term: dict[str, Any] = {"exitCode": code, "reason": reason,
                                "startedAt": started, "finishedAt": now()}
        if message:
            term["message"] = message
        return {"name": container.name, "image": container.image, "imageID": "", "ready": False,
                "restartCount": 0, "started": False, "state": {"terminated": term}}

    def waiting(self, pod: Any, base: dict[str, Any], reason: str, message: str) -> None:
        print(f"nodeagent: {pod.metadata.namespace}/{pod.metadata.name} waits: {reason}: {message}", flush=True)
        self.status(pod, {**base, "phase": "Pending", "containerStatuses": [
            {"name": c.name, "image": c.image, "imageID": "", "ready": False, "restartCount": 0,
             "state": {"waiting": {"reason": reason, "message": message}}} for c in pod.spec.containers]})

    def finish(self, pod: Any, base: dict[str, Any], states: list[dict[str, Any]], message: str,
               phase: str = "Failed", init_state: dict[str, Any] | None = None) -> None:
        body: dict[str, Any] = {**base, "phase": phase, "containerStatuses": states,
                                "conditions": self.conditions(now(), False)}
        if init_state is not None:
            body["initContainerStatuses"] = [init_state]
        if message:
            body["message"] = message
        self.status(pod, body)
        print(f"nodeagent: {pod.metadata.namespace}/{pod.metadata.name} {phase} on {pod.spec.node_name}", flush=True)

    # -- one container -------------------------------------------------------------------

    def project_configmaps(self, pod: Any, root: Path) -> None:
        """Write each configMap volume's keys (data as UTF-8, binaryData as its bytes), or
        its `items` (key -> path), as files of the volume's directory, as a kubelet does
        before it starts the containers (read-only to them where their mounts say so; the
        kubelet's later updates of a changed ConfigMap are not made: pods here live
        minutes). Raises ContainerConfigError for a ConfigMap missing and not optional, or
        an item naming a key it lacks (what a kubelet reports as a failed mount)."""
        for volume in pod.spec.volumes or []:
            source = volume.config_map
            if source is None:
                continue
            try:
                cm = self.api.read_namespaced_config_map(source.name, pod.metadata.namespace)
            except ApiException as exc:
                if exc.status == 404 and source.optional:
                    continue
                raise ContainerConfigError(f'volume {volume.name}: configmap "{source.name}" not found') from exc
            files = {k: v.encode() for k, v in (cm.data or {}).items()}
            files |= {k: base64.b64decode(v) for k, v in (cm.binary_data or {}).items()}
            items = {item.key: item.path for item in source.items or []} or {k: k for k in files}
            for key, rel in items.items():
                if key not in files:
                    if source.optional:
                        continue
                    raise ContainerConfigError(f'volume {volume.name}: configmap "{source.name}" has no key {key}')
                if rel.startswith("/") or ".." in Path(rel).parts:
                    raise ContainerConfigError(f"volume {volume.name}: item path {rel!r} must be relative")
                path = root / "volumes" / volume.name / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(files[key])
                path.chmod(source.default_mode if source.default_mode is not None else 0o644)

    def project_tokens(self, pod: Any, root: Path) -> None:
        """Write each projected serviceAccountToken the pod's volumes ask for, from the
        TokenRequest API, bound to this pod (what the kubelet does before it starts the
        containers). Raises ContainerConfigError (a token the apiserver would not issue)."""
        for volume in pod.spec.volumes or []:
            if volume.projected is None:
                continue
            for source in volume.projected.sources or []:
                token = source.service_account_token
                if token is None:
                    continue  # configMap / downwardAPI sources: not written (see the module docstring)
                request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
                    audiences=[token.audience] if token.audience else [],
                    expiration_seconds=token.expiration_seconds or 3600,
                    bound_object_ref=client.V1BoundObjectReference(
                        kind="Pod", api_version="v1", name=pod.metadata.name, uid=pod.metadata.uid)))
                try:
                    issued = self.api.create_namespaced_service_account_token(
                        pod.spec.service_account_name or "default", pod.metadata.namespace, request)
                except ApiException as exc:
                    raise ContainerConfigError(f"volume {volume.name}: failed to fetch token: {exc.reason}") from exc
                path = root / "volumes" / volume.name / token.path
                path.parent.mkdir(parents=True, exist_ok=True)
                if issued.status is None or not issued.status.token:
                    raise ContainerConfigError(f"volume {volume.name}: the apiserver issued no token")
                path.write_text(issued.status.token)
                path.chmod(0o600)

    def plan(self, pod: Any, container: Any, root: Path, hostname: str) -> dict[str, Any]:
        """How to start one container: its argv, working directory and env (with the
        container paths rewritten to local ones) and its volume mounts. Raises
        ContainerConfigError for what a kubelet would report as CreateContainerConfigError."""
        if (container.termination_message_path or TERMINATION_LOG) != TERMINATION_LOG:
            raise ContainerConfigError(f"container {container.name}: the node agent supports only "
                                       f"terminationMessagePath {TERMINATION_LOG}")
        image = self.images[container.image]
        rewrites, mounts = self.mount_paths(container, root)
        argv, cwd, start_error = self.argv_of(container, rewrites, root)
        # containerd sets PATH and HOME when the image does not; the kubelet sets HOSTNAME.
        env = {"PATH": DEFAULT_PATH, "HOME": "/root",
               **{k: _rewrite_list(v, rewrites) for k, v in image.get("env", {}).items()},
               "HOSTNAME": hostname, **self.node_env,
               **{k: _rewrite_list(v, rewrites) for k, v in self.env_of(pod, container).items()}}
        return {"argv": argv, "cwd": cwd, "env": env, "root": root, "policy": container.termination_message_policy,
                "mounts": mounts, "start_error": start_error,
                "layers": self.layer_folders(image)}

    def run_container(self, key: tuple[str, str], plan: dict[str, Any], container: Any) -> tuple[int, str]:
        root: Path = plan["root"]
        message_file = root / f"{container.name}.termination-log"
        message_file.write_text("")
        log = root / f"{container.name}.log"
        if plan["start_error"]:
            # What runc answers for an executable the image does not have: the container
            # never runs (containerd's StartError, exit code 128).
            log.write_text(plan["start_error"] + "\n")
            return START_ERROR_CODE, plan["start_error"]
        try:
            binds = self.image_layers(plan["layers"], root / "layers" / container.name)
            binds += self.prepare_mounts(plan["mounts"])
        except ContainerConfigError as exc:
            # A kubelet keeps such a container waiting (CreateContainerConfigError); here it
            # fails to start, which no test tells apart.
            log.write_text(f"{exc}\n")
            return START_ERROR_CODE, str(exc)
        # Private mount and UTS namespaces, set up as a container runtime would: the pod's
        # hostname, our /etc/hosts, and a /dev of the container's own (a tmpfs with the usual
        # device nodes bind-mounted from the host's, and the termination-log file). Nothing
        # on the host changes, so several testbeds can run side by side.
        devices = " ".join(DEVICES)
        setup = (
            'echo "$4" > /proc/sys/kernel/hostname && mount --bind "$1" /etc/hosts '
            '&& mount -t tmpfs -o mode=755,size=64k cachewarm-dev "$5" '
            f'&& for d in {devices}; do touch "$5/$d" && mount --bind "/dev/$d" "$5/$d" || exit 1; done '
            '&& mkdir "$5/pts" "$5/shm" && mount --rbind /dev/pts "$5/pts" && mount -t tmpfs -o mode=1777 shm "$5/shm" '
            '&& ln -s /proc/self/fd "$5/fd" && ln -s fd/0 "$5/stdin" && ln -s fd/1 "$5/stdout" '
            '&& ln -s fd/2 "$5/stderr" && touch "$5/$3" && mount --bind "$2" "$5/$3" '
            f'{binds}&& mount --move "$5" /dev && cd {shlex.quote(str(plan["cwd"]))} && shift 5 && exec "$@"'
        )
        staging = root / f"{container.name}.dev"
        staging.mkdir(exist_ok=True)
        wrapper = ["/usr/bin/unshare", "--mount", "--uts", "--propagation", "private", "--", "/bin/sh", "-c", setup,
                   "sh", str(root / "etc-hosts"), str(message_file), Path(TERMINATION_LOG).name,
                   plan["env"]["HOSTNAME"], str(staging), *plan["argv"]]
        with open(log, "ab") as out:
            proc = subprocess.Popen(wrapper, cwd=plan["cwd"], env=plan["env"], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            with self.lock:
                self.procs.setdefault(key, []).append(proc)
            code = proc.wait()
        with self.lock:
            self.procs[key].remove(proc)
            if not self.procs[key]:
                del self.procs[key]
        message = message_file.read_bytes()[:MESSAGE_LIMIT].decode(errors="replace")
        if not message and code != 0 and plan["policy"] == "FallbackToLogsOnError":
            lines = log.read_bytes().decode(errors="replace").splitlines()[-FALLBACK_LINES:]
            message = "\n".join(lines).encode()[-FALLBACK_BYTES:].decode(errors="replace")
        return code, message

    def env_of(self, pod: Any, container: Any) -> dict[str, str]:
        """The container's env as a kubelet resolves it: envFrom first, then env (later
        entries win). Raises ContainerConfigError for a reference that cannot be resolved."""
        ns = pod.metadata.namespace
        env: dict[str, str] = {}
        for source in container.env_from or []:
            data = (self.configmap(ns, source.config_map_ref.name, source.config_map_ref.optional)
                    if source.config_map_ref else self.secret(ns, source.secret_ref.name, source.secret_ref.optional))
            env.update({f"{source.prefix or ''}{k}": v for k, v in data.items()})
        for var in container.env or []:
            if var.value_from is None:
                env[var.name] = var.value or ""
                continue
            ref = var.value_from
            if ref.field_ref is not None:
                env[var.name] = self.field(pod, ref.field_ref.field_path)
            elif ref.config_map_key_ref is not None or ref.secret_key_ref is not None:
                r = ref.config_map_key_ref or ref.secret_key_ref
                kind, read = ("ConfigMap", self.configmap) if ref.config_map_key_ref else ("Secret", self.secret)
                data = read(ns, r.name, r.optional)
                if r.key not in data and not r.optional:
                    raise ContainerConfigError(f"couldn't find key {r.key} in {kind} {ns}/{r.name}")
                if r.key in data:
                    env[var.name] = data[r.key]
            else:
                raise ContainerConfigError(f"env {var.name}: resourceFieldRef is not supported by the node agent")
        return env

    def configmap(self, ns: str, name: str, optional: bool | None) -> dict[str, str]:
        try:
            return dict(self.api.read_namespaced_config_map(name, ns).data or {})
        except ApiException as exc:
            if exc.status == 404 and optional:
                return {}
            raise ContainerConfigError(f'configmap "{name}" not found') from exc

    def secret(self, ns: str, name: str, optional: bool | None) -> dict[str, str]:
        try:
            data = self.api.read_namespaced_secret(name, ns).data or {}
        except ApiException as exc:
            if exc.status == 404 and optional:
                return {}
            raise ContainerConfigError(f'secret "{name}" not found') from exc
        return {k: base64.b64decode(v).decode() for k, v in data.items()}

    @staticmethod
    def field(pod: Any, path: str) -> str:
        simple = {"metadata.name": pod.metadata.name, "metadata.namespace": pod.metadata.namespace,
                  "metadata.uid": pod.metadata.uid, "spec.nodeName": pod.spec.node_name,
                  "spec.serviceAccountName": pod.spec.service_account_name,
                  "status.podIP": pod_ip(pod.metadata.namespace, pod.metadata.name)}
        if path in simple:
            return str(simple[path] or "")
        for prefix, values in (("metadata.annotations", pod.metadata.annotations),
                               ("metadata.labels", pod.metadata.labels)):
            if path.startswith(f"{prefix}['") and path.endswith("']"):
                return str((values or {}).get(path[len(prefix) + 2:-2], ""))
        raise ContainerConfigError(f"fieldRef {path} is not supported by the node agent")

    def mount_paths(self, container: Any, root: Path) -> tuple[dict[str, str], list[dict[str, Any]]]:
        """Where the container's paths are here: the image's own files (its folder, shared
        by every container of the image), and each volume mount's mount point, a folder
        of the container's own onto which its private mount namespace binds the volume's
        directory, or the file or directory its subPath names, read-only where the mount
        is readOnly (prepare_mounts, at the container's start, as a kubelet prepares
        subPaths). Returns the rewrites and the mounts. Raises ContainerConfigError for a
        subPathExpr (not supported) or a subPath that is not a relative path inside the
        volume."""
        rewrites: dict[str, str] = dict(self.images[container.image].get("paths", {}))
        mounts: list[dict[str, Any]] = []
        for index, mount in enumerate(container.volume_mounts or []):
            if mount.sub_path_expr:
                raise ContainerConfigError(f"volumeMount {mount.name}: subPathExpr is not supported by the node agent")
            sub = mount.sub_path or ""
            if sub.startswith("/") or ".." in Path(sub).parts:
                raise ContainerConfigError(f"volumeMount {mount.name}: subPath {sub!r} must be a relative path "
                                           "inside the volume")
            volume = root / "volumes" / mount.name
            volume.mkdir(parents=True, exist_ok=True)
            point = root / "mounts" / container.name / str(index)
            rewrites[mount.mount_path] = str(point)
            mounts.append({"volume": str(volume), "subPath": sub, "point": str(point),
                           "readOnly": bool(mount.read_only), "name": mount.name})
        return rewrites, mounts

    @staticmethod
    def layer_folders(image: dict[str, Any]) -> list[str]:
        """The image's local folders that get a layer: directories (a path may name a
        file), the outermost only (a layer over a folder covers what is inside it)."""
        folders = sorted({str(Path(p).resolve()) for p in dict(image.get("paths", {})).values() if Path(p).is_dir()})
        return [f for f in folders if not any(Path(f).is_relative_to(o) and f != o for o in folders)]

    @staticmethod
    def image_layers(folders: list[str], layers: Path) -> str:
        """The shell steps that overlay each of the image's folders with a writable layer
        of this container's own under `layers` (upper and work directories, made here):
        the container reads the image's files and writes into its layer, never into the
        folder every container of the image shares."""
        steps = ""
        for index, folder in enumerate(folders):
            upper, work = layers / str(index) / "upper", layers / str(index) / "work"
            upper.mkdir(parents=True, exist_ok=True)
            work.mkdir(parents=True, exist_ok=True)
            lower = shlex.quote(str(Path(folder).resolve()))
            steps += (f"&& mount -t overlay cachewarm-layer -o lowerdir={lower},upperdir={shlex.quote(str(upper))},"
                      f"workdir={shlex.quote(str(work))} {shlex.quote(folder)} ")
        return steps

    @staticmethod
    def prepare_mounts(mounts: list[dict[str, Any]]) -> str:
        """Make each mount's source (a subPath missing in its volume becomes a directory,
        as the kubelet makes it) and mount point (a file for a file), and return the shell
        steps that bind them in the container's mount namespace, remounting read-only
        binds read-only: the container cannot write there, while the volume stays writable
        for the pod's other containers. Raises ContainerConfigError for a subPath that
        leads out of its volume (through a symlink)."""
        steps = ""
        for mount in mounts:
            volume = Path(mount["volume"])
            source = volume / mount["subPath"] if mount["subPath"] else volume
            if mount["subPath"] and not source.exists() and not source.is_symlink():
                source.mkdir(parents=True)
            if not source.resolve().is_relative_to(volume.resolve()):
                raise ContainerConfigError(f"volumeMount {mount['name']}: subPath {mount['subPath']!r} leads out "
                                           "of the volume")
            point = Path(mount["point"])
            point.parent.mkdir(parents=True, exist_ok=True)
            if source.resolve().is_dir():
                point.mkdir(exist_ok=True)
            else:
                point.touch()
            steps += f"&& mount --bind {shlex.quote(str(source.resolve()))} {shlex.quote(str(point))} "
            if mount["readOnly"]:
                steps += f"&& mount -o remount,bind,ro {shlex.quote(str(point))} "
        return steps

    def argv_of(self, container: Any, rewrites: dict[str, str], root: Path) -> tuple[list[str], Path, str]:
        """The container's argv and working directory, rewritten to local paths, and a
        start error ("" if none): `python` where the image has none."""
        image = self.images[container.image]
        argv = [*(container.command or []), *(container.args or [])]
        if not argv:
            raise ContainerConfigError(f"container {container.name} has no command; the node agent cannot run "
                                       "image defaults")
        out = [_rewrite(arg, rewrites) for arg in argv]
        error = ""
        if out[0] in ("python", "python3"):
            if image.get("python"):
                out[0] = image["python"]
            else:
                error = (f'failed to create containerd task: exec: "{out[0]}": executable file not found in $PATH '
                         f"(image {container.image} has no python)")
        workdir = container.working_dir or image.get("workdir") or "/"
        local = _rewrite(workdir, rewrites)
        return out, Path(local) if local != workdir else root, error

    # -- start and stop ------------------------------------------------------------------

    def stop(self, *_: Any) -> None:
        self.stopping.set()
        for key in list(self.procs):
            self.kill(key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--image-map", default="{}", help="JSON: image -> {paths, workdir, python, env} (cachewarm_testbed.simimages)")
    parser.add_argument("--nodes", required=True, help="JSON list of {name, pool, machine, topology, address}")
    parser.add_argument("--node-env", default="{}", help="JSON env every container on these nodes gets")
    args = parser.parse_args()
    config.load_kube_config(args.kubeconfig)  # type: ignore[no-untyped-call]
    nodes = [NodeSpec(**n) for n in json.loads(args.nodes)]
    agent = Agent(args.workdir, json.loads(args.image_map), nodes, json.loads(args.node_env))
    signal.signal(signal.SIGTERM, agent.stop)
    signal.signal(signal.SIGINT, agent.stop)
    try:
        agent.register_nodes()
        threading.Thread(target=agent.heartbeats, daemon=True).start()
        print(f"nodeagent: running pods bound to {', '.join(agent.nodes)}", flush=True)
        agent.loop()
    finally:
        agent.stop()
    sys.exit(0)


if __name__ == "__main__":
    main()
