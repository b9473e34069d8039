"""Tensor parallelism over one host's devices: the model's weights and KV caches
placed on the mesh (kvsched.engine.mesh has the axis and the partition specs).

Query, key and value projections are split by head, the output and down
projections by their input, so each device holds its share of the heads and of
the MLP; the KV cache is split on its combined-head axis (K and V of a head
stay together: heads [i*Hkv/n, (i+1)*Hkv/n) on device i). The step plan is
small and replicated: the same plan drives every shard, and XLA inserts the two
all-reduces per layer (after attention and after the MLP).

More devices than KV heads (n a multiple of Hkv, e.g. Llama-3-70B's 8 KV heads
on 16 devices, or a multi-query model on any mesh): each KV head is stored on
the n / Hkv devices whose query heads read it (`kv_replicas`). The key and value
projections' columns are repeated head by head before they are placed
(`replicate_kv_heads`), so the engine runs a model with n KV heads, one per
device, and device i's query heads [i*Hq/n, (i+1)*Hq/n) read the copy of their
own KV head. The KV pool then holds n / Hkv copies of every token's K and V:
the capacity model's `ModelShape.kv_copies` counts the same.

Above the model in the import order (it places the model's parameters); the
attention dispatch below the model reads the mesh from kvsched.engine.mesh, so
nothing here is imported back.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import kvsched
from kvsched.engine.mesh import AXIS, CACHE_SPEC, LAYER_SPECS, STACKED_CACHE_SPEC, make_mesh
from kvsched.engine.model import Params
from kvsched.engine.model_config import LlamaConfig
from kvsched.shapes import tensor_parallel_misfit

# make_mesh is defined in kvsched.engine.mesh; it is named here too because
# users build a mesh as kvsched.engine.sharding.make_mesh(n) (the README does).
__all__ = [
    "cache_sharding", "check_divisible", "kv_replicas", "make_mesh", "replicate_kv_heads",
    "shard_params", "widened",
]  # fmt: skip


def kv_replicas(model: LlamaConfig, devices: int) -> int:
    """How many devices of a `devices`-wide mesh hold each KV head: 1 when the
    KV heads split evenly over them, devices / n_kv_heads when the devices are
    a multiple of the KV heads. Anything else (e.g. 6 KV heads on 4 devices) is
    kvsched.InvalidConfig, as are query heads or an MLP that do not split."""
    hkv = model.n_kv_heads
    part = tensor_parallel_misfit(model.n_heads, hkv, model.ffn_dim, devices)
    if part == "kv_heads":
        raise kvsched.InvalidConfig(
            f"{model.name}: {hkv} KV heads over {devices} devices: the device count must "
            f"divide the KV heads (each device holds its share) or be a multiple of them "
            f"(each head is copied to the devices whose query heads read it)"
        )
    if part is not None:
        what, value = (("n_heads", model.n_heads) if part == "query_heads"
                       else ("ffn_dim", model.ffn_dim))  # fmt: skip
        raise kvsched.InvalidConfig(
            f"{model.name}: {what}={value} does not split over {devices} devices "
            "(tensor parallelism splits the query heads and the MLP evenly)"
        )
    return 1 if hkv % devices == 0 else devices // hkv


def check_divisible(model: LlamaConfig, mesh: Mesh) -> int:
    """`kv_replicas` for this mesh (kvsched.InvalidConfig if it cannot run the model)."""
    return kv_replicas(model, mesh.shape[AXIS])


def widened(model: LlamaConfig, replicas: int) -> LlamaConfig:
    """The model as the engine runs it with each KV head copied `replicas`
    times: what the pool stores and the program computes."""
    return dataclasses.replace(model, n_kv_heads=model.n_kv_heads * replicas)


def replicate_kv_heads(
    model: LlamaConfig, params: Params, replicas: int
) -> tuple[LlamaConfig, Params]:
    """The model with each KV head repeated `replicas` times, in place (head h
    becomes heads h*replicas .. h*replicas + replicas - 1), so query head j still
    reads a copy of KV head j // (n_heads / n_kv_heads): the same attention, with
    n_kv_heads x replicas heads to split over the mesh. Only the key and value
    projections change; `params` is not modified."""
    if replicas == 1:
        return model, params
    hkv, d = model.n_kv_heads, model.head_dim

    def repeat(w: jax.Array) -> jax.Array:  # [layers, dim, hkv * d]
        heads = jnp.reshape(w, (*w.shape[:-1], hkv, d))
        return jnp.repeat(heads, replicas, axis=-2).reshape(*w.shape[:-1], hkv * replicas * d)

    layers = dict(params["layers"])
    layers["wk"], layers["wv"] = repeat(layers["wk"]), repeat(layers["wv"])
    return widened(model, replicas), Params(embed=params["embed"], layers=layers,
                        final_norm=params["final_norm"], lm_head=params["lm_head"])  # fmt: skip


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
