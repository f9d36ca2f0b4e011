"""Subcommands of the ``kvgate`` CLI, one module each with ``add_arguments(parser)`` and
``run(args) -> int`` (the exit status)."""

import argparse


def port(text: str) -> int:
    """An argparse ``type`` for a TCP port: 0 (a free one) to 65535. Without it ``--port 99999``
    was bound as 34463 (the kernel takes it modulo 65536) by ``kvgate serve`` and was a
    ``bind()`` traceback in ``kvgate up``."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a port number") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{n} is not a port (0 to 65535; 0 picks a free one)")
    return n
