"""What is stored, independent of where: canonical JSON and seals, hashing, names, dtypes,
codecs, the typed state tree and its leaves, and the manifest (model, writer, parser).

Depends only on `ckptstore.errors` (and torch, lazily, in `torch_types`)."""
