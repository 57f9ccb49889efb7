#!/bin/bash
# TTFT of the first long prompt after a fresh `kvrelay serve`, new (cwd /work/main) vs base (/work/base), alternated.
for r in 1 2 3; do for t in new base; do
  d=/work/main; [ $t = base ] && d=/work/base
  (cd $d && /work/main/.venv/bin/python -m kvrelay serve --port 8220 --worker-base-port 8230 --log-level debug > /tmp/s/first-$t-$r.log 2>&1 &)
  for j in $(seq 1 120); do curl -sf http://127.0.0.1:8220/v1/models >/dev/null && break; sleep 1; done
  sleep 2
  echo "$r $t ready ${j}s $(/work/main/.venv/bin/python /tmp/hop.py $1 1 2 $t=http://127.0.0.1:8220 | cut -d' ' -f2-)"
  pkill -f "kvrelay serve --port 8220"; sleep 4
done; done
