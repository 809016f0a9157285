"""The rank's device meshes, made once per layout and reused by every transformer load.

Every new ``DeviceMesh`` creates process groups (gloo or NCCL communicators: sockets, threads and buffers on every
rank), and nothing frees them when the model that used the mesh is dropped. A persistent rank that made a mesh per
load leaked about 4 file descriptors and 3 threads per context-parallel load, so the default ``staged`` policy (a new
prompt re-encodes, which evicts and reloads the transformer) ran a backend out of file descriptors after a few hundred
prompts. A backend uses only a few layouts (one per strategy and degrees), so the cache stays small.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

_MESHES: dict[tuple[str, tuple[int, ...], tuple[str, ...]], DeviceMesh] = {}


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """The mesh of this layout (collective the first time: every rank calls it together, in the same order)."""
    key = (device_type, tuple(shape), tuple(names))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    return _MESHES[key]
