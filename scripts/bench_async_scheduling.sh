#!/usr/bin/env bash
# Issue 22's serving comparison: the shipped default model behind `python -m jaxserve.serve`, one
# server at a time, 32 concurrent streams (scripts/bench_serving.py: 64 requests of 64 prompt and
# 128 output tokens, sent at once), in ROUNDS rounds of three servers each, alternating:
#   off   --no-async-scheduling                  (every step run to completion first)
#   on    --async-scheduling                     (step N+1 dispatched before step N is processed)
#   ms4   --no-async-scheduling --num-scheduler-steps 4
# Reports output tokens/s, TTFT, TPOT p50/p99 and the server's CPU seconds per output token.
# max_num_seqs 32 so that all 32 streams decode together.
#
#   scripts/bench_async_scheduling.sh [ROUNDS]      # JSON per run in out/async-scheduling/
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=${1:-3}
PORT=${PORT:-8142}
OUT="$HERE/out/async-scheduling"
mkdir -p "$OUT"
declare -A FLAGS=([off]="--no-async-scheduling" [on]="--async-scheduling"
                  [ms4]="--no-async-scheduling --num-scheduler-steps 4")
for round in $(seq 1 "$ROUNDS"); do
  for mode in off on ms4; do
    # shellcheck disable=SC2086
    (cd "$HERE" && exec python -m jaxserve.serve --config configs/small.yaml --max-num-seqs 32 \
      --port "$PORT" --no-access-log ${FLAGS[$mode]}) > "$OUT/$mode-$round.log" 2>&1 &
    PID=$!
    for _ in $(seq 1 900); do
      curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
      kill -0 $PID 2> /dev/null || { echo "server exited; see $OUT/$mode-$round.log"; exit 1; }
      sleep 1
    done
    python "$HERE/scripts/bench_serving.py" --base-url "http://127.0.0.1:$PORT" --label "$mode-$round" \
      --num-prompts 64 --input-len 64 --output-len 128 --max-concurrency 32 --request-rate inf --warmup 2 \
      --result-json "$OUT/$mode-$round.json"
    kill $PID; wait $PID 2> /dev/null || true
  done
done
python - "$OUT" "$ROUNDS" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
keys = ("output_throughput", "p50_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "server_cpu_seconds_per_output_token")
print("median [min..max] over rounds")
print(f"{'mode':>5} " + " ".join(f"{k:>36}" for k in keys))
for mode in ("off", "on", "ms4"):
    runs = []
    for r in range(1, rounds + 1):
        data = json.load(open(f"{out}/{mode}-{r}.json"))
        runs.append(data["runs"][f"{mode}-{r}"][0])
    cells = []
    for k in keys:
        vals = [run.get(k) for run in runs]
        if None in vals:
            cells.append("n/a")
            continue
        cells.append(f"{statistics.median(vals):.4g} [{min(vals):.4g}..{max(vals):.4g}]")
    print(f"{mode:>5} " + " ".join(f"{c:>36}" for c in cells))
EOF
