"""CPU side of hetserve: the paged KV store and attention kernels."""
import hashlib
import os
from pathlib import Path

import numba


def numba_cache_dir(sources: Path = Path(__file__).parent) -> Path:
    """Where this package's compiled kernels are cached: $NUMBA_CACHE_DIR (else
    ~/.cache/hetserve/numba) / a hash of the package's sources.

    Numba revalidates a cached kernel by its own file's timestamp only, not by the functions it
    inlines from other modules (sampled.py's kernel inlines oaken/decode.py's decoder): after an
    update that touches oaken/decode.py alone, sampled.py would keep running the old decoder. One directory
    per version of the sources rules that out."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(sources.rglob("*.py")))).hexdigest()[:16]
    base = os.environ.get("NUMBA_CACHE_DIR") or Path.home() / ".cache" / "hetserve" / "numba"
    return Path(base) / digest


numba.config.CACHE_DIR = str(numba_cache_dir())
