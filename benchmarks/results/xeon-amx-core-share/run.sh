#!/bin/bash
# (d): colocated vs serve (cores shared, the default) vs serve --no-share-cores, alternating rounds
cd /work/main
out=/work/bench/share; mkdir -p $out
.venv/bin/python -m kvrelay serve --mode colocated --port 8210 > $out/server-colocated.log 2>&1 &
.venv/bin/python -m kvrelay serve --port 8220 --worker-base-port 8230 > $out/server-serve.log 2>&1 &
.venv/bin/python -m kvrelay serve --port 8240 --worker-base-port 8250 --no-share-cores > $out/server-fixed.log 2>&1 &
for u in 8210 8220 8240; do for j in $(seq 1 600); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready ${j}s"; done
.venv/bin/python -m kvrelay bench --compare colocated=http://127.0.0.1:8210 serve_shared=http://127.0.0.1:8220 \
   serve_fixed=http://127.0.0.1:8240 --workload mixed --rounds ${ROUNDS:-2} \
   --no-progress --result-dir $out > $out/bench.txt 2>&1
pkill -f 'kvrelay serve'
echo done
