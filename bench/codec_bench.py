"""Compression ratio and single-thread speed of the chunk codecs on fp32 and bf16 weights.

    python bench/codec_bench.py
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from ckptstore.format.codecs import codec_option

CHUNK = 16 << 20


def measure(raw: np.ndarray, itemsize: int, codec_name: str) -> tuple[float, float, float]:
    """(stored/raw ratio, compress GB/s, decompress GB/s) over 16 MiB chunks."""
    codec = codec_option(codec_name)
    assert codec is not None
    starts = range(0, raw.nbytes, CHUNK)
    t0 = time.perf_counter()
    encoded = [codec.encode(memoryview(raw[i : i + CHUNK]), itemsize) for i in starts]
    t_enc = time.perf_counter() - t0
    out = np.empty(raw.nbytes, np.uint8)
    t0 = time.perf_counter()
    for frame, i in zip(encoded, starts):
        codec.decode_into(frame, memoryview(out[i : i + CHUNK]), itemsize, codec_name)
    t_dec = time.perf_counter() - t0
    assert out.tobytes() == raw.tobytes()
    ratio = sum(map(len, encoded)) / raw.nbytes
    return ratio, raw.nbytes / t_enc / 1e9, raw.nbytes / t_dec / 1e9


def main() -> None:
    torch.manual_seed(0)
    fp32 = torch.randn(2048, 8192) * 0.02
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    print("| weights | codec | stored/raw | compress GB/s (1 thread) "
          "| decompress GB/s (1 thread) |")
    print("|---|---|---|---|---|")
    for name, t in (("fp32", fp32), ("bf16", fp32.to(torch.bfloat16))):
        raw = t.reshape(-1).view(torch.uint8).numpy()
        for codec_name in ("zstd:1", "zstd:3", "lz4", "blosc"):
            ratio, enc, dec = measure(raw, t.element_size(), codec_name)
            print(f"| {name} | {codec_name} | {ratio:.3f} | {enc:.2f} | {dec:.2f} |")


if __name__ == "__main__":
    main()
