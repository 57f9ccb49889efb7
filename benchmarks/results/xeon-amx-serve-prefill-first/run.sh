#!/bin/bash
# (d): serve new (granule + yield) vs serve granule only (ed9d686) vs serve eec43a2 vs colocated
cd /work/main
out=benchmarks/results/xeon-amx-serve-prefill-first; mkdir -p $out
.venv/bin/python -m kvrelay serve --mode colocated --port 8210 > $out/server-colocated.log 2>&1 &
(cd /work/base && /work/main/.venv/bin/python -m kvrelay serve --port 8240 --worker-base-port 8250 > $out/server-serve-base.log 2>&1) &
(cd /work/gran && /work/main/.venv/bin/python -m kvrelay serve --port 8260 --worker-base-port 8270 > $out/server-serve-gran.log 2>&1) &
.venv/bin/python -m kvrelay serve --port 8220 --worker-base-port 8230 > $out/server-serve-new.log 2>&1 &
for u in 8210 8240 8260 8220; do for j in $(seq 1 600); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
.venv/bin/python -m kvrelay bench --compare serve_new=http://127.0.0.1:8220 serve_ed9d686=http://127.0.0.1:8260 \
   serve_eec43a2=http://127.0.0.1:8240 colocated=http://127.0.0.1:8210 --workload mixed --rounds 3 \
   --no-progress --result-dir $out/d > $out/bench-d.txt 2>&1
for p in 8231 8271 8251; do curl -s http://127.0.0.1:$p/metrics | grep -E "^kvrelay_engine_yielded" ; done > $out/yielded.txt
pkill -f 'kvrelay serve'
echo done
