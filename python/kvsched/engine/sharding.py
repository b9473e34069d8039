"""Tensor parallelism over one host's devices: the model's weights and KV caches
placed on the mesh (kvsched.engine.mesh has the axis and the partition specs).

Query, key and value projections are split by head, the output and down
projections by their input, so each device holds its share of the heads and of
the MLP; the KV cache is split on its combined-head axis (K and V of a head
stay together: heads [i*Hkv/n, (i+1)*Hkv/n) on device i). The step plan is
small and replicated: the same plan drives every shard, and XLA inserts the two
all-reduces per layer (after attention and after the MLP).

Above the model in the import order (it places the model's parameters); the
attention dispatch below the model reads the mesh from kvsched.engine.mesh, so
nothing here is imported back.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvsched.engine.config import LlamaConfig
from kvsched.engine.mesh import AXIS, CACHE_SPEC, LAYER_SPECS, STACKED_CACHE_SPEC, make_mesh
from kvsched.engine.model import Params

# make_mesh is defined in kvsched.engine.mesh; it is named here too because
# users build a mesh as kvsched.engine.sharding.make_mesh(n) (the README does).
__all__ = ["cache_sharding", "check_divisible", "make_mesh", "shard_params"]


def check_divisible(model: LlamaConfig, mesh: Mesh) -> None:
    n = mesh.shape[AXIS]
    for what, value in (("n_kv_heads", model.n_kv_heads), ("n_heads", model.n_heads),
                        ("ffn_dim", model.ffn_dim)):  # fmt: skip
        if value % n:
            raise ValueError(f"{what}={value} does not split over {n} devices")


def shard_params(params: Params, mesh: Mesh) -> Params:
    rep = NamedSharding(mesh, P())
    return {
        "embed": jax.device_put(params["embed"], rep),
        "final_norm": jax.device_put(params["final_norm"], rep),
        "lm_head": jax.device_put(params["lm_head"], rep),
        "layers": {  # stacked over layers: the layer axis is not split
            k: jax.device_put(v, NamedSharding(mesh, P(None, *LAYER_SPECS[k])))
            for k, v in params["layers"].items()
        },
    }


def cache_sharding(mesh: Mesh, *, stacked: bool = True) -> NamedSharding:
    return NamedSharding(mesh, STACKED_CACHE_SPEC if stacked else CACHE_SPEC)
