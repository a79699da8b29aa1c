"""Data files shipped inside the package, so an installed wheel needs no checkout beside it.

The defaults of `hetserve calibrate` (WikiText-2 valid), `hetserve eval` and `hetserve loadgen synth`
(WikiText-2 test) and `hetserve sim replay` (the Azure conversation trace) read these. Sources and
licences are in `hetcore/data/NOTICE.md`.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path


def bundled(name: str) -> Path:
    """Path of the bundled data file `name` (a file name in `hetcore/data/`).

    setuptools installs package data as plain files, so the resource is a real path on disk that
    `open`, `np.loadtxt` or a CSV reader can take; a zipped install would not give one, and fails here.
    """
    path = resources.files("hetcore") / "data" / name
    if not isinstance(path, Path):
        raise FileNotFoundError(f"hetcore is not installed as files on disk; cannot give a path for {name}")
    if not path.is_file():
        raise FileNotFoundError(f"no bundled data file {name} in {path.parent}")
    return path


WIKITEXT2_VALID = bundled("valid.txt")
"""WikiText-2 validation split: calibration text (the test split is kept for scoring)."""
WIKITEXT2_TEST = bundled("test.txt")
"""WikiText-2 test split: perplexity scoring and synthetic prompts; it sits beside valid.txt."""
AZURE_CONV_TRACE = bundled("AzureLLMInferenceTrace_conv.csv")
"""Azure LLM inference trace 2023, conversation (TIMESTAMP, ContextTokens, GeneratedTokens)."""
