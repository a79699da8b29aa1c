"""Imports go downwards only: importing a package and every module in it loads no package above it.

    hetcore < cpu_attn < gpu_model < loadgen < accel_sim < server < evaluation < hetserve

Each package is imported in a fresh interpreter, so what another test imported does not count.
Imports inside functions run later, when they are needed, and are not checked here.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

LAYERS = ["hetcore", "cpu_attn", "gpu_model", "loadgen", "accel_sim", "server", "evaluation", "hetserve"]

_IMPORT_ALL = """
import importlib, json, pkgutil, sys
pkg = importlib.import_module({name!r})
for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
    if not info.name.endswith(".__main__"):  # running it is the command, not an import
        importlib.import_module(info.name)
print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}})))
"""


def loaded_by(name: str) -> set[str]:
    """Top-level modules in sys.modules after importing package `name` and all its modules."""
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL.format(name=name)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.splitlines()[-1]))


@pytest.mark.parametrize("i", range(len(LAYERS) - 1), ids=LAYERS[:-1])
def test_a_package_imports_nothing_above_it(i):
    above = set(LAYERS[i + 1:]) & loaded_by(LAYERS[i])
    assert not above, f"{LAYERS[i]} imports {sorted(above)}, which sit above it"


def test_hetcore_needs_no_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, hetcore, hetcore.backend; "
                                                "print('torch' in sys.modules, 'numpy' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
