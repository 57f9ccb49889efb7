#!/bin/bash
# (d): serve with long prefill steps (this change) vs serve 754bbff vs colocated, all up at once
cd /work/main
out=${OUT:-benchmarks/results/epyc-serve-long-steps}; mkdir -p $out
.venv/bin/python -m kvrelay serve --mode colocated --port 8210 > $out/server-colocated.log 2>&1 &
(cd /work/base && /work/main/.venv/bin/python -m kvrelay serve --port 8240 --worker-base-port 8250 > /work/main/$out/server-serve-754bbff.log 2>&1) &
.venv/bin/python -m kvrelay serve --port 8220 --worker-base-port 8230 > $out/server-serve-new.log 2>&1 &
for u in 8210 8240 8220; do for j in $(seq 1 600); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
.venv/bin/python -m kvrelay bench --compare serve_new=http://127.0.0.1:8220 serve_754bbff=http://127.0.0.1:8240 \
   colocated=http://127.0.0.1:8210 --workload mixed --rounds ${ROUNDS:-3} \
   --no-progress --result-dir $out/d > $out/bench-d.txt 2>&1
for p in 8230 8231 8250 8251; do echo "== $p"; curl -s http://127.0.0.1:$p/metrics | grep -E "^kvrelay_engine_yielded|^kvrelay_request_finished" ; done > $out/worker-metrics.txt
pkill -f 'kvrelay serve'
echo done
