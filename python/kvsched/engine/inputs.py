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
they cross `jax.jit`, `lax.scan` and `shard_map` boundaries as they are.
`AttentionInputs` holds `jax.Array`s. `StepInputs` is generic in its array
type: built on the host (`from_plan`, `padding`) it holds numpy arrays (a
plan's, as the Rust core returns them: jit converts them), rebuilt inside the
jitted step it holds `jax.Array`s, and only that one gives `attention`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Generic, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from kvsched import StepPlan

HostArray = npt.NDArray[np.int32]
"""A plan array on the host, as the Rust core returns it."""

A = TypeVar("A", jax.Array, HostArray)


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
    def from_plan(cls, plan: StepPlan) -> AttentionInputs:
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
class StepInputs(Generic[A]):
    """Everything the model step reads from one plan (all int32): numpy arrays on
    the host (`StepInputs[HostArray]`), jax arrays inside the step
    (`StepInputs[jax.Array]`)."""

    token_ids: A  # [T]
    positions: A  # [T]
    # [T]: page * block_size + offset; padding points past the end. A model of
    # several KV-cache groups: [G, T], a row per group.
    slot_mapping: A
    cu_q_lens: A  # [S + 1]
    kv_lens: A  # [S]
    page_indices: A  # [S, PPS]; several KV-cache groups: [G, S, PPS]
    num_seqs: A  # [1]
    logits_indices: A  # [S]: the token row whose logits each sequence samples from

    @classmethod
    def from_plan(cls, plan: StepPlan) -> StepInputs[HostArray]:
        """The plan's arrays as they are (no copy: jit converts them); a plan of
        several KV-cache groups gives every group's slots and page tables."""
        arrays: dict[str, HostArray] = {f.name: getattr(plan, f.name) for f in fields(cls)}
        if plan.group_page_indices.shape[0] > 1:
            arrays["slot_mapping"] = plan.group_slot_mapping
            arrays["page_indices"] = plan.group_page_indices
        return StepInputs(**arrays)

    @classmethod
    def padding(
        cls, tokens: int, max_seqs: int, pages_per_seq: int, pad_slot: int, groups: int = 1
    ) -> StepInputs[HostArray]:
        """An all-padding plan of `tokens` rows (a token bucket): no sequence, so
        nothing attends and every K/V write drops (all slots are `pad_slot`).
        Running it compiles the bucket's program without touching the cache.
        `groups` > 1: shaped as a plan of that many KV-cache groups."""
        lead: tuple[int, ...] = () if groups == 1 else (groups,)
        return StepInputs(
            token_ids=np.zeros(tokens, np.int32),
            positions=np.zeros(tokens, np.int32),
            slot_mapping=np.full((*lead, tokens), pad_slot, np.int32),
            cu_q_lens=np.zeros(max_seqs + 1, np.int32),
            kv_lens=np.zeros(max_seqs, np.int32),
            page_indices=np.zeros((*lead, max_seqs, pages_per_seq), np.int32),
            num_seqs=np.zeros(1, np.int32),
            logits_indices=np.zeros(max_seqs, np.int32),
        )

    @classmethod
    def num_arrays(cls) -> int:
        return len(fields(cls))

    def arrays(self) -> tuple[A, ...]:
        """The fields in order (what `StepInputs(*arrays)` rebuilds)."""
        return tuple(getattr(self, f.name) for f in fields(self))

    @property
    def attention(self: StepInputs[jax.Array]) -> AttentionInputs:
        return AttentionInputs(
            self.positions, self.cu_q_lens, self.kv_lens, self.page_indices, self.num_seqs
        )
