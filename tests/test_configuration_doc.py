"""docs/configuration.md is the generated reference of every flag: it must match the parsers."""
from __future__ import annotations

import difflib
from pathlib import Path

from hetserve.reference import render

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_reference_matches_the_parsers():
    path = ROOT / "docs" / "configuration.md"
    expected, found = render(), path.read_text()
    diff = "".join(difflib.unified_diff(found.splitlines(True), expected.splitlines(True), "docs/configuration.md",
                                        "generated", n=1))
    assert found == expected, ("docs/configuration.md is out of date; regenerate it with "
                               f"`python -m hetserve.reference --write docs/configuration.md`:\n{diff[:4000]}")


def test_reference_lists_every_subcommand_and_serve_flag():
    import dataclasses

    from server.config import ServeConfig

    text = render()
    for command in ("serve", "calibrate", "eval", "sim sweep", "sim validate", "sim replay", "sim devices",
                    "loadgen replay", "loadgen synth", "loadgen compare"):
        assert f"`hetserve {command}`" in text, command
    for f in dataclasses.fields(ServeConfig):
        assert f"| `--{f.name.replace('_', '-')}` |" in text, f.name
