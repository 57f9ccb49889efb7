#!/bin/bash
# #13's (b) and (a) on the 2-core Zen 4 EPYC (lscpu "AMD EPYC", family 25 model 17) at the
# commit in commit.txt (the 8-bit KV cache's kernels; the default path as at b4209b5): the
# same servers and options as epyc-acceptance-13c, five hours later, written here.
OUT=$(cd "$(dirname "$0")" && pwd) exec bash "$(dirname "$0")/../epyc-acceptance-13c/run.sh"
