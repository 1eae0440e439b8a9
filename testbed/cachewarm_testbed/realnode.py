"""A real node for the testbed: containerd + runc + CNI bridge + kubelet, and its teardown.

The kubelet needs root and changes host state that has fixed paths (cgroups under
`kubepods`, sysctls, iptables chains, /var/lib/kubelet/device-plugins, /var/log/containers),
so only one real node can run per machine: `RealNode.start()` takes an exclusive lock on
LOCK_FILE first, waits a while for another holder to finish, then fails saying who holds
it. Everything else it can place, it places under the testbed's workdir or RUN_DIR.

`stop()` puts the host back as it found it: processes (kubelet, containerd, its shims and
every container), mounts, cgroups, the iptables rules and chains that appeared, sysctls, the
node address on `lo`, the CNI bridge, the pods' conntrack entries, and the paths that did
not exist before. One thing stays: with the nf_tables backend, a table the kubelet touched
keeps its built-in chains, empty with policy ACCEPT; they filter nothing, and the snapshot
counts them as absent (dropping them would take `nft`). `HostSnapshot` is what a test
compares before start and after stop.

Nothing reaches off the machine: the node address is a /32 on `lo`, pods live in POD_CIDR on
a bridge of our own, the CNI config has no ipMasq and routes only the node address and the
Service range, and a FORWARD rule drops pod traffic that would leave by any other interface
(installed before containerd starts). Facts behind the settings: ../shared/TESTBED-NOTES.md,
"A real node".
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import ipaddress
import json
import os
import shlex
import shutil
import subprocess
import tarfile
import time
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from cachewarm_testbed.processes import Proc, StartError, free_port, log_tail, start, wait_until

LOCK_FILE = Path("/run/lock/cachewarm-testbed-realnode.lock")
RUN_DIR = Path("/run/cachewarm-testbed")
# The kubelet's root: a short fixed path, since it holds unix sockets (pod-resources, plugin
# registration) whose paths must fit in 108 bytes, which a pytest tmp_path does not.
KUBELET_ROOT = Path("/var/lib/cachewarm-testbed-kubelet")
# The host snapshot and pids of the running node: a run killed before its teardown (SIGKILL,
# a lost CI job) is undone from this by the next start.
STATE_FILE = RUN_DIR / "state.json"
NODE_NAME = "cachewarm-real-0"
NODE_IP = "10.216.0.1"
POD_CIDR = "10.217.0.0/24"
BRIDGE = "cnicw0"
GUARD_CHAIN = "CACHEWARM-NODE-GUARD"
CNI_BIN_DIR = Path("/usr/lib/cni")
BUSYBOX = Path("/bin/busybox")
PAUSE_IMAGE = "cachewarm.local/pause:1"
BUSYBOX_IMAGE = "cachewarm.local/busybox:1"
# An image with one static program and nothing else: no shell, no C library, no loader (as
# distroless-static or a scratch image): what runs there needs nothing of the image.
BARE_IMAGE = "cachewarm.local/bare:1"
# What the kubelet (or CNI's bridge) writes: restored to the values found before start.
SYSCTLS = (
    "kernel/panic", "kernel/panic_on_oops", "vm/overcommit_memory", "vm/panic_on_oom",
    "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes", "net/ipv4/ip_forward",
    # kube-proxy's: it is configured to leave them alone (conntrack settings 0, no localhost
    # NodePorts), and the snapshot proves it did.
    "net/ipv4/conf/all/route_localnet", "net/netfilter/nf_conntrack_max",
    "net/netfilter/nf_conntrack_tcp_timeout_established", "net/netfilter/nf_conntrack_tcp_timeout_close_wait",
    "net/bridge/bridge-nf-call-iptables",
)
# Host paths the kubelet, containerd, runc or CNI create at fixed places: removed at stop
# when they did not exist at start.
FIXED_PATHS = (
    Path("/var/lib/kubelet"), Path("/var/log/containers"), Path("/var/log/pods"), Path("/run/containerd"),
    Path("/run/runc"), Path("/run/netns"), Path("/var/lib/cni"), RUN_DIR, KUBELET_ROOT,
)
CGROUP_ROOT = Path("/sys/fs/cgroup")
PACKAGES_HINT = "run `make node-deps` (Debian: containerd runc containernetworking-plugins busybox-static iptables)"


def _run(*argv: str, check: bool = True, input: str | None = None,
         timeout: float = 60) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, input=input)
    if check and result.returncode != 0:
        raise StartError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


# -- host state ---------------------------------------------------------------------------

def _iptables_rules(tool: str) -> dict[str, list[str]]:
    """`TABLE` -> its `:CHAIN` declarations and `-A` rules, as iptables-save prints them."""
    if shutil.which(tool) is None:
        return {}
    out = _run(tool, check=False).stdout
    tables: dict[str, list[str]] = {}
    table = ""
    for line in out.splitlines():
        if line.startswith("*"):
            table = line[1:]
            tables.setdefault(table, [])
        elif line.startswith(":"):
            tables[table].append(" ".join(line.split()[:2]))  # ":CHAIN POLICY" without counters
        elif line.startswith("-A "):
            tables[table].append(line)
    # A table that holds only built-in chains with policy ACCEPT and no rule filters nothing:
    # it is what the nf_tables backend leaves once a tool has touched the table (the kubelet
    # does, for its canaries), and the same as no table. Without `nft` it cannot be dropped.
    return {name: lines for name, lines in tables.items()
            if not all(line.startswith(":") and line.endswith(" ACCEPT") for line in lines)}


def _cgroup_dirs() -> list[str]:
    """Every `kubepods*` cgroup directory (any depth), in every hierarchy."""
    found: list[str] = []
    if not CGROUP_ROOT.is_dir():
        return found
    for hierarchy in sorted(CGROUP_ROOT.iterdir()):
        for top in sorted(hierarchy.glob("kubepods*")):
            if top.is_dir():
                found.extend(str(p) for p, _, _ in os.walk(top))
    return found


# Mount points that can be ours: the node's workdir (".../realnode/...") and the fixed
# places of the kubelet, containerd, runc and CNI. Other testbeds on the machine mount
# elsewhere (their node agents' /dev tmpfs), so a snapshot ignores those.
MOUNT_MARKERS = ("/realnode/", str(RUN_DIR), "/run/netns", "/run/containerd", "/run/runc", "/var/lib/kubelet",
                 str(KUBELET_ROOT), "kubepods")


def _mount_points() -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(m in point for m in MOUNT_MARKERS):
            points.append(point)
    return points


def _lo_addresses() -> list[str]:
    out = _run("ip", "-o", "-4", "addr", "show", "dev", "lo", check=False).stdout
    return sorted(line.split()[3] for line in out.splitlines())


def _links() -> list[str]:
    out = _run("ip", "-o", "link", "show", check=False).stdout
    return sorted(line.split(":")[1].strip().split("@")[0] for line in out.splitlines())


def _our_processes(markers: tuple[str, ...]) -> list[tuple[int, str]]:
    """Processes whose command line names one of `markers` (our paths and sockets)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(m in cmdline for m in markers):
            found.append((int(entry.name), cmdline.strip()))
    return sorted(found)


