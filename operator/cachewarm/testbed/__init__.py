"""Test tooling: a real local control plane (etcd, kube-apiserver, kube-controller-manager)
and a GCS emulator, started on loopback. Used by the pytest fixtures and `make dev-up`.

Nothing here runs in a cluster; the operator itself never imports this package.
"""
