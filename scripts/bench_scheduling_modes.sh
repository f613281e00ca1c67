#!/usr/bin/env bash
# Rate sweep of two servers that differ only in scheduling (continuous vs static batching), from one
# run: both are started (the second reuses the first's compiled shapes through the persistent
# cache), then scripts/bench_serving.py drives them in turn at each rate and plots both.
#
#   scripts/bench_scheduling_modes.sh [CONFIG] [OUT_PREFIX] [extra bench_serving.py flags...]
#   scripts/bench_scheduling_modes.sh configs/smollm2-135m-dummy.yaml out/sched --request-rate 1,2,4,inf
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:-configs/smollm2-135m-dummy.yaml}
OUT=${2:-out/scheduling}
shift $(( $# > 2 ? 2 : $# ))
mkdir -p "$(dirname "$OUT")"
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT

start() {  # start MODE PORT
  python -m jaxserve.serve --config "$CONFIG" --scheduling "$1" --port "$2" --no-access-log \
    > "$OUT-$1.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 1800); do
    curl -sf "http://127.0.0.1:$2/health" > /dev/null && return 0
    kill -0 "${PIDS[-1]}" 2> /dev/null || { echo "server ($1) exited; see $OUT-$1.log"; exit 1; }
    sleep 1
  done
  echo "server ($1) not healthy after 30 minutes"; exit 1
}

start continuous 8101
start static 8102
python scripts/bench_serving.py --base-url http://127.0.0.1:8101 --label continuous \
  --base-url http://127.0.0.1:8102 --label static --result-json "$OUT.json" --plot "$OUT.png" "$@"
