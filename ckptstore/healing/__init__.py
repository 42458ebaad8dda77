"""Live healing: one replica's state copied to another over HTTP while training runs, chunk by
chunk, every byte verified against its digest (torchft's CheckpointTransport is
`ckptstore.torchft.Transport`, built on these modules).

    errors.py     HealError, HealTimeoutError
    dtensors.py   DTensors on the wire: the local tensor plus a JSON placement, no pickle
    snapshot.py   the sender: a live state as a sealed manifest and blobs viewing its memory
    server.py     the sender's threaded HTTP server: serving, draining, what it has sent
    client.py     HTTP/1.1 requests with a deadline, bodies read into caller buffers
    receive.py    the receiver: index, destinations, local copies, parallel verified fetches
    memory.py     new tensors backed ahead of the transfer (and huge pages, opt-in)
    staging.py    device tensors: page-locked slots (the store's device seam), bounded

Nothing here pickles; the wire format is docs/format.md's manifest (docs/recovery.md, "Live
healing (torchft)")."""
