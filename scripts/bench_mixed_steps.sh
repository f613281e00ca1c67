#!/usr/bin/env bash
# Issue 21's rate sweep: one server at a time on the SmolLM2-135M shape (dummy weights), driven by
# scripts/bench_serving.py at 0.5, 1 and 2 requests/s; reports TPOT p50/p99, TTFT p50 and, from
# /metrics, the steps by kind and the share of token slots that held real tokens. Give a checkout
# (e.g. a git worktree of an older commit) to measure that tree with the same client.
#
#   scripts/bench_mixed_steps.sh [CHECKOUT] [LABEL] [extra bench_serving.py flags...]
#   git worktree add /tmp/before 01842d1 && scripts/bench_mixed_steps.sh /tmp/before before
#   SERVER_ARGS="--num-scheduler-steps 4" scripts/bench_mixed_steps.sh . multi4 --request-rate 1
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
TREE=$(cd "${1:-$HERE}" && pwd)
LABEL=${2:-$(git -C "$TREE" rev-parse --short HEAD)}
shift $(( $# > 2 ? 2 : $# ))
PORT=${PORT:-8141}
OUT="$HERE/out/mixed-steps-$LABEL"
mkdir -p "$HERE/out"
(cd "$TREE" && PYTHONPATH="$TREE" exec python -m jaxserve.serve --config configs/smollm2-135m-dummy.yaml \
  --port "$PORT" --no-access-log ${SERVER_ARGS:-}) > "$OUT.log" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true; wait 2>/dev/null || true' EXIT
for _ in $(seq 1 1800); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 $PID 2> /dev/null || { echo "server exited; see $OUT.log"; exit 1; }
  sleep 1
done
python "$HERE/scripts/bench_serving.py" --base-url "http://127.0.0.1:$PORT" --label "$LABEL" \
  --num-prompts 24 --input-len 128 --input-len-range 0.5 --output-len 128 --output-len-range 0.5 \
  --request-rate 0.5,1,2 --result-json "$OUT.json" "$@"
