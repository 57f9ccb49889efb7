#!/bin/bash
# #13's (b) and (a) on the 2-core Zen 4 EPYC (lscpu "AMD EPYC", family 25 model 17) at the
# commit in commit.txt (gemm_bf16 stealing work; kernels built by GCC whatever CC says): the
# same servers and options as epyc-acceptance-13c and -13d, a day later, written here.
OUT=$(cd "$(dirname "$0")" && pwd) exec bash "$(dirname "$0")/../epyc-acceptance-13c/run.sh"
