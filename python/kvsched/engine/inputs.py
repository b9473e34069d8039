"""What one step plan hands the model and the attention kernels: plain arrays.

The bottom of the engine's import order (it imports no other engine module):
the kernels, the attention dispatch, the model and the runner all read these
types, so none of them has to import another to learn what a plan looks like.

- `AttentionInputs`: the plan arrays attention reads (positions, sequence
  boundaries, KV lengths, page table, sequence count).
- `StepInputs`: everything the jitted model step reads from a plan: the tokens,
  where their K/V go (`slot_mapping`), which rows give logits, and the attention
  inputs. It names the step function's array arguments (the runner passes
  `*inputs.arrays()` and rebuilds it inside) and replaces the warmup's
  stand-in plan class.

Both are frozen dataclasses registered as JAX pytrees (every field a leaf), so
they cross `jax.jit`, `lax.scan` and `shard_map` boundaries as they are. Fields
are typed `jax.Array`; numpy arrays (a plan's, as the Rust core returns them)
are accepted where jit converts them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionInputs:
    """The plan arrays attention reads (all int32). T: padded tokens, S: the
    plan's sequence slots (max_seqs), PPS: pages per sequence."""

    positions: jax.Array  # [T]: each token's position in its sequence
    cu_q_lens: jax.Array  # [S + 1]: sequence s owns token rows cu_q_lens[s]:cu_q_lens[s + 1]
    kv_lens: jax.Array  # [S]: tokens of KV each sequence attends over (this step's included)
    page_indices: jax.Array  # [S, PPS]: each sequence's pages, in order
    num_seqs: jax.Array  # [1]: how many of the S slots are real

    @classmethod
    def from_plan(cls, plan: Any) -> AttentionInputs:
        return cls(
            positions=jnp.asarray(plan.positions),
            cu_q_lens=jnp.asarray(plan.cu_q_lens),
            kv_lens=jnp.asarray(plan.kv_lens),
            page_indices=jnp.asarray(plan.page_indices),
            num_seqs=jnp.asarray(plan.num_seqs),
        )

    def arrays(self) -> tuple[jax.Array, ...]:
        """The fields in order (what `AttentionInputs(*arrays)` rebuilds)."""
        return tuple(getattr(self, f.name) for f in fields(self))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInputs:
    """Everything the model step reads from one plan (all int32)."""

    token_ids: jax.Array  # [T]
    positions: jax.Array  # [T]
    slot_mapping: jax.Array  # [T]: page * block_size + offset; padding points past the end
    cu_q_lens: jax.Array  # [S + 1]
    kv_lens: jax.Array  # [S]
    page_indices: jax.Array  # [S, PPS]
    num_seqs: jax.Array  # [1]
    logits_indices: jax.Array  # [S]: the token row whose logits each sequence samples from

    @classmethod
    def from_plan(cls, plan: Any) -> StepInputs:
        """The plan's arrays as they are (no copy: jit converts them)."""
        return cls(**{f.name: getattr(plan, f.name) for f in fields(cls)})

    @classmethod
    def padding(cls, tokens: int, max_seqs: int, pages_per_seq: int, pad_slot: int) -> StepInputs:
        """An all-padding plan of `tokens` rows (a token bucket): no sequence, so
        nothing attends and every K/V write drops (all slots are `pad_slot`).
        Running it compiles the bucket's program without touching the cache."""
        return cls(
            token_ids=np.zeros(tokens, np.int32),
            positions=np.zeros(tokens, np.int32),
            slot_mapping=np.full(tokens, pad_slot, np.int32),
            cu_q_lens=np.zeros(max_seqs + 1, np.int32),
            kv_lens=np.zeros(max_seqs, np.int32),
            page_indices=np.zeros((max_seqs, pages_per_seq), np.int32),
            num_seqs=np.zeros(1, np.int32),
            logits_indices=np.zeros(max_seqs, np.int32),
        )

    @classmethod
    def num_arrays(cls) -> int:
        return len(fields(cls))

    def arrays(self) -> tuple[jax.Array, ...]:
        """The fields in order (what `StepInputs(*arrays)` rebuilds)."""
        return tuple(getattr(self, f.name) for f in fields(self))

    @property
    def attention(self) -> AttentionInputs:
        return AttentionInputs(
            self.positions, self.cu_q_lens, self.kv_lens, self.page_indices, self.num_seqs
        )
