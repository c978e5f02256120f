"""kind without an image registry: an offline node image and the engine kind runs in.

kind's own builders pull from Docker Hub, GitHub, dl.k8s.io and registry.k8s.io. Here the node
image is assembled the way kind's builder does, from the local Debian image, Debian's packages, the
Go module proxy and kind's own module zip (:mod:`kvfabric.kind.nodeimage`), in a private Docker
engine of its own (:mod:`kvfabric.kind.engine`); ``e2e/kind/up.sh`` then runs stock
``kind create cluster`` on it with ``KIND_NODE_IMAGE``.
"""
