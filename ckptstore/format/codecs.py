"""Chunk compression through numcodecs, with output bounded by the size the manifest declares.

A codec is named by a short id ('zstd', 'lz4', 'blosc'); `None` means raw bytes. Decoding always
writes into a buffer sized from the manifest, so a hostile frame that claims a huge output size
cannot allocate more than the chunk's declared size (numcodecs raises when the output overflows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import FormatError, IntegrityError

CODEC_IDS = ("zstd", "lz4", "blosc")


@dataclass(frozen=True)
class Codec:
    """A compressor setting. `level` is zstd's level, blosc's clevel; lz4's acceleration."""

    id: str
    level: int = 1

    def __post_init__(self) -> None:
        if self.id not in CODEC_IDS:
            raise ValueError(f"unknown codec {self.id!r}; choose one of {', '.join(CODEC_IDS)}")

    def _numcodec(self, typesize: int) -> Any:
        import numcodecs  # ~0.2-0.35 s to import: only when a codec is actually used

        if self.id == "zstd":
            return numcodecs.Zstd(level=self.level)
        if self.id == "lz4":
            return numcodecs.LZ4(acceleration=self.level)
        return numcodecs.Blosc(cname="zstd", clevel=self.level, shuffle=numcodecs.Blosc.SHUFFLE,
                               typesize=typesize)

    def encode(self, raw: memoryview, typesize: int) -> bytes:
        """Compress `raw`; blosc shuffles bytes in groups of `typesize`."""
        arr = np.frombuffer(raw, dtype=np.uint8)
        return bytes(self._numcodec(typesize).encode(arr))

    def decode_into(self, stored: bytes | bytearray | memoryview, out: memoryview, typesize: int,
                    what: str) -> None:
        """Decompress into `out`, which must come out exactly full."""
        dest = np.frombuffer(out, dtype=np.uint8)
        try:
            result = self._numcodec(typesize).decode(stored, out=dest)
        except Exception as exc:  # numcodecs raises ValueError/RuntimeError on bad frames
            raise IntegrityError(f"{what}: cannot decompress ({self.id}): {exc}") from exc
        got = np.asarray(result).nbytes
        if got != len(out):
            raise IntegrityError(f"{what}: decompressed {got} bytes, manifest declares {len(out)}")

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "level": self.level}

    def zarr_codec(self, typesize: int) -> dict[str, Any]:
        """The zarr v3 codec entry that decodes what `encode` produced."""
        if self.id == "zstd":
            return {"name": "zstd", "configuration": {"level": self.level, "checksum": False}}
        if self.id == "lz4":
            return {"name": "numcodecs.lz4", "configuration": {"acceleration": self.level}}
        return {"name": "blosc", "configuration": {"cname": "zstd", "clevel": self.level,
                "shuffle": "shuffle", "typesize": typesize, "blocksize": 0}}


def parse_codec(value: object) -> Codec | None:
    """Codec from its manifest form ({'id':..., 'level':...} or null)."""
    if value is None:
        return None
    if (not isinstance(value, dict) or set(value) != {"id", "level"}
            or value["id"] not in CODEC_IDS or type(value["level"]) is not int
            or not -100 <= value["level"] <= 100):
        raise FormatError(f"invalid codec {value!r}")
    return Codec(value["id"], value["level"])


def codec_option(value: str | Codec | None) -> Codec | None:
    """Codec from a user option: None/'none', a codec id, 'id:level', or a Codec."""
    if value is None or isinstance(value, Codec):
        return value
    if not isinstance(value, str):
        raise TypeError(f"compression must be a codec name or None, got {value!r}")
    if value.lower() in ("", "none", "raw"):
        return None
    name, _, level = value.partition(":")
    if level and not level.lstrip("-").isdigit():
        raise ValueError(f"invalid compression level in {value!r}")
    return Codec(name.lower(), int(level) if level else (5 if name.lower() == "blosc" else 1))
