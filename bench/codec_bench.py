"""Compression ratio and single-thread speed of the chunk codecs on fp32 and bf16 weights.

    python bench/codec_bench.py
"""
import os
import time

import numpy as np
import torch

import ckptstore

torch.manual_seed(0)
w32 = torch.randn(2048, 8192) * 0.02
wbf = w32.to(torch.bfloat16)
C = 16 << 20
print(f"load average at start: {os.getloadavg()[0]:.1f}")
print("| weights | codec | stored/raw | compress GB/s (1 thread) | decompress GB/s (1 thread) |")
print("|---|---|---|---|---|")
for name, t in (("fp32", w32), ("bf16", wbf)):
    raw = t.reshape(-1).view(torch.uint8).numpy(); item = t.element_size()
    for cid in ("zstd:1", "zstd:3", "lz4", "blosc"):
        c = ckptstore.codecs.codec_option(cid)
        t0 = time.perf_counter(); enc = [c.encode(memoryview(raw[i:i+C]), item) for i in range(0, raw.nbytes, C)]; te = time.perf_counter() - t0
        out = np.empty(raw.nbytes, np.uint8)
        t0 = time.perf_counter()
        for k, i in enumerate(range(0, raw.nbytes, C)):
            c.decode_into(enc[k], memoryview(out[i:i+C]), item, "x")
        td = time.perf_counter() - t0
        assert out.tobytes() == raw.tobytes()
        print(f"| {name} | {cid} | {sum(map(len, enc))/raw.nbytes:.3f} | {raw.nbytes/te/1e9:.2f} | {raw.nbytes/td/1e9:.2f} |")
