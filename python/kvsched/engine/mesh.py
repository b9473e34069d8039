"""The tensor-parallel mesh: its axis name and how arrays split over it.

Its own module because both sides of the engine need it and neither may import
the other for it: attention (runs the Pallas kernel once per device with
`shard_map` over `AXIS`) sits below the model, and sharding (places the model's
weights and caches on the mesh) sits above it. Both import this; it imports no
other engine module.

One 1-D mesh over one host's devices, axis `AXIS`: query, key and value
projections split by head, the output and down projections by their input; the
KV cache splits on its combined-head axis (K and V of a head stay together:
heads [i*Hkv/n, (i+1)*Hkv/n) on device i; with more devices than KV heads,
the engine first copies each head to the devices that read it, see
kvsched.engine.sharding). The step plan is replicated.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

AXIS = "tp"

# Per layer's weights ([in, out] projections; the engine stacks them over layers,
# an axis that is never split).
LAYER_SPECS = {
    "attn_norm": P(),
    "wq": P(None, AXIS),
    "wk": P(None, AXIS),
    "wv": P(None, AXIS),
    "wo": P(AXIS, None),
    "mlp_norm": P(),
    "w_gate": P(None, AXIS),
    "w_up": P(None, AXIS),
    "w_down": P(AXIS, None),
    # Gemma 3's norms: per head (q, k) and of the residual stream, replicated.
    "q_norm": P(),
    "k_norm": P(),
    "post_attn_norm": P(),
    "post_mlp_norm": P(),
}

CACHE_SPEC = P(None, None, AXIS, None)  # one layer's cache [P, bs, 2*Hkv, D]
STACKED_CACHE_SPEC = P(None, None, None, AXIS, None)  # [layers, ...]
HEADS_SPEC = P(None, AXIS, None)  # q or attention output [T, Hq, D]: split by head


def make_mesh(n: int | None = None) -> Mesh:
    """A 1-D mesh over the first `n` devices (all by default)."""
    devices = jax.devices()[: n or len(jax.devices())]
    return Mesh(devices, (AXIS,))
