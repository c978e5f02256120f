"""The ``kvfabric`` command line: one entry point, one subcommand per component."""
