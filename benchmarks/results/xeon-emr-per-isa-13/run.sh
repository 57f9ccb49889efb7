#!/bin/bash
# #13: every kernel variant this Xeon (lscpu model 207, Emerald Rapids: AVX-512 BF16, AMX) runs, forced
# (--kernels), bf16-stored weights and int4, (a) and (b), colocated kvrelay, 3 alternated rounds, all six
# servers up at once: the same sitting as xeon-amx-per-isa-13 (its run.sh), into this folder.
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/xeon-emr-per-isa-13 exec bash benchmarks/results/xeon-amx-per-isa-13/run.sh
