"""Tensor parallelism over one host's devices: KV heads sharded over a mesh axis.

Query, key and value projections are split by head, the output and down
projections by their input, so each device holds its share of the heads and of
the MLP; the KV cache is split on its combined-head axis (K and V of a head
stay together: heads [i*Hkv/n, (i+1)*Hkv/n) on device i). The step plan is
small and replicated: the same plan drives every shard, and XLA inserts the two
all-reduces per layer (after attention and after the MLP).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvsched.engine.model import LlamaConfig, Params

AXIS = "tp"

_LAYER_SPECS = {
    "attn_norm": P(),
    "wq": P(None, AXIS),
    "wk": P(None, AXIS),
    "wv": P(None, AXIS),
    "wo": P(AXIS, None),
    "mlp_norm": P(),
    "w_gate": P(None, AXIS),
    "w_up": P(None, AXIS),
    "w_down": P(AXIS, None),
}

CACHE_SPEC = P(None, None, AXIS, None)  # one layer's cache
STACKED_CACHE_SPEC = P(None, None, None, AXIS, None)  # [layers, ...]


def make_mesh(n: int | None = None) -> Mesh:
    """A 1-D mesh over the first `n` devices (all by default)."""
    devices = jax.devices()[: n or len(jax.devices())]
    return Mesh(devices, (AXIS,))


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
            k: jax.device_put(v, NamedSharding(mesh, P(None, *_LAYER_SPECS[k])))
            for k, v in params["layers"].items()
        },
    }


def cache_sharding(mesh: Mesh, *, stacked: bool = True) -> NamedSharding:
    return NamedSharding(mesh, STACKED_CACHE_SPEC if stacked else CACHE_SPEC)
