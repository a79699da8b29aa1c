"""hetserve as a user gets it: a wheel built from this checkout, installed into a fresh venv and run by
that venv's `hetserve` script from a directory outside the checkout, with PYTHONPATH unset.

The new venv sees the project venv's dependencies through a `deps.pth` that names their site-packages
folder. A plain path line in a .pth does not run that folder's own .pth files, so the editable install
of the checkout stays invisible and every hetserve module comes from the wheel. The model cache is the
user's (`~/.cache/hetserve/models`, the CLIs' default), so the GGUF is converted at most once.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
_NOT_IN_WHEEL = {".git", ".venv", ".ci", ".pytest_cache", "build", "benchmarks", "tests", "docs", "deploy"}
"""Top-level folders of the checkout that are no part of the wheel; left out of the build's copy."""
_EVERYWHERE = shutil.ignore_patterns("__pycache__", "*.egg-info")


@dataclass(frozen=True)
class WheelVenv:
    """A fresh venv with the wheel installed, and where and how its commands run."""

    venv: Path
    cwd: Path
    """Working directory of every command: an empty folder outside the checkout."""
    env: dict

    def run(self, *args: str, timeout_s: float) -> subprocess.CompletedProcess:
        """`hetserve ARGS` from the venv's console script; a hang past `timeout_s` fails the test."""
        return subprocess.run([str(self.venv / "bin" / "hetserve"), *args], cwd=self.cwd, env=self.env,
                              capture_output=True, text=True, timeout=timeout_s)

    def python(self, code: str, timeout_s: float = 120) -> str:
        proc = subprocess.run([str(self.venv / "bin" / "python"), "-c", code], cwd=self.cwd, env=self.env,
                              capture_output=True, text=True, timeout=timeout_s)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _copy_sources(dst: Path) -> Path:
    """The checkout less its venv, build outputs and non-package folders: setuptools reuses a stale
    build/lib, which would ship modules the tree no longer has."""
    def ignore(folder: str, names: list[str]) -> set[str]:
        top = _NOT_IN_WHEEL.intersection(names) if Path(folder) == ROOT else set()
        return top | _EVERYWHERE(folder, names)
    return Path(shutil.copytree(ROOT, dst, ignore=ignore))


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> WheelVenv:
    tmp = tmp_path_factory.mktemp("wheel")
    src = _copy_sources(tmp / "src")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                   check=True, timeout=300, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("hetserve-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    subprocess.run([*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps", str(wheel)],
                   check=True, timeout=300, cwd=tmp)
    shutil.rmtree(src)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", purelib],
                               check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    # kernels compiled for this venv's paths are of no use to a later one: keep them out of ~/.cache
    env.update(MPLBACKEND="Agg", NUMBA_CACHE_DIR=str(tmp / "numba"),
               PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    cwd = tmp / "cwd"
    cwd.mkdir()
    return WheelVenv(venv, cwd, env)


def test_modules_and_data_come_from_the_wheel(wheel_venv):
    out = wheel_venv.python(
        "import json, sys, accel_sim, cpu_attn, gpu_model, loadgen, server, hetcore.data as d\n"
        "print(json.dumps({'modules': [m.__file__ for m in (accel_sim, cpu_attn, gpu_model, loadgen, server)],"
        " 'data': [str(p) for p in (d.WIKITEXT2_VALID, d.WIKITEXT2_TEST, d.AZURE_CONV_TRACE)],"
        " 'path': sys.path}))")
    found = json.loads(out)
    venv = str(wheel_venv.venv.resolve())
    for path in found["modules"] + found["data"]:
        assert str(Path(path).resolve()).startswith(venv), path
    assert str(ROOT) not in found["path"]
    assert all(Path(p).stat().st_size > 500_000 for p in found["data"])


def test_sim_validate_and_replay_defaults(wheel_venv, tmp_path):
    out = _ok(wheel_venv.run("sim", "validate", "--json", str(tmp_path / "validate.json"), timeout_s=120))
    assert "rows pass" in out and json.loads((tmp_path / "validate.json").read_text())["rows"]
    out = _ok(wheel_venv.run("sim", "replay", "--limit", "200", "--json", str(tmp_path / "replay.json"), timeout_s=120))
    assert json.loads((tmp_path / "replay.json").read_text())
    assert "AzureLLMInferenceTrace_conv.csv" in (tmp_path / "replay.json").read_text() + out


def test_serve_loadgen_synth_and_sigterm(wheel_venv, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    # Oaken KV with fp32 linears: the thresholds bundled for the default model, and the kernels eval runs next
    cmd = [str(wheel_venv.venv / "bin" / "hetserve"), "serve", "--port", str(port), "--kv-format", "oaken",
           "--cpu-linear-dtype", "float32", "--kv-cache-bytes", "64MiB", "--max-num-seqs", "8",
           "--shutdown-grace-s", "5"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=wheel_venv.cwd, env=wheel_venv.env, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, url, log, timeout_s=240)
        out = tmp_path / "synth"
        _ok(wheel_venv.run("loadgen", "synth", "--endpoint", url, "--num-requests", "4", "--prompt-tokens", "16", "48",
                           "--output-tokens", "4", "8", "--no-progress", "--timeout-s", "60", "--out", str(out),
                           timeout_s=180))
        summary = json.loads((out / "summary.json").read_text())
        assert summary["failed"] == 0 and summary["config"]["text"].endswith("test.txt")
        assert (out / "requests.csv").is_file() and list(out.glob("*.png"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_eval_and_calibrate_read_bundled_text(wheel_venv, tmp_path):
    """Few, short windows. eval's fp32 linears take the Oaken thresholds bundled for the default model;
    with bf16 linears (auto, on CPUs with AVX512-BF16 or AMX) it would first calibrate for minutes."""
    out = _ok(wheel_venv.run("eval", "--num-windows", "2", "--window-tokens", "72", "--prefill-tokens", "64",
                             "--cpu-linear-dtype", "float32", "--json", str(tmp_path / "eval.json"), timeout_s=240))
    assert "tokens of test.txt" in out and json.loads((tmp_path / "eval.json").read_text())["ppl"] > 1
    out = _ok(wheel_venv.run("calibrate", "--num-windows", "2", "--window-tokens", "128",
                             "--out", str(tmp_path / "cal.json"), timeout_s=240))
    assert "of valid.txt" in out and json.loads((tmp_path / "cal.json").read_text())


@pytest.mark.slow
def test_eval_and_calibrate_full_defaults(wheel_venv, tmp_path):
    """Every default but where calibrate writes (it would replace the model cache's thresholds). Where the
    thresholds for eval's linear dtype are missing, eval first calibrates them into the model cache from
    the bundled WikiText-2 valid, as serving does."""
    out = _ok(wheel_venv.run("eval", "--json", str(tmp_path / "eval.json"), timeout_s=3600))
    assert "20 windows x 512 tokens of test.txt" in out
    out = _ok(wheel_venv.run("calibrate", "--out", str(tmp_path / "cal.json"), timeout_s=3600))
    assert "100 windows x 512 tokens of valid.txt" in out and (tmp_path / "cal.json").is_file()
