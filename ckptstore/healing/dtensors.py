"""DTensors on the wire, without pickle: a DTensor travels as its local tensor (the rank's own
shard, which is what the same rank of another replica group holds) plus a JSON description of
its placement: device type, mesh (the rank layout), mesh dim names, placements, global shape
and stride.

The receiver fills the local tensor of a destination DTensor in place (after checking that
its placement is the one sent), or builds a new DTensor from the received local tensor on a
mesh equal to the sender's: a destination DTensor's mesh when one matches, else a mesh object
made without process groups (`DeviceMesh(..., _init_backend=False)`: creating groups is a
collective the healing rank cannot start alone). Such a DTensor holds the right values and
spec; pass destinations for DTensors that must run collectives (a replacement's own model).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any

from ..errors import FormatError, UnsupportedTypeError
from ..format.tree import key_string

Spec = dict[str, Any]


def _dtensor_class() -> type | None:
    """torch's DTensor class if its module is loaded (no object can be a DTensor otherwise;
    importing it costs most of a second: it loads sympy), else None."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None) if module is not None else None
    return cls if isinstance(cls, type) else None


def is_dtensor(obj: object) -> bool:
    cls = type(obj)
    if not cls.__module__.startswith("torch"):
        return False
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(obj, dtensor)


def _placement_json(p: Any, key: str) -> list[Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):
        return ["strided_shard", int(p.dim), int(p.split_factor)]
    if isinstance(p, Shard):
        return ["shard", int(p.dim)]
    if isinstance(p, Replicate):
        return ["replicate"]
    if isinstance(p, Partial):
        return ["partial", str(p.reduce_op)]
    raise UnsupportedTypeError(f"{key}: DTensor placement {p!r} cannot be sent (Shard, "
                               "Replicate, Partial and strided shards can)")


def _placement(doc: Any, key: str) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if isinstance(doc, list) and doc:
        kind = doc[0]
        if kind == "shard" and len(doc) == 2 and type(doc[1]) is int:
            return Shard(doc[1])
        if kind == "replicate" and len(doc) == 1:
            return Replicate()
        if kind == "partial" and len(doc) == 2 and isinstance(doc[1], str):
            return Partial(doc[1])
        if kind == "strided_shard" and len(doc) == 3 and all(type(x) is int for x in doc[1:]):
            from torch.distributed.tensor.placement_types import _StridedShard

            return _StridedShard(doc[1], split_factor=doc[2])
    raise FormatError(f"{key}: unknown DTensor placement {doc!r:.80} in the index")


def describe(dt: Any, key: str) -> Spec:
    """The JSON description of a DTensor's placement."""
    mesh = dt.device_mesh
    names = mesh.mesh_dim_names
    return {
        "device_type": str(mesh.device_type),
        "mesh": mesh.mesh.tolist(),
        "dim_names": list(names) if names else None,
        "placements": [_placement_json(p, key) for p in dt.placements],
        "shape": [int(s) for s in dt.shape],
        "stride": [int(s) for s in dt.stride()],
        "requires_grad": bool(dt.requires_grad),
    }


def local_of(dt: Any) -> Any:
    """The local tensor of a DTensor (no autograd edge, no copy)."""
    import torch

    with torch.no_grad():
        return dt.to_local()


def strip(state: Any) -> tuple[Any, dict[str, Spec], dict[str, Any]]:
    """`state` with every DTensor replaced by its local tensor (containers are rebuilt, tensors
    are not copied), the description of each DTensor by dotted key, and the DTensors by
    dotted key. A state without DTensors is returned as it is."""
    specs: dict[str, Spec] = {}
    found: dict[str, Any] = {}
    if not _has_dtensor(state, 0):
        return state, specs, found
    return _strip(state, (), specs, found), specs, found


def _has_dtensor(obj: Any, depth: int) -> bool:
    if depth > 256:
        return False
    if isinstance(obj, dict):
        return any(_has_dtensor(v, depth + 1) for v in obj.values())
    if type(obj) in (list, tuple):
        return any(_has_dtensor(v, depth + 1) for v in obj)
    return is_dtensor(obj)


