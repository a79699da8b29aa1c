"""Build llama.cpp's `llama-server` once, from the llama-cpp-python sdist (which vendors llama.cpp).

The sdist is the only thing fetched (from PyPI, with pip, once); later runs reuse the binary:

    ~/.cache/hetserve/llama.cpp/
        llama_cpp_python-X.Y.Z.tar.gz
        llama_cpp_python-X.Y.Z/vendor/llama.cpp/build/bin/llama-server
"""
from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

CACHE_DIR = Path.home() / ".cache" / "hetserve" / "llama.cpp"


def find_llama_server(cache_dir: Path = CACHE_DIR) -> Path | None:
    found = sorted(cache_dir.glob("llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server"))
    return found[-1] if found else None


def build_llama_server(cache_dir: Path = CACHE_DIR, jobs: int = 2) -> Path:
    """Path of a built llama-server; downloads the sdist and builds (about 10 min on 2 cores) if there is none."""
    exe = find_llama_server(cache_dir)
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
                    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON"], check=True)
    subprocess.run([*nice, "cmake", "--build", str(src / "build"), "--target", "llama-server", "-j", str(jobs)],
                   check=True)
    exe = find_llama_server(cache_dir)
    assert exe is not None, "the build finished without a llama-server binary"
    return exe


if __name__ == "__main__":
    print(build_llama_server())
