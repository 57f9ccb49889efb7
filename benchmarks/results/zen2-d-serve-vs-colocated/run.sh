#!/bin/bash
# (d) only, kvrelay serve (1P+1D, defaults) against colocated, 3 alternated rounds, one
# sitting, both servers up at once, `--settle 5`, on an avx2 Zen 2.
cd "$(dirname "$0")/../../.."
out=benchmarks/results/zen2-d-serve-vs-colocated; mkdir -p $out
lscpu > $out/lscpu.txt; git log --oneline -1 > $out/commit.txt
.venv/bin/python -m kvrelay serve --mode colocated --port 8210 > $out/server-colocated.log 2>&1 &
.venv/bin/python -m kvrelay serve --port 8220 --worker-base-port 8230 > $out/server-serve.log 2>&1 &
for u in 8210 8220; do for j in $(seq 1 120); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
.venv/bin/python -m kvrelay bench --compare colocated=http://127.0.0.1:8210 serve=http://127.0.0.1:8220 \
   --workload mixed --rounds 3 --settle 5 --no-progress --result-dir $out/d > $out/bench-d.txt 2>&1
for p in 8230 8231; do echo "== $p"; curl -s http://127.0.0.1:$p/metrics | grep -E "^kvrelay_(request_finished|transfer|phase_duration_seconds_(count|sum))"; done > $out/worker-metrics-after-d.txt
pkill -f "kvrelay serve --mode colocated --port 8210"; pkill -f "kvrelay serve --port 8220"
