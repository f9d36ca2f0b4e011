"""Subcommands of the ``kvgate`` CLI, one module each with ``add_arguments(parser)`` and
``run(args) -> int`` (the exit status)."""
