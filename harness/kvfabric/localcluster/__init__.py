"""A real local Kubernetes control plane for development and tests.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok run as plain processes on
loopback, built once from the Go module proxy into a cache outside the repository. kwok stands in for
kubelets: it keeps fake GPU and CPU nodes Ready and walks their pods through their lifecycle.
"""
