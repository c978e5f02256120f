"""The one-command demo: the whole fabric on the local cluster."""
