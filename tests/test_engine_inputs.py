"""The plan arrays the model step and attention read, as typed pytrees."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from engine_helpers import plans  # noqa: E402

from kvsched.engine.inputs import AttentionInputs, StepInputs  # noqa: E402


def test_attention_inputs_cross_jit_as_a_pytree():
    _, _, inputs, _, _ = next(plans(steps=1))
    assert len(jax.tree_util.tree_leaves(inputs)) == 5
    total = jax.jit(lambda i: i.kv_lens.sum() + i.num_seqs[0])(inputs)
    assert int(total) == int(np.asarray(inputs.kv_lens).sum() + np.asarray(inputs.num_seqs)[0])
    rebuilt = AttentionInputs(*inputs.arrays())
    assert all(a is b for a, b in zip(rebuilt.arrays(), inputs.arrays(), strict=True))


def test_step_inputs_from_a_plan_and_the_padding_plan():
    _, _, inputs, plan, _ = next(plans(steps=1))
    step = StepInputs.from_plan(plan)
    assert len(step.arrays()) == StepInputs.num_arrays() == 8
    np.testing.assert_array_equal(step.attention.page_indices, inputs.page_indices)
    assert jax.tree_util.tree_structure(jax.jit(lambda s: s)(step)) == (
        jax.tree_util.tree_structure(step)
    )
    pad = StepInputs.padding(16, 4, 8, 99)
    assert pad.token_ids.shape == (16,) and (pad.slot_mapping == 99).all()
    assert pad.page_indices.shape == (4, 8) and pad.cu_q_lens.shape == (5,)
    assert int(pad.num_seqs[0]) == 0 and pad.token_ids.dtype == jnp.int32
