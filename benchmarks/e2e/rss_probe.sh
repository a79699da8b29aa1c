#!/usr/bin/env bash
# Resident memory of a hetserve server through a long-prompt run: RSS every 2 s, peak (VmHWM) and after
# each round. The server is started here with the given env (e.g. MALLOC_ARENA_MAX=2) and serve flags.
#   ROUNDS=2 benchmarks/e2e/rss_probe.sh [ENV=VALUE ...] -- --kv-format oaken --attention magicpig
# Defaults: 4 requests of 3840 prompt + 64 output tokens at once, --max-num-seqs 4, 4k context.
# With --executor ray the Ray actors' RSS is logged too (rss.log) and each actor's peak printed per round.
set -euo pipefail
cd "$(dirname "$0")/../.."
envs=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done; [ $# -gt 0 ] && shift
PORT=${PORT:-8017}; OUT=${OUT:-/tmp/hetserve_rss_probe}; mkdir -p "$OUT"; : > "$OUT/actors.log"
env "${envs[@]}" .venv/bin/hetserve serve --port "$PORT" --log-level warning --max-num-seqs 4 \
    --kv-cache-bytes 1536MiB --max-model-len 4096 "$@" > "$OUT/server.log" 2>&1 &
PID=$!; trap 'kill $PID 2>/dev/null' EXIT
for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
echo "idle: $(grep -E 'VmRSS' /proc/$PID/status)"
for round in $(seq 1 "${ROUNDS:-1}"); do
  .venv/bin/hetserve loadgen synth --endpoint "http://127.0.0.1:$PORT" --num-requests 4 --rate inf \
      --prompt-dist fixed --prompt-tokens 3840 3840 --output-dist fixed --output-tokens 64 64 --max-concurrency 4 \
      --out "$OUT/loadgen" --no-plots --no-progress --seed 0 > "$OUT/loadgen.log" 2>&1 &
  LG=$!
  while kill -0 $LG 2>/dev/null; do
    echo "$(date +%T) $(grep VmRSS /proc/$PID/status)" >> "$OUT/rss.log"
    ps -eo pid=,rss=,args= | awk -v r="$round" '$3 ~ /^ray::(ModelActor|AttentionActor)/ {print r, $1, $2, $3}' >> "$OUT/actors.log"
    sleep 2
  done
  if [ -s "$OUT/actors.log" ]; then
    awk -v r="$round" '$1 == r {if ($3 > m[$2]) {m[$2] = $3; n[$2] = $4}} END {for (p in m) printf "  %s (pid %s) peak %.0f MB\n", n[p], p, m[p] / 1024}' "$OUT/actors.log"
  fi
  echo "round $round: $(grep -E 'Benchmark duration' "$OUT/loadgen.log" | tr -s ' '); after: $(grep VmRSS /proc/$PID/status);" \
       "peak: $(grep VmHWM /proc/$PID/status)"
done
