"""The ``kvgate`` command. Each subcommand lives in its own module, imported only when chosen, so
``kvgate --help`` is fast and no subcommand drags in another's dependencies (torch stays in
``kvgate backend``'s own process)."""

from __future__ import annotations

import argparse
import importlib
import sys

#: name -> (module, one-line help). A module provides ``add_arguments(parser)`` and ``run(args) -> int``.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.commands.serve", "run the gateway (default 127.0.0.1:8080)"),
    "up": ("gateway.commands.up", "run the embedded stack: bundled backend + gateway, demo tenants"),
    "demo": ("gateway.commands.demo", "run the embedded stack and send real text through it"),
    "backend": ("gateway.commands.backend", "run the bundled engine (python -m gpu_backend)"),
    "model": ("gateway.commands.model", "pull a named model into the state dir, or list them"),
    "tenant": ("gateway.commands.tenant", "add, list and show tenants, set limits, rotate and revoke API keys"),
    "upstream": ("gateway.commands.upstream", "list, quarantine or clear the upstreams' quarantine"),
    "deploy-gate": ("verifier.deploy_gate", "check live KV pools against context length x headroom"),
    "probe": ("verifier.probe", "plant canaries at the live limit and look for them in responses"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: kvgate <command> [options]", "", "kvgate: an edge gateway for LLM inference.", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'kvgate <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvgate`` console script; returns the process exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"kvgate: unknown command '{name}'\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(module_name)
    if hasattr(module, "run_argv"):  # pass-through commands parse their own flags
        return int(module.run_argv(rest) or 0)
    parser = argparse.ArgumentParser(prog=f"kvgate {name}", description=help_)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
