"""Pure render functions: a KVCachePool model in, Kubernetes manifests (plain dicts) out.

Nothing here does I/O; :mod:`kvfabric.operator.reconcile` applies what these functions return.
"""

from kvfabric.operator.render.children import ConfigError, RenderedChildren, render_children
from kvfabric.operator.render.connection import ConnectionSettings, connection_settings

__all__ = ["ConfigError", "ConnectionSettings", "RenderedChildren", "connection_settings", "render_children"]
