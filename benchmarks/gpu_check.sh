#!/bin/bash
# The checks for a machine with a CUDA GPU (never in CI): the `gpu` tests, then the GPU benchmark
# (benchmarks/bench_gpu_offload.py) for each context in CTXS while TOTAL seconds last, each context
# writing gpu_offload_<context>.{json,png} and a log under OUT. Run from the repository root:
#
#     OUT=/tmp/gpu CTXS="65536 32768" bash benchmarks/gpu_check.sh
#
# MODES (default offload: partial offload against GPU-only at GPU_KV_GB, with HOST_EXTRA host sequences, the
# accelerator's KV in GPU_KV_DTYPE, auto or fp8; all-host: every sequence's attention on the host, BATCHES
# sequences) picks what runs.
# The offload cells with no host sequences take about 20 s a budget at 64k on an H200 (50 s for three, plus
# 10 s of set-up and 30 s of tests); each host sequence adds its prompt's writes to the CPU store (about
# 80 s per 32k tokens on 16 vCPUs). MODES=all-host takes about 7 minutes for one 64k context: a 64k prompt
# is prefilled and its K, V and tables written to the CPU store (158 s), each batch size copies them
# per sequence (12 GB a sequence) and decodes STEPS + 2 steps, then GPU-only decodes. GPU_RESERVE_GB is
# the memory left for activations beside the "all free" budget (a 64k prefill needs more than 4 GiB). A machine
# without this project's packages takes wheels from .whl/, or the same unpacked into .whl/site.tar.xz
# when the wheels would not fit a size limit on the copy (CONTRIBUTING.md, GPU checks).
T0=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
elif [ -f .whl/site.tar.xz ]; then
  mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl/site.tar.xz && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  lscpu | grep -E 'Model name|^CPU\(s\)|L3'
  free -g
  python3 -c "import numba, numpy, torch; print('numba', numba.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$OUT/gpu_env.log"
# the serve cases need the server's packages (fastapi, uvicorn, ray) on the machine; GPU_TESTS_K="not serve" leaves them out
[ -z "$SKIP_TESTS" ] && timeout 420 python3 -m pytest -p no:cacheprovider tests/test_gpu.py tests/test_paged_attn.py -q \
  -k "${GPU_TESTS_K:-}" 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
for ctx in ${CTXS:-65536}; do
  left=$(( ${TOTAL:-900} - ($(date +%s) - T0) ))
  [ $left -lt 60 ] && { echo "no time left for context $ctx"; break; }
  echo "== context $ctx, $left s left"
  timeout $left python3 -m benchmarks.bench_gpu_offload --context $ctx --batch ${BATCHES:-4 8} --steps ${STEPS:-8} \
    --modes ${MODES:-offload} --gpu-kv-gb ${GPU_KV_GB:-24 48 0} --host-extra ${HOST_EXTRA:-0} \
    --gpu-kv-dtype ${GPU_KV_DTYPE:-fp8} --gpu-reserve-gb ${GPU_RESERVE_GB:-20} \
    --out "$OUT/gpu_offload_$ctx.json" 2>&1 | grep -v '%|' | tee "$OUT/gpu_offload_$ctx.log"
  rc=${PIPESTATUS[0]}  # 137: killed, most often for host memory (64k at batch 8 needs more than 125 GiB)
  [ $rc -ne 0 ] && echo "context $ctx: the benchmark exited with status $rc" | tee -a "$OUT/gpu_offload_$ctx.log"
done
echo "done in $(( $(date +%s) - T0 )) s"
