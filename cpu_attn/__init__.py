"""CPU side of hetserve: the paged KV store and attention kernels."""
import hashlib
import os
from pathlib import Path

import numba


KERNEL_PACKAGES = (Path(__file__).parent, Path(__file__).parent.parent / "gpu_model")
"""The packages whose compiled kernels Numba caches: this one, and gpu_model, whose kernels inline this one's."""


def numba_cache_dir(*sources: Path) -> Path:
    """Where the compiled kernels are cached: $NUMBA_CACHE_DIR (else ~/.cache/hetserve/numba) / a hash of
    the sources of `sources` (default: KERNEL_PACKAGES), subpackages included.

    Numba revalidates a cached kernel by its own file's timestamp only, not by the functions it
    inlines from other modules (sampled.py's kernel inlines oaken/decode.py's decoder; gpu_model/cpu_decode.py's
    inline quant_vnni.py's matmuls): after an update that touches the inlined module alone, the kernel would keep
    running the old code. One directory per version of the sources rules that out."""
    files = sorted(f for package in sources or KERNEL_PACKAGES if package.is_dir() for f in package.rglob("*.py"))
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]
    base = os.environ.get("NUMBA_CACHE_DIR") or Path.home() / ".cache" / "hetserve" / "numba"
    return Path(base) / digest


numba.config.CACHE_DIR = str(numba_cache_dir())
