"""Build llama.cpp's `llama-server` once, from the llama-cpp-python sdist (which vendors llama.cpp).

The sdist is the only thing fetched (from PyPI, with pip, once); later runs reuse the binary:

    ~/.cache/hetserve/llama.cpp/
        llama_cpp_python-X.Y.Z.tar.gz
        llama_cpp_python-X.Y.Z/vendor/llama.cpp/build/bin/llama-server, llama-batched-bench
"""
from __future__ import annotations

import platform
import subprocess
import sys
import tarfile
from pathlib import Path

CACHE_DIR = Path.home() / ".cache" / "hetserve" / "llama.cpp"


NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
"""ggml's AMX matmul (picked by -march=native on Xeons with AMX) dies with SIGSEGV/SIGILL in its worker threads
(llama.cpp issue 20824: no per-thread XTILEDATA request, tile config on the stack); without it ggml uses AVX-512."""

TARGETS = ("llama-server", "llama-batched-bench")
"""The real server, and the decode-speed probe that `benchmarks.e2e.headline` pairs with hetserve's."""


def find_llama_server(cache_dir: Path = CACHE_DIR, target: str = "llama-server") -> Path | None:
    found = sorted(cache_dir.glob(f"llama_cpp_python-*/vendor/llama.cpp/build/bin/{target}"))
    return found[-1] if found else None


def build_llama_server(cache_dir: Path = CACHE_DIR, jobs: int = 2, target: str = "llama-server") -> Path:
    """Path of a built `target` (llama-server or llama-batched-bench); downloads the sdist and builds (about
    10 min on 2 idle cores, 40 on busy ones) if there is none."""
    exe = find_llama_server(cache_dir, target)
    if exe is not None:
        return exe
    cache_dir.mkdir(parents=True, exist_ok=True)
    sdists = sorted(cache_dir.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        print(f"downloading the llama-cpp-python sdist into {cache_dir} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        "llama-cpp-python", "-d", str(cache_dir)], check=True)
        sdists = sorted(cache_dir.glob("llama_cpp_python-*.tar.gz"))
    sdist = sdists[-1]
    src = cache_dir / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    if not src.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(cache_dir, filter="data")
    print(f"building llama-server in {src}/build (nice 10, {jobs} jobs)", flush=True)
    nice = ["nice", "-n", "10"]
    subprocess.run([*nice, "cmake", "-S", str(src), "-B", str(src / "build"), "-G", "Ninja",
                    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON",
                    *([f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"] if platform.machine() == "x86_64" else [])],
                   check=True)
    subprocess.run([*nice, "cmake", "--build", str(src / "build"), "--target", *TARGETS, "-j", str(jobs)],
                   check=True)
    exe = find_llama_server(cache_dir, target)
    assert exe is not None, f"the build finished without {target}"
    return exe


if __name__ == "__main__":
    print(build_llama_server())
