"""Beyond one host in the capacity and step-cost models: `hosts` x
`devices` accelerators as one tensor-parallel replica; KV per host; the
all-reduces between hosts (a TPU slice's ICI spans its hosts, GPUs cross hosts
over a NIC each)."""

from __future__ import annotations

import math

import pytest

from kvsched.capacity import ACCELERATORS, CapacityError, capacity
from kvsched.cli import main
from kvsched.sim.setup import engine_for, named_workload
from kvsched.sim.simulator import StepCost, StepCostError


def test_hosts_sum_memory_and_the_pool_is_split_over_them():
    one = capacity("llama-3-70b", "h100", devices=8)
    two = capacity("llama-3-70b", "h100", devices=4, hosts=2)
    assert (two.kv_blocks, two.usable_kv_bytes) == (one.kv_blocks, one.usable_kv_bytes)
    assert two.kv_bytes_per_host == pytest.approx(one.usable_kv_bytes / 2)
    # 141 GB of bf16 weights on 2 x 4 v5e chips of 16 GB: 128 GB, less 10%.
    with pytest.raises(CapacityError, match="does not fit 2 hosts x 4 x tpu-v5e"):
        capacity("llama-3-70b", "tpu-v5e", devices=4, hosts=2)
    assert capacity("llama-3-70b", "tpu-v5e", devices=4, hosts=2, precision="int8").kv_blocks > 0
    with pytest.raises(CapacityError, match="hosts"):
        capacity("llama-3-8b", "h100", hosts=0)


def test_a_tpu_slice_is_one_ring_over_every_chip_of_every_host():
    split = StepCost.preset("llama-3-70b", "tpu-v5e", devices=4, hosts=2)
    flat = StepCost.preset("llama-3-70b", "tpu-v5e", devices=8)
    for tokens in (1, 64, 2048):
        assert split.seconds(tokens, 10_000) == flat.seconds(tokens, 10_000)
    # Bytes over each host's boundary link: the ring's 2(n-1)/n x size per
    # all-reduce, 2 all-reduces per layer.
    size = 2048 * 8192 * 2
    assert split.host_bytes(2048) == pytest.approx(2 * 80 * 2 * 7 / 8 * size)
    assert flat.host_bytes(2048) == 0.0


def test_gpus_all_reduce_within_each_host_then_across_hosts_over_their_nics():
    a = ACCELERATORS["h100"]
    two = StepCost.preset("llama-3-70b", "h100", devices=4, hosts=2)
    size = 64 * 8192 * 2  # a 64-token step's activations, bf16
    within = 2 * 3 / 4 * size / a.interconnect_bytes_per_s
    across = 2 * 1 / 2 * (size / 4) / a.host_link_bytes_per_s
    one = 2 * a.collective_latency_s + within + across
    assert two.allreduce_seconds(64) == pytest.approx(2 * 80 * one)
    # By hand: 1 MiB (1,048,576 bytes); across, 2 x 1/2 x 1/4 of it (262,144
    # bytes) at 50 GB/s is 5.24288 us; within, 3/2 of it at 450 GB/s 3.49525 us.
    assert math.isclose(across, 5.24288e-6, rel_tol=1e-9)
    assert math.isclose(within, 3.495253e-6, rel_tol=1e-6)
    # The same 8 GPUs in one host pay NVLink only: less per step.
    flat = StepCost.preset("llama-3-70b", "h100", devices=8)
    assert flat.allreduce_seconds(64) < two.allreduce_seconds(64)
    assert two.host_bytes(64) == pytest.approx(2 * 80 * 4 * (2 * 1 / 2 * size / 4))


def test_one_host_is_the_formula_as_before_and_files_keep_their_hosts():
    c = StepCost.preset("llama-3-8b", "h100", devices=2)
    assert c.hosts == 1 and c.host_bytes(100) == 0.0
    a = ACCELERATORS["h100"]
    size = 100 * 4096 * 2
    want = 2 * 32 * (a.collective_latency_s + 2 * 1 / 2 * size / a.interconnect_bytes_per_s)
    assert c.allreduce_seconds(100) == pytest.approx(want)
    two = StepCost.preset("llama-3-8b", "h100", devices=2, hosts=3)
    assert StepCost.from_json(two.to_json()) == two
    with pytest.raises(StepCostError, match="hosts"):
        StepCost.preset("llama-3-8b", "h100", hosts=0)


def test_the_simulator_and_the_cli_take_hosts(capsys):
    arrivals, _ = named_workload("azure", limit=50)
    flat = engine_for(arrivals, model="llama-3-70b", accelerator="h100", devices=8)
    two = engine_for(arrivals, model="llama-3-70b", accelerator="h100", devices=4, hosts=2)
    assert two.config.num_blocks == flat.config.num_blocks
    assert two.cost.seconds(512, 4096) > flat.cost.seconds(512, 4096)
    assert main(["capacity", "--model", "llama-3-70b", "--accelerator", "tpu-v5e",
                 "--devices", "4", "--hosts", "2", "--precision", "int8"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "on 2 hosts x 4 x tpu-v5e" in out and "KV per host" in out
    assert "MB each host sends the others" in out
    assert main(["simulate", "--trace", "azure", "--limit", "30", "--scenarios", "continuous",
                 "--model", "llama-3-70b", "--devices", "4", "--hosts", "2"]) == 0  # fmt: skip
    assert "on 2 hosts x 4 x h100" in capsys.readouterr().out
