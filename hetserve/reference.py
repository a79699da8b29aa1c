"""docs/configuration.md, generated from the argument parsers every subcommand registers.

    python -m hetserve.reference --write docs/configuration.md

tests/test_configuration_doc.py fails when the file and the parsers disagree, so a new or changed
flag cannot reach main without its line in the reference.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from hetserve.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
"""Where the packages live (a checkout or site-packages): defaults under it are shown relative to it."""

HEADER = """# Configuration reference

Every flag of every `hetserve` command, with its default. Generated from the code by
`python -m hetserve.reference --write docs/configuration.md`; a test fails when the two disagree.
`hetserve serve` also reads the same settings from a YAML file (`--config serve.yaml`): a key is
the flag's name without the leading dashes, with `_` for `-` (`--kv-format oaken` is
`kv_format: oaken`); flags given on the command line override the file.
"""


_TRAILING_DEFAULT = re.compile(r"\s*\(default: ((?:[^()]|\([^()]*\))*)\)$")


def _shown(value) -> str:
    text = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    if text.startswith(str(ROOT)):  # bundled data: the same on every install
        text = text[len(str(ROOT)) + 1:]
    home = str(Path.home())
    if home != "/" and text.startswith(home):
        text = "~" + text[len(home):]
    return text


def _default_and_help(action: argparse.Action) -> tuple[str, str]:
    """(default, meaning) of a flag: a trailing "(default: X)" in its help moves to the default column."""
    help = " ".join((action.help or "").split())
    if "%(" in help:
        help = help % {**vars(action), "default": _shown(action.default)}
    value = action.default
    has_value = not (value is None or value is argparse.SUPPRESS or
                     isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)))
    default = _shown(value) if has_value else ""
    if m := _TRAILING_DEFAULT.search(help):  # serve's flags say theirs in the help
        help, default = help[:m.start()], ("" if m.group(1) == "None" else m.group(1))
    literal = default and " " not in default  # a value, not a description such as "the model's context"
    return (f"`{default}`" if literal else default), help


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}` (positional)"
    names = ", ".join(f"`{o}`" for o in action.option_strings)
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        names += " {" + ", ".join(map(str, action.choices)) + "}"
    return names


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|").replace("%%", "%")


def _command(path: str, parser: argparse.ArgumentParser, out: list[str]) -> None:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    rows = [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
    out += ["", f"{'#' * min(path.count(' ') + 1, 4)} `{path}`", ""]
    if parser.description:
        out += [_cell(parser.description), ""]
    if rows:
        out += ["| flag | default | meaning |", "|---|---|---|"]
        for action in rows:
            default, help = _default_and_help(action)
            out.append(f"| {_flag(action)} | {_cell(default)} | {_cell(help)} |")
    for action in subs:
        helps = {c.dest: c.help for c in action._choices_actions}
        for name, child in action.choices.items():
            if not child.description and helps.get(name):
                child.description = helps[name]
            _command(f"{path} {name}", child, out)


def render() -> str:
    out = [HEADER.rstrip()]
    _command("hetserve", build_parser(), out)
    return "\n".join(out).replace("\n\n\n", "\n\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hetserve.reference", description=__doc__.splitlines()[0])
    ap.add_argument("--write", metavar="PATH", help="write the reference there (default: print it)")
    args = ap.parse_args(argv)
    text = render()
    if args.write:
        Path(args.write).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
