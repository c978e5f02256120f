"""A stand-in kubelet for fake nodes: runs the pods the real scheduler bound to them as processes.

kwok only pretends pods run. The pod runner really runs them: each pod gets its own network namespace
(loopback only, so two pods may listen on the same port, as in Kubernetes) and a private mount
namespace where every volume is bind-mounted at its ``mountPath``. hostPath volumes map to a
directory per node, PersistentVolumeClaims to one directory every node sees, ConfigMap, Secret and
downward-API volumes to files written from the real objects. It runs each container's command and
args with the environment the pod spec holds (downward-API fields included), runs readiness probes,
restarts exited containers per ``restartPolicy``, reports state through the pod status subresource,
and stops the processes when the pod is deleted. Nothing in it knows about kvfabric.

Needs root (network and mount namespaces), ``ip`` (iproute2), ``unshare`` and ``curl``.
"""
