"""Test tooling: a real local control plane (etcd, kube-apiserver, kube-controller-manager)
and a GCS emulator, started on loopback. Used by the pytest fixtures and `make dev-up`.

Nothing here runs in a cluster; the operator never imports this package, and its wheel
and image do not carry it (testbed/pyproject.toml is its own distribution).
"""
