#!/bin/bash
# TTFT of one 8,000-token prompt: colocated vs serve (shm, tcp), alternating, one server up at a time.
cd /work/main
out=/work/bench/long3
for round in 1 2; do
 for spec in "colocated=--mode colocated" "serve_shm=--worker-base-port 8331 --transfer-backend shm"; do
  name=${spec%%=*}; flags=${spec#*=}
  .venv/bin/python -m kvrelay serve --port 8330 --max-model-len 8192 $flags > $out/server-$name.log 2>&1 &
  for i in $(seq 1 240); do curl -sf 127.0.0.1:8330/v1/models >/dev/null 2>&1 && break; sleep 0.5; done
  python3 - $name $round <<'PY'
import json, time, urllib.request, sys, random
def post(body):
    t=time.time(); r=urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:8330/v1/completions", json.dumps(body).encode(), {"content-type":"application/json"}), timeout=600); r.read(); return time.time()-t
rng=random.Random(7)
post({"prompt":[rng.randrange(100,40000) for _ in range(64)],"max_tokens":2})
t=post({"prompt":[rng.randrange(100,40000) for _ in range(8000)],"max_tokens":1})
print(f"round {sys.argv[2]} {sys.argv[1]}: 8000-token prompt, 1 output token: {t:.2f} s", flush=True)
PY
  curl -s 127.0.0.1:8331/metrics | grep -E "^kvrelay_transfer_(bytes|seconds)_total"
  pkill -f "kvrelay serve --port 8330"; sleep 3
 done
done