def _pod_flows() -> list[str]:
    """Connection-tracking entries with an address in POD_CIDR (they would otherwise
    outlive the pods until their timeouts)."""
    try:
        lines = Path("/proc/net/nf_conntrack").read_text().splitlines()
    except OSError:
        return []
    net = ipaddress.ip_network(POD_CIDR)
    flows = []
    for line in lines:
        addrs = [w.split("=", 1)[1] for w in line.split() if w.startswith(("src=", "dst="))]
        with contextlib.suppress(ValueError):
            if any(ipaddress.ip_address(a) in net for a in addrs):
                flows.append(" ".join(addrs))
    return sorted(set(flows))


def _read_sysctl(name: str) -> str:
    try:
        return (Path("/proc/sys") / name).read_text().strip()
    except OSError:
        return ""


@dataclass
class HostSnapshot:
    """The host state a real node changes, comparable before start and after stop."""

    mounts: list[str]
    iptables: dict[str, dict[str, list[str]]]
    sysctls: dict[str, str]
    lo_addresses: list[str]
    links: list[str]
    cgroups: list[str]
    paths: dict[str, bool]
    processes: list[tuple[int, str]] = field(default_factory=list)
    pod_flows: list[str] = field(default_factory=list)

    @classmethod
    def take(cls, markers: tuple[str, ...] = (str(RUN_DIR), NODE_NAME, "/realnode/containerd.toml",
                                              "/realnode/kube-proxy.yaml")) -> HostSnapshot:
        return cls(
            mounts=_mount_points(),
            iptables={tool: _iptables_rules(tool) for tool in ("iptables-save", "ip6tables-save")},
            sysctls={name: _read_sysctl(name) for name in SYSCTLS},
            lo_addresses=_lo_addresses(),
            links=_links(),
            cgroups=_cgroup_dirs(),
            paths={str(p): p.exists() for p in FIXED_PATHS},
            processes=_our_processes(markers),
            pod_flows=_pod_flows(),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HostSnapshot:
        """The inverse of dataclasses.asdict (JSON turns the process tuples into lists)."""
        return cls(**{**data, "processes": [(int(pid), str(cmd)) for pid, cmd in data["processes"]]})

    def differences(self, other: HostSnapshot) -> dict[str, Any]:
        """What `other` has that differs from self, field by field (empty when equal)."""
        diff: dict[str, Any] = {}
        for name in ("mounts", "lo_addresses", "links", "cgroups", "processes", "pod_flows"):
            mine, theirs = getattr(self, name), getattr(other, name)
            added = [x for x in theirs if x not in mine]
            removed = [x for x in mine if x not in theirs]
            if added or removed:
                diff[name] = {"added": added, "removed": removed}
        for tool in self.iptables.keys() | other.iptables.keys():
            mine_t, theirs_t = self.iptables.get(tool, {}), other.iptables.get(tool, {})
            for table in mine_t.keys() | theirs_t.keys():
                a, b = mine_t.get(table, []), theirs_t.get(table, [])
                if sorted(a) != sorted(b):
                    diff[f"{tool} {table}"] = {"added": [x for x in b if x not in a],
                                               "removed": [x for x in a if x not in b]}
        for attr in ("sysctls", "paths"):
            mine_d, theirs_d = getattr(self, attr), getattr(other, attr)
            changed = {k: (mine_d.get(k), theirs_d.get(k)) for k in mine_d.keys() | theirs_d.keys()
                       if mine_d.get(k) != theirs_d.get(k)}
            if changed:
                diff[attr] = changed
        return diff


# -- images -------------------------------------------------------------------------------

def _tar_member(tar: tarfile.TarFile, name: str, *, data: bytes | None = None, mode: int = 0o755,
                kind: bytes = tarfile.DIRTYPE, link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime, info.linkname = kind, mode, 0, link
    info.size = len(data) if data is not None else 0
    tar.addfile(info, io.BytesIO(data) if data is not None else None)


def busybox_layer(busybox: bytes, applets: list[str]) -> bytes:
    """An uncompressed layer tar: /bin/busybox, a symlink per applet, the usual empty dirs."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("bin", "dev", "etc", "proc", "sys", "tmp", "var"):
            _tar_member(tar, d, mode=0o1777 if d == "tmp" else 0o755)
        _tar_member(tar, "bin/busybox", data=busybox, kind=tarfile.REGTYPE)
        for applet in sorted(set(applets) - {"busybox"}):
            _tar_member(tar, f"bin/{applet}", kind=tarfile.SYMTYPE, link="busybox", mode=0o777)
    return buf.getvalue()


def oci_archive(name: str, layer: bytes, config: dict[str, Any], out: IO[bytes]) -> None:
    """Write a single-layer OCI image layout tar for image `name` (what `ctr images import`
    reads); the same inputs give the same bytes."""
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> dict[str, Any]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"digest": digest, "size": len(data)}

    layer_desc = {"mediaType": "application/vnd.oci.image.layer.v1.tar", **blob(layer)}
    image_config = {"architecture": "amd64", "os": "linux", "config": config,
                    "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]}}
    config_desc = {"mediaType": "application/vnd.oci.image.config.v1+json",
                   **blob(json.dumps(image_config, sort_keys=True).encode())}
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": config_desc, "layers": [layer_desc]}
    manifest_desc = {"mediaType": "application/vnd.oci.image.manifest.v1+json",
                     **blob(json.dumps(manifest, sort_keys=True).encode()),
                     "annotations": {"io.containerd.image.name": name,
                                     "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]}}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [manifest_desc]}
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _tar_member(tar, "oci-layout", data=b'{"imageLayoutVersion":"1.0.0"}', kind=tarfile.REGTYPE, mode=0o644)
        _tar_member(tar, "index.json", data=json.dumps(index, sort_keys=True).encode(), kind=tarfile.REGTYPE,
                    mode=0o644)
        _tar_member(tar, "blobs", mode=0o755)
        _tar_member(tar, "blobs/sha256", mode=0o755)
        for digest, data in blobs.items():
            _tar_member(tar, f"blobs/sha256/{digest.removeprefix('sha256:')}", data=data,
                        kind=tarfile.REGTYPE, mode=0o644)


def busybox_images(busybox: Path = BUSYBOX) -> dict[str, tuple[bytes, dict[str, Any]]]:
    """The pause and busybox images (name -> layer, image config), both from busybox-static."""
    applets = _run(str(busybox), "--list").stdout.split()
    layer = busybox_layer(busybox.read_bytes(), applets)
    env = ["PATH=/bin"]
    return {
        # A pause container only has to stay alive; PID 1 ignores SIGTERM, so the runtime's
        # SIGKILL ends it.
        PAUSE_IMAGE: (layer, {"Entrypoint": ["/bin/sleep", "2147483647"], "Env": env}),
        BUSYBOX_IMAGE: (layer, {"Cmd": ["/bin/sh"], "Env": env}),
        BARE_IMAGE: (bare_layer(busybox.read_bytes()), {"Entrypoint": ["/sleep", "1"]}),
    }


def bare_layer(busybox: bytes) -> bytes:
    """An uncompressed layer tar with only /sleep (busybox, which runs the applet its file
    is named after) and /tmp: nothing a program of the pod's could borrow."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _tar_member(tar, "tmp", mode=0o1777)
        _tar_member(tar, "sleep", data=busybox, kind=tarfile.REGTYPE)
    return buf.getvalue()


def _index_image_names(archive: Path) -> set[str]:
    """The names `ctr images import` (no --base-name) gives the manifests of an OCI archive's
    index.json by itself: io.containerd.image.name, else org.opencontainers.image.ref.name
    when it is a full reference (a bare tag becomes import-<date>:<tag>, never one of ours)."""
    index: dict[str, Any] = {}
    with tarfile.open(archive) as tar:
        for member in tar:
            if member.isfile() and os.path.normpath(member.name) == "index.json":
                data = tar.extractfile(member)
                index = json.load(data) if data is not None else {}
                break
    names: set[str] = set()
    for manifest in index.get("manifests", []):
        annotations = manifest.get("annotations") or {}
        name = annotations.get("io.containerd.image.name") or annotations.get("org.opencontainers.image.ref.name", "")
        if any(c in name for c in "/:@"):
            names.add(name)
    return names


# -- the node -----------------------------------------------------------------------------

class RealNode:
    """containerd + kubelet registered as NODE_NAME with the testbed's apiserver.

    `kubeconfig` is the admin kubeconfig the kubelet uses (the testbed's authorizer is RBAC
    only, so a Node identity would need the Node authorizer); `workdir` holds configs, logs,
    and containerd's root (the kubelet's is KUBELET_ROOT).
    """

    def __init__(self, workdir: Path, kubeconfig: Path, bin_dir: Path, service_cidr: str) -> None:
        self.workdir = workdir
        self.kubeconfig = kubeconfig
        self.kubelet_bin = bin_dir / "kubelet"
        self.kube_proxy_bin = bin_dir / "kube-proxy"
        self.kubectl_bin = bin_dir / "kubectl"
        self.service_cidr = service_cidr
        self.procs: dict[str, Proc] = {}
        self._lock: IO[str] | None = None
        self.before: HostSnapshot | None = None
        self.socket = RUN_DIR / "containerd" / "containerd.sock"
        self.kubelet_port = 0
        self.timings: dict[str, float] = {}
        self.proxy_health_port = 0
        self.claimed = False
        self.running = False

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    def ctr(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return _run("ctr", f"--address={self.socket}", "-n", "k8s.io", *args, check=check, timeout=timeout)

    # -- start ------------------------------------------------------------------------

    def claim(self, lock_timeout: float = 120.0) -> RealNode:
        """Take the machine for this node before anything else starts: the lock (waiting up
        to `lock_timeout` seconds for another real node on this machine to stop), the host
        snapshot, the node address on `lo` and the FORWARD guard. A control plane that pods
        must reach (the apiserver, the GCS proxy) is then started on NODE_IP.

        Raises StartError naming what failed (a missing package, another real node holding
        the lock, leftovers of an earlier run); whatever was already changed is undone first.
        """
        if self.claimed:
            return self
        self._preflight()
        self._take_lock(lock_timeout)
        try:
            self._undo_killed_run()
            self.before = HostSnapshot.take()
            leftovers = [c for c in self.before.cgroups if c.endswith("kubepods")] + [
                p for p in (str(RUN_DIR), str(KUBELET_ROOT)) if self.before.paths.get(p)]
            if leftovers:
                raise StartError(f"leftovers of an earlier real node that this testbed did not record: "
                                 f"{', '.join(leftovers)} (a kubelet of someone else's, or reboot)")
            self._save_state()
            self._check_ranges_free()
            _run("ip", "addr", "add", f"{NODE_IP}/32", "dev", "lo")
            self._install_guard()
            self.claimed = True
        except BaseException:
            self.stop()
            raise
        return self

    def start(self, lock_timeout: float = 120.0) -> RealNode:
        """Bring the node up (claiming the machine first unless claim() did) and wait until
        the apiserver shows it Ready and kube-proxy has programmed the `kubernetes` Service.

        Raises StartError naming what failed (see claim(), or a process with its log tail);
        whatever was already changed is undone first.
        """
        if self.running:
            return self
        self.claim(lock_timeout)
        try:
            t0 = time.monotonic()
            self._start_containerd()
            self._import_images()
            self.timings["containerd"] = time.monotonic() - t0
            t1 = time.monotonic()
            self._start_kubelet()
            self.timings["kubelet_ready"] = time.monotonic() - t1
            t2 = time.monotonic()
            self._start_kube_proxy()
            self.timings["kube_proxy_synced"] = time.monotonic() - t2
            self.running = True
        except BaseException:
            self.stop()
            raise
        return self

    def _preflight(self) -> None:
        if os.geteuid() != 0:
            raise StartError("the real node needs root (kubelet, containerd, iptables, cgroups)")
        missing = [str(p) for p in (BUSYBOX, CNI_BIN_DIR / "bridge", CNI_BIN_DIR / "host-local",
                                     CNI_BIN_DIR / "loopback") if not p.exists()]
        missing += [tool for tool in ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables", "conntrack",
                                      "iptables-save", "ip") if shutil.which(tool) is None]
        if missing:
            raise StartError(f"the real node needs {', '.join(missing)}: {PACKAGES_HINT}")
        for binary in (self.kubelet_bin, self.kube_proxy_bin):
            if not os.access(binary, os.X_OK):
                raise StartError(f"{binary.name} missing in {binary.parent}: build it with `make bin`")

    def _save_state(self) -> None:
        assert self.before is not None
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        STATE_FILE.write_text(json.dumps({"workdir": str(self.workdir), "before": asdict(self.before),
                                          "pids": {name: proc.pid for name, proc in self.procs.items()}}))

    def _undo_killed_run(self) -> None:
        """A real node whose process died without stop() left STATE_FILE: kill its kubelet
        and containerd (by recorded pid, only if their command line still names its
        workdir) and restore the host to the snapshot it took."""
        if not STATE_FILE.is_file():
            return
        state = json.loads(STATE_FILE.read_text())
        for pid in state["pids"].values():
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                if state["workdir"] in cmdline:
                    os.killpg(int(pid), signal.SIGKILL)
        stale = RealNode(Path(state["workdir"]), self.kubeconfig, self.kubelet_bin.parent, self.service_cidr)
        stale._restore(HostSnapshot.from_dict(state["before"]))

    def _check_ranges_free(self) -> None:
        """Refuse to start when the host already uses the node address or the pod range."""
        ours = [ipaddress.ip_network(f"{NODE_IP}/32"), ipaddress.ip_network(POD_CIDR)]
        routes = _run("ip", "-o", "-4", "route", "show", "table", "all", check=False).stdout.splitlines()
        addrs = _run("ip", "-o", "-4", "addr", "show", check=False).stdout.splitlines()
        used = [line.split()[0] for line in routes if line.split() and line.split()[0][0].isdigit()]
        used += [line.split()[3] for line in addrs]
        for net in used:
            with contextlib.suppress(ValueError):
                theirs = ipaddress.ip_network(net, strict=False)
                if theirs.prefixlen > 0 and any(theirs.overlaps(o) for o in ours):
                    raise StartError(f"{net} is in use on this host and overlaps the real node's "
                                     f"{NODE_IP}/32 or {POD_CIDR}")

    def _take_lock(self, timeout: float) -> None:
        """Hold LOCK_FILE for the node's lifetime; wait up to `timeout` seconds for another
        real node (another checkout's test run, say) to finish first."""
        LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
        lock = open(LOCK_FILE, "a+")
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    lock.seek(0)
                    holder = lock.read().strip() or "unknown"
                    lock.close()
                    raise StartError(
                        f"another real node runs on this machine ({holder}) and did not stop within "
                        f"{timeout:.0f}s; the kubelet uses fixed host paths, so only one can run at a time "
                        f"(lock {LOCK_FILE})") from None
                time.sleep(0.5)
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}, workdir {self.workdir}\n")
        lock.flush()
        self._lock = lock

    def _install_guard(self) -> None:
        """Drop forwarded pod traffic unless it leaves by our bridge (to another pod): a
        packet to a ClusterIP without kube-proxy would otherwise go out of the host."""
        _run("iptables", "-w", "-N", GUARD_CHAIN)
        _run("iptables", "-w", "-A", GUARD_CHAIN, "-s", POD_CIDR, "!", "-o", BRIDGE, "-j", "DROP")
        _run("iptables", "-w", "-I", "FORWARD", "1", "-j", GUARD_CHAIN)

    def _start_containerd(self) -> None:
        root = self.workdir / "containerd"
        state = RUN_DIR / "containerd"
        cni_conf = self.workdir / "cni" / "net.d"
        cni_conf.mkdir(parents=True, exist_ok=True)
        (cni_conf / "10-cachewarm.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "cachewarm-testbed",
            "plugins": [{
                "type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
                "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]],
                         "dataDir": str(self.workdir / "cni" / "ipam"),
                         # Only the node and the Service range: no default route out of the pod.
                         "routes": [{"dst": f"{NODE_IP}/32"}, {"dst": self.service_cidr}]},
            }],
        }, indent=2))
        config = f"""version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{state}/containerd.sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni_conf}"
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{RUN_DIR / 'runc'}"
"""
        path = self.workdir / "containerd.toml"
        path.write_text(config)
        proc = start("containerd", ["containerd", f"--config={path}", "--log-level=info"],
                     self.log_dir / "containerd.log")
        self.procs["containerd"] = proc
        self._save_state()
        wait_until(proc, lambda: self.ctr("version", check=False).returncode == 0, timeout=30,
                   what="answering on its socket")

    def _import_images(self) -> None:
        images_dir = self.workdir / "images"
        images_dir.mkdir(parents=True, exist_ok=True)
        archives = {}
        for name, (layer, config) in busybox_images().items():
            archive = images_dir / (name.rsplit("/", 1)[1].replace(":", "-") + ".tar")
            with open(archive, "wb") as out:
                oci_archive(name, layer, config, out)
            archives[name] = archive
        self.import_images(archives)

    def import_images(self, archives: dict[str, Path]) -> None:
        """Import OCI archives (image ref -> path, e.g. from cachewarm_testbed.images) into
        the node's containerd, under those refs, unpacked. Raises StartError.

        `--index-name ref` only when the archive's index.json does not name a manifest `ref`
        itself (ctr names a manifest by its io.containerd.image.name annotation, as
        oci_archive() writes, else by a full org.opencontainers.image.ref.name, as buildah
        writes). With both, ctr 1.6 records `ref` -> index and then re-points the same record
        at the manifest, releases its import lease, and still unpacks the first record by its
        stale index target: the index is then referenced by nothing, so containerd's GC (a
        pass every ~0.1 s just after boot) can remove it while the layer is applied, and the
        import fails with "content digest <index.json's digest>: not found". It passed only
        when the CRI plugin handled the ImageCreate event before ctr re-pointed the name (its
        image-id record then kept the index); a retry of the same import loses the same way.
        """
        for ref, archive in archives.items():
            name_flags = [] if ref in _index_image_names(archive) else ["--index-name", ref]
            # The torch image (3 GB compressed, 5.4 GB unpacked) takes minutes on this VM's disk.
            result = self.ctr("images", "import", *name_flags, str(archive), check=False, timeout=1200)
            if result.returncode != 0:
                raise StartError(f"ctr images import {archive} failed: {result.stderr.strip()}\n"
                                 f"--- containerd log ---\n{log_tail(self.log_dir / 'containerd.log')}")
            listed = self.ctr("images", "ls", "-q", check=False).stdout.split()
            if ref not in listed:
                raise StartError(f"ctr images import {archive} did not give image {ref} (containerd has {listed})")
            self._name_by_digest(ref)

    def _name_by_digest(self, ref: str) -> None:
        """Name the imported image `<repository>@<its digest>` too, as a pull from a registry
        records it: the kubelet then reports that repository digest as a container's imageID
        (as on a cluster), not the node-local image id an imported image alone gives."""
        rows = [line.split() for line in self.ctr("images", "ls", f"name=={ref}", check=False).stdout.splitlines()[1:]]
        digest = next((row[2] for row in rows if len(row) > 2 and row[0] == ref), "")
        if not digest.startswith("sha256:"):
            raise StartError(f"containerd lists no digest for image {ref}: {rows}")
        last = ref.rsplit("/", 1)[-1]
        repository = ref[: len(ref) - len(last)] + last.split(":", 1)[0]
        tagged = self.ctr("images", "tag", ref, f"{repository}@{digest}", check=False)
        if tagged.returncode != 0 and "already exists" not in tagged.stderr:
            raise StartError(f"ctr images tag {ref} {repository}@{digest} failed: {tagged.stderr.strip()}")

    def _start_kubelet(self) -> None:
        root = KUBELET_ROOT
        root.mkdir(parents=True, exist_ok=True)
        self.kubelet_port = free_port()
        healthz = free_port()
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            # Anonymous + AlwaysAllow on the kubelet's port: bound to the node address only.
            "address": NODE_IP, "port": self.kubelet_port, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": healthz,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False},
                               "x509": {}},
            "authorization": {"mode": "AlwaysAllow"},
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "cgroupDriver": "cgroupfs", "failCgroupV1": False, "failSwapOn": False,
            "podLogsDir": str(self.workdir / "pod-logs"),
            "resolvConf": "", "clusterDNS": [],
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "registerNode": True, "rotateCertificates": False, "serverTLSBootstrap": False,
            "fileCheckFrequency": "1s", "syncFrequency": "5s", "nodeStatusUpdateFrequency": "2s",
        }
        path = self.workdir / "kubelet.yaml"
        path.write_text(yaml.safe_dump(config))
        proc = start("kubelet", [
            str(self.kubelet_bin), f"--config={path}", f"--kubeconfig={self.kubeconfig}",
            f"--root-dir={root}", f"--hostname-override={NODE_NAME}", f"--node-ip={NODE_IP}", "--v=1",
        ], self.log_dir / "kubelet.log")
        self.procs["kubelet"] = proc
        self._save_state()

        def ready() -> bool:
            out = subprocess.run(
                [str(self.kubectl_bin), f"--kubeconfig={self.kubeconfig}", "get", "node", NODE_NAME, "-o",
                 "jsonpath={.status.conditions[?(@.type=='Ready')].status} {.spec.taints[*].key}"],
                capture_output=True, text=True, timeout=30)
            # Ready, and the node-lifecycle controller has taken the not-ready taint off.
            return out.returncode == 0 and out.stdout.split() == ["True"]
        wait_until(proc, ready, timeout=90, what=f"Ready as node {NODE_NAME}")

    def _kube_proxy_config(self) -> Path:
        """kube-proxy in iptables mode, told to leave the host's conntrack sysctls and
        route_localnet alone, serving health and metrics on loopback only."""
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.kubeconfig)},
            "hostnameOverride": NODE_NAME, "bindAddress": NODE_IP, "mode": "iptables",
            "clusterCIDR": POD_CIDR, "nodePortAddresses": [f"{NODE_IP}/32"],
            "healthzBindAddress": f"127.0.0.1:{self.proxy_health_port}",
            "metricsBindAddress": f"127.0.0.1:{free_port()}",
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
            "iptables": {"localhostNodePorts": False, "masqueradeAll": False},
        }
        path = self.workdir / "kube-proxy.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def _start_kube_proxy(self) -> None:
        """Service ClusterIPs for the node's pods and for the host (the apiserver calls the
        webhook through its Service): ready once the `kubernetes` Service is programmed."""
        self.proxy_health_port = free_port()
        path = self._kube_proxy_config()
        proc = start("kube-proxy", [str(self.kube_proxy_bin), f"--config={path}", "--v=1"],
                     self.log_dir / "kube-proxy.log")
        self.procs["kube-proxy"] = proc
        self._save_state()

        def synced() -> bool:
            rules = _run("iptables", "-w", "-t", "nat", "-S", "KUBE-SERVICES", check=False).stdout
            return "default/kubernetes:https cluster IP" in rules
        wait_until(proc, synced, timeout=60, what="syncing the `kubernetes` Service into iptables")

    def _stop_kube_proxy(self) -> None:
        proc = self.procs.pop("kube-proxy", None)
        if proc is None:
            return
        proc.stop(timeout=10)
        # No `kube-proxy --cleanup`: it flushes every IPVS service and KUBE-* chain of the
        # host, ours or not (and loads ip_vs). The snapshot restore removes the rules and
        # chains that appeared since the node started, and only those.

    # -- stop ---------------------------------------------------------------------------

    def drain(self, timeout: float = 60.0) -> None:
        """Cordon the node, force-delete every pod bound to it and wait until containerd
        runs no container: the kubelet stops each sandbox itself (CNI DEL, unmounts)."""
        if "kubelet" not in self.procs or not self.procs["kubelet"].alive():
            return
        kubectl = [str(self.kubectl_bin), f"--kubeconfig={self.kubeconfig}"]
        subprocess.run([*kubectl, "cordon", NODE_NAME], capture_output=True, timeout=30)
        subprocess.run([*kubectl, "delete", "pods", "-A", f"--field-selector=spec.nodeName={NODE_NAME}",
                        "--grace-period=0", "--force", "--wait=false"], capture_output=True, timeout=60)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            tasks = self.ctr("tasks", "ls", "-q", check=False)
            if tasks.returncode == 0 and not tasks.stdout.strip():
                return
            time.sleep(0.5)

    def stop(self) -> None:
        """Undo everything start() did, whatever stage it reached. Safe to call twice."""
        t0 = time.monotonic()
        with contextlib.suppress(Exception):
            self.drain()
        self._stop_kube_proxy()
        for name in ("kubelet", "containerd"):
            if name in self.procs:
                self.procs.pop(name).stop(timeout=10)
        if self.before is not None:
            self._restore(self.before)
            self.before = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        self.claimed = self.running = False
        self.timings["teardown"] = time.monotonic() - t0

    def _restore(self, before: HostSnapshot) -> None:
        """Put back what differs from `before`, once no kubelet or containerd of ours runs."""
        self._kill_leftover_processes(before)
        self._unmount(before)
        self._remove_cgroups(before)
        self._remove_netns(before)
        with contextlib.suppress(Exception):
            if BRIDGE in _links() and BRIDGE not in before.links:
                _run("ip", "link", "del", BRIDGE)
        self._restore_iptables(before)
        if shutil.which("conntrack"):
            for flag in ("-s", "-d"):
                _run("conntrack", "-D", flag, POD_CIDR, check=False)
        for name, value in before.sysctls.items():
            if value and _read_sysctl(name) != value:
                with contextlib.suppress(OSError):
                    (Path("/proc/sys") / name).write_text(value + "\n")
        if f"{NODE_IP}/32" in _lo_addresses() and f"{NODE_IP}/32" not in before.lo_addresses:
            _run("ip", "addr", "del", f"{NODE_IP}/32", "dev", "lo", check=False)
        for path in FIXED_PATHS:
            if not before.paths[str(path)]:
                shutil.rmtree(path, ignore_errors=True)
        # containerd's root (image layers, snapshots) lives in the workdir.
        shutil.rmtree(self.workdir / "containerd", ignore_errors=True)

    def _kill_leftover_processes(self, before: HostSnapshot) -> None:
        """Shims (they daemonize out of containerd's process group) and any container
        process still in a kubepods cgroup."""
        pids = {pid for pid, _ in _our_processes((str(RUN_DIR),))} - {pid for pid, _ in before.processes}
        for cgroup in _cgroup_dirs():
            if cgroup in before.cgroups:
                continue
            with contextlib.suppress(OSError):
                pids |= {int(p) for p in Path(cgroup, "cgroup.procs").read_text().split()}
        pids.discard(os.getpid())
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, 9)
        deadline = time.monotonic() + 10
        while pids and time.monotonic() < deadline:
            pids = {pid for pid in pids if Path(f"/proc/{pid}").exists()
                    and not Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"}
            time.sleep(0.1)

    def _unmount(self, before: HostSnapshot) -> None:
        for _ in range(3):
            new = [m for m in _mount_points() if m not in before.mounts]  # only ours: MOUNT_MARKERS
            if not new:
                return
            for point in sorted(set(new), key=lambda m: m.count("/"), reverse=True):
                if _run("umount", point, check=False).returncode != 0:
                    _run("umount", "-l", point, check=False)

    def _remove_cgroups(self, before: HostSnapshot) -> None:
        for cgroup in sorted(_cgroup_dirs(), key=lambda c: c.count("/"), reverse=True):
            if cgroup not in before.cgroups:
                for _ in range(20):
                    try:
                        os.rmdir(cgroup)
                        break
                    except FileNotFoundError:
                        break
                    except OSError:  # EBUSY while the last task exits
                        time.sleep(0.1)

    def _remove_netns(self, before: HostSnapshot) -> None:
        netns = Path("/run/netns")
        if not netns.is_dir():
            return
        for entry in netns.iterdir():
            if entry.name.startswith("cni-"):
                _run("umount", str(entry), check=False)
                with contextlib.suppress(OSError):
                    entry.unlink()

    def _restore_iptables(self, before: HostSnapshot) -> None:
        """Delete rules that appeared since `before` (jumps first), then the new chains."""
        for save, tool in (("iptables-save", "iptables"), ("ip6tables-save", "ip6tables")):
            if shutil.which(tool) is None:
                continue
            then = before.iptables.get(save, {})
            for table, lines in _iptables_rules(save).items():
                old = then.get(table, [])
                for rule in [line for line in lines if line.startswith("-A ") and line not in old]:
                    _run(tool, "-w", "-t", table, "-D", *shlex.split(rule)[1:], check=False)
                for chain in [line[1:].split()[0] for line in lines if line.startswith(":") and line not in old]:
                    _run(tool, "-w", "-t", table, "-F", chain, check=False)
                    _run(tool, "-w", "-t", table, "-X", chain, check=False)
