"""Tensor parallelism's latency in the step-cost model: the per-layer all-reduces
over the accelerator preset's interconnect, checked against a hand computation;
one device is charged nothing for them."""

from __future__ import annotations

import math

import pytest

from kvsched.capacity import ACCELERATORS, MODELS
from kvsched.sim.simulator import StepCost, StepCostError


def test_allreduce_matches_a_hand_computation():
    # Llama-3-8B (32 layers, hidden 4,096) on 4 x H100 (NVLink 900 GB/s
    # bidirectional -> 450 GB/s per direction; 10 us per collective), 512 tokens:
    # one all-reduce carries 512 x 4,096 x 2 bytes = 4,194,304 bytes, a ring
    # sends 2 x 3/4 of it: 6,291,456 bytes / 450e9 = 13.98101 us, + 10 us; two per
    # layer, 32 layers: 64 x 23.98101 us = 1.534785 ms.
    cost = StepCost.preset("llama-3-8b", "h100", devices=4)
    assert cost.allreduce_seconds(512) == pytest.approx(64 * (10e-6 + 6_291_456 / 450e9))
    assert cost.allreduce_seconds(512) == pytest.approx(1.534785e-3, rel=1e-6)
    # The step: overhead + max(compute, memory) over 4 devices, + the all-reduces.
    compute = 512 * 2 * 8.03e9 / (4 * 989e12 * 0.5)
    weights = 8.03e9 * 2
    kv = 4096 * (2 * 32 * 8 * 128 * 2)
    memory = (weights + kv) / (4 * 3.35e12 * 0.8)
    expected = 0.002 + max(compute, memory) + 1.534785e-3
    assert cost.seconds(512, 4096) == pytest.approx(expected, rel=1e-6)
    # Two devices: the ring sends 2 x 1/2 = the whole buffer once.
    two = StepCost.preset("llama-3-8b", "h100", devices=2)
    assert two.allreduce_seconds(512) == pytest.approx(64 * (10e-6 + 4_194_304 / 450e9))


def test_one_device_is_unchanged():
    """devices=1: the formula from before tensor parallelism was charged, exactly."""
    for model in ("llama-3-8b", "smollm2-135m"):
        for acc in ("h100", "tpu-v5e"):
            m, a = MODELS[model], ACCELERATORS[acc]
            cost = StepCost(m, a)
            assert cost.allreduce_seconds(8192) == 0.0
            for tokens, kv_read in ((1, 100), (64, 200_000), (8192, 10_000)):
                compute = tokens * m.flops_per_token() / (1 * a.bf16_flops * 0.5)
                memory = (m.params * 2.0 + kv_read * m.kv_bytes_per_token(2.0)) / (
                    1 * a.hbm_bytes_per_s * 0.8
                )
                assert cost.seconds(tokens, kv_read) == 0.002 + max(compute, memory)


def test_tensor_parallelism_costs_latency_on_a_slow_link():
    """More devices split compute and memory, but each all-reduce adds latency:
    on TPU v5e (200 GB/s a device) a decode step of 8 tokens gains little from
    8 devices beyond 4, and the all-reduce share grows with the device count."""
    one = StepCost.preset("llama-3-70b", "tpu-v5e", devices=8)
    shares = []
    for n in (2, 4, 8):
        c = StepCost.preset("llama-3-70b", "tpu-v5e", devices=n)
        shares.append(c.allreduce_seconds(8) / c.seconds(8, 8 * 2000))
    assert shares == sorted(shares) and shares[0] > 0
    # 160 all-reduces of 10 us each are the floor of an 8-device step.
    assert one.allreduce_seconds(8) > 160 * 10e-6
    assert math.isfinite(one.seconds(8, 16_000))


def test_every_preset_has_an_interconnect_and_a_hidden_size():
    for a in ACCELERATORS.values():
        assert a.interconnect_bytes_per_s > 0 and a.collective_latency_s > 0, a.name
    for m in MODELS.values():
        assert m.hidden > 0, m.name
        StepCost(m, ACCELERATORS["h100"], devices=2)  # builds


def test_tensor_parallelism_without_the_figures_is_refused():
    from dataclasses import replace

    no_link = replace(ACCELERATORS["h100"], interconnect_bytes_per_s=0.0)
    with pytest.raises(StepCostError, match="interconnect"):
        StepCost(MODELS["llama-3-8b"], no_link, devices=2)
    StepCost(MODELS["llama-3-8b"], no_link, devices=1)  # one device needs no link
    no_hidden = replace(MODELS["llama-3-8b"], hidden=0)
    with pytest.raises(StepCostError, match="hidden"):
        StepCost(no_hidden, ACCELERATORS["h100"], devices=4)
    with pytest.raises(StepCostError, match="devices"):
        StepCost(MODELS["llama-3-8b"], ACCELERATORS["h100"], devices=0)


def test_devices_past_the_kv_heads_read_the_kv_of_the_heads_each_holds():
    """16 H100s serving Llama-3-8B's 8 KV heads: each device holds one head and
    reads its KV, 1/8 of a token's bytes, at its own bandwidth (all in parallel);
    the weights are split 16 ways."""
    cost = StepCost.preset("llama-3-8b", "h100", devices=16)
    kv_read = 200_000
    per_device = (8.03e9 * 2 / 16 + kv_read * (2 * 32 * 1 * 128 * 2)) / (3.35e12 * 0.8)
    assert cost.memory_seconds(kv_read) == pytest.approx(per_device, rel=1e-9)
    # Eight devices divide the heads: no copy, one head each as well.
    eight = StepCost.preset("llama-3-8b", "h100", devices=8)
    per_device = (8.03e9 * 2 / 8 + kv_read * (2 * 32 * 1 * 128 * 2)) / (3.35e12 * 0.8)
    assert eight.memory_seconds(kv_read) == pytest.approx(per_device, rel=1e-9)