def _strip(obj: Any, path: tuple[str | int, ...], specs: dict[str, Spec],
           found: dict[str, Any]) -> Any:
    cls = type(obj)
    if cls is dict:
        return {k: _strip(v, (*path, k), specs, found) for k, v in obj.items()}
    if cls is OrderedDict:
        out: OrderedDict[Any, Any] = OrderedDict(
            (k, _strip(v, (*path, k), specs, found)) for k, v in obj.items())
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out._metadata = meta  # type: ignore[attr-defined]
        return out
    if cls is list:
        return [_strip(v, (*path, i), specs, found) for i, v in enumerate(obj)]
    if cls is tuple:
        return tuple(_strip(v, (*path, i), specs, found) for i, v in enumerate(obj))
    if is_dtensor(obj):
        key = key_string(path)
        specs[key] = describe(obj, key)
        found[key] = obj
        return local_of(obj)
    return obj


def check_spec(spec: Any, key: str) -> Spec:
    """A DTensor description from an index, checked for form (FormatError otherwise; the
    values are checked again by torch when the DTensor is built)."""
    fields = {"device_type", "mesh", "dim_names", "placements", "shape", "stride",
              "requires_grad"}
    if not isinstance(spec, dict) or spec.keys() != fields:
        raise FormatError(f"{key}: malformed DTensor description in the index")
    if not isinstance(spec["device_type"], str) or not isinstance(spec["placements"], list):
        raise FormatError(f"{key}: malformed DTensor description in the index")
    for field in ("shape", "stride"):
        if not isinstance(spec[field], list) or not all(type(x) is int for x in spec[field]):
            raise FormatError(f"{key}: malformed DTensor {field} in the index")
    return spec


def mismatch(dest: Any, spec: Spec, key: str) -> str | None:
    """Why destination DTensor `dest` cannot take a DTensor described by `spec`, or None."""
    have = describe(dest, key)
    for field in ("device_type", "mesh", "dim_names", "placements", "shape"):
        if have[field] != spec[field]:
            return (f"destination DTensor {field} {have[field]!r:.80} != sent "
                    f"{spec[field]!r:.80}")
    return None


class Rebuilder:
    """Builds DTensors from received local tensors, reusing the meshes of destination
    DTensors where they equal the sender's."""

    def __init__(self, destinations: dict[str, Any]) -> None:
        self._meshes: list[tuple[Spec, Any]] = []
        for key, dt in destinations.items():
            self._meshes.append((describe(dt, key), dt.device_mesh))

    def _mesh(self, spec: Spec) -> Any:
        for have, mesh in self._meshes:
            if all(have[f] == spec[f] for f in ("device_type", "mesh", "dim_names")):
                return mesh
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        names = spec["dim_names"]
        mesh = DeviceMesh(spec["device_type"], torch.tensor(spec["mesh"], dtype=torch.int),
                          mesh_dim_names=tuple(names) if names else None, _init_backend=False)
        self._meshes.append((spec, mesh))
        return mesh

    def build(self, local: Any, spec: Spec, key: str) -> Any:
        """A DTensor of the received local tensor, exactly as sent (also on a rank outside
        the mesh, where `DTensor.from_local` would drop the local tensor)."""
        import torch
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        placements = tuple(_placement(p, key) for p in spec["placements"])
        try:
            meta = TensorMeta(torch.Size(spec["shape"]), tuple(spec["stride"]), local.dtype)
            dspec = DTensorSpec(self._mesh(spec), placements, tensor_meta=meta)
            requires_grad = bool(spec["requires_grad"]) and local.is_floating_point()
            return DTensor(local, dspec, requires_grad=requires_grad)  # type: ignore[no-untyped-call]
        except (RuntimeError, ValueError, TypeError, AssertionError) as exc:
            raise UnsupportedTypeError(f"{key}: cannot rebuild the DTensor sent: "
                                       f"{type(exc).__name__}: {exc}") from None
