"""`hetserve serve`: the daemon's subcommand, registered by hetserve/cli.py as the other packages'
subcommands are (register(sub))."""
from __future__ import annotations

import argparse
from functools import partial

from server.config import add_arguments, from_args


def register(sub) -> None:
    """Add `serve` to the `hetserve` subparsers `sub`. It loads a model, so it sets `run`, not `func`:
    hetserve.cli.main runs it under its one-line model errors."""
    p = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server",
                       description="Start the OpenAI-compatible HTTP server. Options may also come from "
                                   "a YAML file (--config); flags override the file.")
    add_arguments(p)
    p.set_defaults(run=partial(serve_command, p))


def serve_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Serve with the options of `args`; a bad option or config file is a usage error of `parser`."""
    from server.launch import serve

    try:
        cfg = from_args(args)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    serve(cfg)  # sets up its logs itself: level and format are its options
