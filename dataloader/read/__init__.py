"""Reading a stored dataset: bytes from the store, verified, decoded into blocks and cut into
items. Imports flow down this list only:

    metrics.py    counters (bytes, requests, cache hits, the consumer's wait)
    cache.py      the optional local cache of verified chunks, named by digest
    block_lru.py  decoded blocks kept across windows (the full-permutation order)
    blocks.py     BlockReader: merged ranged reads of a window's chunks, verified and decoded
    views.py      a window's decoded blocks, and how items and batches are cut from them
    prefetch.py   windows loaded ahead within a byte budget, batches made on a background
                  thread, clean shutdown
    verify.py     `ckpt-data verify`: every stored object checked against dataset.json and
                  against what zarr-python reads

Depends on `format` and `order`; never on `write`, `sources` or `loading`.
"""
