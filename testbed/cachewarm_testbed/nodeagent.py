"""Test tooling: a stand-in kubelet that runs pods as local processes.

This machine has no container runtime, so nothing would ever run the Pods that Jobs
create. The agent registers a Node, binds pending pods it is allowed to run (by label
selector and nodeSelector), runs their init containers and containers one after another
as local processes with the pod's env, and reports phase and container states through
pods/status, so the real Job controller sees them finish. It is clearly not a kubelet:

- an image is a local directory (`--image-map`): the working directory, path rewrites
  for files the image would contain, and which python `python` means; pods with an
  image that is not in the map are never taken;
- volume mount paths in arguments are rewritten to per-pod directories;
- the termination message file is given to the container as $CACHEWARM_SUMMARY_FILE
  (a kubelet mounts /dev/termination-log instead).

Run: python -m cachewarm_testbed.nodeagent --kubeconfig K --workdir D --image-map JSON
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

NODE = "testbed-node"
MESSAGE_LIMIT = 4096


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Agent:
    def __init__(self, workdir: Path, images: dict[str, dict[str, Any]], selector: str, labels: dict[str, str],
                 slots: int) -> None:
        self.workdir = workdir
        self.images = images
        self.selector = selector
        self.labels = labels
        self.api = client.CoreV1Api()
        self.pool = ThreadPoolExecutor(slots)
        self.taken: set[str] = set()
        self.children: set[subprocess.Popen[bytes]] = set()
        self.running: dict[tuple[str, str], subprocess.Popen[bytes]] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def register_node(self) -> None:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {
            "kubernetes.io/hostname": NODE, "kubernetes.io/os": "linux", **self.labels}}}
        try:
            self.api.create_node(node)  # type: ignore[arg-type]
        except ApiException as exc:
            if exc.status != 409:
                raise

    def fits(self, pod: Any) -> bool:
        """Only pods whose every image is mapped to a local directory, whose nodeSelector the
        node satisfies, and that no scheduling gate holds."""
        wanted = pod.spec.node_selector or {}
        images = [c.image for c in [*(pod.spec.init_containers or []), *pod.spec.containers]]
        return (all(image in self.images for image in images)
                and all(self.labels.get(k) == v for k, v in wanted.items())
                and not pod.spec.scheduling_gates)

    def loop(self) -> None:
        while not self.stopping.is_set():
            try:
                pods = self.api.list_pod_for_all_namespaces(label_selector=self.selector,
                                                            field_selector="spec.nodeName=").items
            except Exception as exc:  # noqa: BLE001 - keep polling through apiserver hiccups
                print(f"nodeagent: listing pods failed: {exc}", flush=True)
                pods = []
            pod: Any
            for pod in pods:
                key = f"{pod.metadata.namespace}/{pod.metadata.name}"
                if key in self.taken or not self.fits(pod) or pod.metadata.deletion_timestamp:
                    continue
                self.taken.add(key)
                self.pool.submit(self.run_pod, pod)
            self.reap_deleted()
            self.stopping.wait(0.5)

    def reap_deleted(self) -> None:
        """Like a kubelet, stop the containers of pods that were deleted (e.g. a stale
        warmer Job the operator removed)."""
        with self.lock:
            running = dict(self.running)
        for (ns, name), proc in running.items():
            try:
                pod = self.api.read_namespaced_pod(name, ns)
                gone = pod.metadata is not None and pod.metadata.deletion_timestamp is not None
            except ApiException as exc:
                gone = exc.status == 404
            except Exception:  # noqa: BLE001
                gone = False
            if gone:
                print(f"nodeagent: {ns}/{name} was deleted; stopping it", flush=True)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def bind(self, pod: Any) -> None:
        body = client.V1Binding(metadata=client.V1ObjectMeta(name=pod.metadata.name),
                                target=client.V1ObjectReference(kind="Node", name=NODE))
        self.api.create_namespaced_binding(pod.metadata.namespace, body, _preload_content=False)

    def status(self, pod: Any, body: dict[str, Any]) -> None:
        self.api.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, {"status": body})

    def run_pod(self, pod: Any) -> None:
        name, ns = pod.metadata.name, pod.metadata.namespace
        root = self.workdir / ns / name
        shutil.rmtree(root, ignore_errors=True)
        (root / "volumes").mkdir(parents=True)
        try:
            self.bind(pod)
            started = now()
            self.status(pod, {"phase": "Pending", "startTime": started, "hostIP": "127.0.0.1",
                              "podIP": "127.0.0.1", "conditions": [
                                  {"type": "PodScheduled", "status": "True", "lastTransitionTime": started}]})
            for init in pod.spec.init_containers or []:
                code, _, _ = self.run_container(pod, init, root)
                if code != 0:
                    self.finish(pod, "Failed", [], f"init container {init.name} exited {code}")
                    return
            states = []
            failed = False
            self.status(pod, {"phase": "Running", "containerStatuses": [
                {"name": c.name, "image": c.image, "imageID": "", "ready": True, "restartCount": 0,
                 "state": {"running": {"startedAt": now()}}} for c in pod.spec.containers]})
            for container in pod.spec.containers:
                t0 = now()
                code, message, _ = self.run_container(pod, container, root)
                failed |= code != 0
                states.append({"name": container.name, "image": container.image, "imageID": "", "ready": False,
                               "restartCount": 0, "state": {"terminated": {
                                   "exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                   "message": message, "startedAt": t0, "finishedAt": now()}}})
            self.finish(pod, "Failed" if failed else "Succeeded", states, "")
        except Exception as exc:  # noqa: BLE001 - report, do not die
            print(f"nodeagent: running {ns}/{name} failed: {exc!r}", flush=True)
            try:
                self.finish(pod, "Failed", [], f"node agent error: {exc}")
            except Exception:  # noqa: BLE001
                pass

    def finish(self, pod: Any, phase: str, states: list[dict[str, Any]], message: str) -> None:
        body: dict[str, Any] = {"phase": phase, "containerStatuses": states}
        if message:
            body["message"] = message
        self.status(pod, body)
        print(f"nodeagent: {pod.metadata.namespace}/{pod.metadata.name} {phase}", flush=True)

    def env_of(self, pod: Any, container: Any, summary: Path) -> dict[str, str]:
        env = dict(os.environ)
        for var in container.env or []:
            if var.value is not None:
                env[var.name] = var.value
            elif var.value_from is not None and var.value_from.field_ref is not None:
                env[var.name] = self.field(pod, var.value_from.field_ref.field_path)
            else:
                raise ValueError(f"env {var.name}: only value and fieldRef are supported by the node agent")
        env["CACHEWARM_SUMMARY_FILE"] = str(summary)
        return env

    @staticmethod
    def field(pod: Any, path: str) -> str:
        if path == "metadata.name":
            return str(pod.metadata.name)
        if path == "metadata.namespace":
            return str(pod.metadata.namespace)
        if path.startswith("metadata.annotations['") and path.endswith("']"):
            return str((pod.metadata.annotations or {}).get(path[len("metadata.annotations['"):-2], ""))
        if path.startswith("metadata.labels['") and path.endswith("']"):
            return str((pod.metadata.labels or {}).get(path[len("metadata.labels['"):-2], ""))
        raise ValueError(f"fieldRef {path} is not supported by the node agent")

    def argv_of(self, container: Any, root: Path) -> tuple[list[str], Path]:
        image = self.images.get(container.image, {})
        rewrites: dict[str, str] = dict(image.get("paths", {}))
        for mount in container.volume_mounts or []:
            rewrites[mount.mount_path] = str(root / "volumes" / mount.name)
            (root / "volumes" / mount.name).mkdir(parents=True, exist_ok=True)
        argv = [*(container.command or []), *(container.args or [])]
        if not argv:
            raise ValueError(f"container {container.name} has no command; the node agent cannot run image defaults")
        out = []
        for arg in argv:
            for path, local in sorted(rewrites.items(), key=lambda kv: -len(kv[0])):
                if arg == path or arg.startswith(path.rstrip("/") + "/"):
                    arg = local + arg[len(path):]
                    break
            out.append(arg)
        if out[0] in ("python", "python3") and image.get("python"):
            out[0] = image["python"]
        cwd = Path(image.get("root", root))
        if container.working_dir:
            cwd = Path(rewrites.get(container.working_dir, str(cwd)))
        return out, cwd

    def run_container(self, pod: Any, container: Any, root: Path) -> tuple[int, str, Path]:
        summary = root / f"{container.name}.termination-log"
        log = root / f"{container.name}.log"
        argv, cwd = self.argv_of(container, root)
        env = self.env_of(pod, container, summary)
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            key = (pod.metadata.namespace, pod.metadata.name)
            with self.lock:
                self.children.add(proc)
                self.running[key] = proc
            deadline = pod.spec.active_deadline_seconds
            try:
                code = proc.wait(timeout=deadline)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
            finally:
                with self.lock:
                    self.children.discard(proc)
                    self.running.pop(key, None)
        message = summary.read_text(errors="replace")[:MESSAGE_LIMIT] if summary.exists() else ""
        if not message and code != 0 and container.termination_message_policy == "FallbackToLogsOnError":
            message = "\n".join(log.read_text(errors="replace").splitlines()[-80:])[-MESSAGE_LIMIT:]
        return code, message, log

    def stop(self, *_: Any) -> None:
        self.stopping.set()
        with self.lock:
            for proc in list(self.children):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--image-map", default="{}", help="JSON: image -> {root, paths, python}")
    parser.add_argument("--selector", default="", help="label selector of the pods this agent may run")
    parser.add_argument("--node-labels", default="{}", help="JSON labels of the agent's Node")
    parser.add_argument("--slots", type=int, default=4, help="pods run at once")
    args = parser.parse_args()
    config.load_kube_config(args.kubeconfig)  # type: ignore[no-untyped-call]
    agent = Agent(args.workdir, json.loads(args.image_map), args.selector, json.loads(args.node_labels), args.slots)
    signal.signal(signal.SIGTERM, agent.stop)
    signal.signal(signal.SIGINT, agent.stop)
    agent.register_node()
    print(f"nodeagent: running pods matching {args.selector!r} on node {NODE}", flush=True)
    agent.loop()
    agent.pool.shutdown(wait=False, cancel_futures=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
