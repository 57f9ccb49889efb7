#!/bin/bash
# wait.sh PORT... : wait until each answers /v1/models (at most 10 min each)
for u in "$@"; do for j in $(seq 1 600); do curl -sf http://127.0.0.1:$u/v1/models >/dev/null && break; sleep 1; done; echo "$u ready after ${j}s"; done
