"""The CSI node plugin ``csi.kvfabric.io``: a pool's node-local cache socket for pods without a hostPath.

Pod Security *baseline* forbids hostPath volumes, so engines in such namespaces cannot mount the
cache server's socket directory. This plugin publishes that directory into a pod as a CSI
ephemeral inline volume (which baseline and restricted admit), read-only, and only for pools of the
pod's own namespace. It is the only privileged part of kvfabric: one DaemonSet of the operator's
image per cluster (``manifests/csi``). See docs/security.md, "Same node without a hostPath".
"""
