"""``kvgate upstream list`` / ``quarantine NAME`` / ``clear NAME``: show, put or lift an
upstream's quarantine (verifier, docs/verifier.md "What quarantines": kvgate's own planted
canaries quarantine by themselves; any other evidence waits for an operator's ``quarantine``).

The state is where the running gateways read it: Redis when the config has ``redis_url``, else
``<state_dir>/quarantine.json``; gateways pick a change up within a second. Exit status: 0 done,
1 ``clear`` of an upstream that was not quarantined, 2 configuration or store error (or
``quarantine`` of a name that is not an upstream).
"""

from __future__ import annotations

import argparse
import sys
import time

_CONFIG_HELP = "kvgate.yaml (default: KVGATE_CONFIG, else the checkout's config/kvgate.yaml)"


def _tokens(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of tokens") from None
    if n < 0:  # -5 quarantined every prompt
        raise argparse.ArgumentTypeError(f"{n} is below 0")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``list``, ``quarantine NAME`` or ``clear NAME``; ``--config`` picks kvgate.yaml (redis_url,
    state_dir), before the action or after it (as docs/verifier.md writes it)."""
    parser.add_argument("--config", default=None, help=_CONFIG_HELP)
    sub = parser.add_subparsers(dest="action", required=True)
    actions = [sub.add_parser("list", help="show quarantined upstreams")]
    put = sub.add_parser("quarantine", help="quarantine an upstream (an operator's decision after an alert)")
    put.add_argument("name", help="the upstream's name (as in kvgate.yaml)")
    put.add_argument(
        "--min-prompt-tokens", type=_tokens, default=None, help="refuse prompts above this (default: the config's)"
    )
    clear = sub.add_parser("clear", help="lift an upstream's quarantine")
    clear.add_argument("name", help="the upstream's name (as in kvgate.yaml)")
    for action in [*actions, put, clear]:  # absent after the action: the one before it (or none) stays
        action.add_argument("--config", default=argparse.SUPPRESS, help=_CONFIG_HELP)


def run(args: argparse.Namespace) -> int:
    """Entry point; returns the exit status."""
    from config.loader import ConfigError, load_settings
    from verifier.quarantine import Quarantine, backend_for

    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        print(f"kvgate upstream: {e}", file=sys.stderr)
        return 2
    q = Quarantine(backend_for(settings.redis_url, settings.state_dir))
    try:
        if args.action == "list":
            recs = q.backend.load()
            if not recs:
                print("no upstream is quarantined")
            for name, r in sorted(recs.items()):
                since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r.since))
                print(
                    f"{name}: quarantined since {since} for prompts above {r.min_prompt_tokens} tokens "
                    f"(incident {r.incident_id}, detector {r.detector})"
                )
            return 0
        known = {u.name for u in settings.upstreams}
        if args.action == "quarantine":
            return _quarantine(q, args, settings, known)
        if q.clear(args.name):
            print(f"upstream '{args.name}': quarantine cleared")
            return 0
        hint = "" if args.name in known else " (and it is not an upstream of this config)"
        print(f"upstream '{args.name}' is not quarantined{hint}", file=sys.stderr)
        return 1
    except Exception as e:  # store unreachable
        print(f"kvgate upstream: cannot reach the quarantine store: {e}", file=sys.stderr)
        return 2


def _quarantine(q, args: argparse.Namespace, settings, known: set[str]) -> int:
    """``quarantine NAME``: 0 done (or already quarantined), 2 not an upstream of the config."""
    if args.name not in known:
        print(f"kvgate upstream: '{args.name}' is not an upstream of this config", file=sys.stderr)
        return 2
    limit = (
        args.min_prompt_tokens if args.min_prompt_tokens is not None else settings.verifier.quarantine_min_prompt_tokens
    )
    if q.backend.load().get(args.name) is not None:
        print(f"upstream '{args.name}' is already quarantined")
        return 0
    q.put(args.name, "operator", "operator", limit)
    print(f"upstream '{args.name}': quarantined for prompts above {limit} tokens (operator)")
    return 0
