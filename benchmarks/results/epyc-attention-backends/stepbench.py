import statistics, sys, time
import torch
from kvrelay.core.config import ModelOptions, KVCacheConfig, SchedulerConfig
from kvrelay.engine.loader import load_model
from kvrelay.engine.core import EngineCore
from kvrelay.engine.runner import SeqChunk
loaded = load_model(ModelOptions())
core = EngineCore(loaded, KVCacheConfig(max_kv_tokens=40000), SchedulerConfig())
r = core.runner
out = []
for B in (1, 32):
    pages = [list(range(b * 24, b * 24 + 24)) for b in range(B)]   # 384 tokens each
    r.prefill([SeqChunk(list(range(100 + b, 356 + b)), 0, pages[b]) for b in range(B)])
    ts = []
    for i in range(120 if B == 1 else 40):
        pos = 256 + i % 100
        t = time.perf_counter(); r.decode([5] * B, [pos] * B, pages); ts.append(time.perf_counter() - t)
    out.append(f"B={B}: median {statistics.median(ts)*1e3:.2f} ms, min {min(ts)*1e3:.2f} ms")
t = time.perf_counter(); r.prefill([SeqChunk(list(range(100, 612)), 0, list(range(0, 32)))]); pf = time.perf_counter() - t
print(sys.argv[1], "|", " | ".join(out), f"| prefill 512: {pf*1e3:.0f} ms", flush=True)
