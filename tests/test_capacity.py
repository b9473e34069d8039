"""Capacity and cost against hand-computed figures."""

from __future__ import annotations

import dataclasses

import pytest

import kvsched
from kvsched.capacity import (
    MODELS,
    CapacityError,
    Prices,
    capacity,
    compare,
    portfolio,
)


@pytest.mark.parametrize(
    ("model", "per_token"),
    [
        ("llama-3-8b", 131_072),  # 2 x 32 layers x 8 heads x 128 x 2 bytes
        ("llama-3-70b", 327_680),  # 2 x 80 x 8 x 128 x 2
        ("qwen2.5-7b", 57_344),  # 2 x 28 x 4 x 128 x 2
        ("gemma-2-9b", 344_064),  # 2 x 42 x 8 x 256 x 2
        ("gemma-2-27b", 376_832),  # 2 x 46 x 16 x 128 x 2
        ("mistral-7b", 131_072),
    ],
)
def test_kv_bytes_per_token(model, per_token):
    assert MODELS[model].kv_bytes_per_token(2) == per_token
    assert MODELS[model].kv_bytes_per_token(1) == per_token / 2  # an 8-bit KV cache


def test_llama_3_8b_on_one_h100():
    c = capacity("llama-3-8b", "h100", context=8192)
    assert c.weight_bytes == 16.06e9
    assert c.usable_kv_bytes == pytest.approx(80e9 * 0.9 - 16.06e9)
    assert c.kv_blocks == int((80e9 * 0.9 - 16.06e9) // (131_072 * 16)) == 26_674
    assert c.kv_tokens == 26_674 * 16
    assert c.max_concurrent_seqs == 26_674 // 512 == 52
    cfg = c.scheduler_config()
    assert (cfg.num_blocks, cfg.block_size, cfg.max_seq_len, cfg.max_num_seqs) == (
        26_675, 16, 8192, 52
    )  # fmt: skip
    assert kvsched.Scheduler(cfg).stats(now=0.0)["pool"]["usable"] == 26_674


def test_int4_weights_and_tensor_parallelism_as_one_big_device():
    with pytest.raises(CapacityError, match="does not fit"):
        capacity("llama-3-70b", "h100")  # 141 GB of bf16 weights in 72 GB
    tp = capacity("llama-3-70b", "h100", devices=4)
    assert tp.usable_kv_bytes == pytest.approx(4 * 80e9 * 0.9 - 141.2e9)
    int4 = capacity("llama-3-70b", "h100", precision="int4")
    assert int4.weight_bytes == 70.6e9 * 0.5
    with pytest.raises(CapacityError, match="precision"):
        capacity("llama-3-8b", "h100", precision="fp3")


PRICES = Prices(
    payg_per_mtok=10.0,
    ptu_per_hour=4.0,
    ptu_tokens_per_s=100.0,
    device_per_hour=2.0,
    device_tokens_per_s=100.0,
    engineering_per_hour=1.0,
)


def test_compare_costs_a_steady_load_three_ways():
    # 150 tok/s: pay-as-you-go 150 x 3600 / 1e6 x 10 = 5.4 $/h; 2 provisioned units
    # 8 $/h at 75%; 2 self-hosted accelerators 4 $/h + 1 $/h engineering.
    opts = {o.name: o for o in compare(150.0, PRICES)}
    assert opts["pay_as_you_go"].per_hour == pytest.approx(5.4)
    assert (opts["provisioned"].per_hour, opts["provisioned"].units) == (8.0, 2)
    assert opts["provisioned"].utilization == pytest.approx(0.75)
    assert opts["self_hosted"].per_hour == 5.0
    assert [o.name for o in compare(150.0, PRICES)][0] == "self_hosted"


def test_ties_go_to_pay_as_you_go_and_self_hosting_needs_an_engineering_cost():
    # 50 tok/s on pay-as-you-go: 1.8 $/h; one device at 0.8 + 1.0 engineering: 1.8 $/h.
    prices = Prices(payg_per_mtok=10.0, device_per_hour=0.8, device_tokens_per_s=100.0,
                    engineering_per_hour=1.0)  # fmt: skip
    assert compare(50.0, prices)[0].name == "pay_as_you_go"
    no_eng = Prices(payg_per_mtok=10.0, device_per_hour=2.0, device_tokens_per_s=100.0)
    with pytest.raises(CapacityError, match="engineering_per_hour"):
        compare(50.0, no_eng)


def test_portfolio_median_floor_with_spill():
    # Hourly load 100, 100, 300 tok/s. All pay-as-you-go: 500 x 0.036 = 18 $.
    # Median floor: 1 device, 3 h x (2 + 1) = 9 $ + 200 tok/s spill x 0.036 = 7.2 $ -> 16.2 $,
    # fully used. At peak: 3 devices, 3 h x (6 + 1) = 21 $, 500 / 900 used.
    got = {p.name: p for p in portfolio([100, 100, 300], PRICES)}
    assert got["all_pay_as_you_go"].cost == pytest.approx(18.0)
    floor = got["median_floor_plus_spill"]
    assert (floor.cost, floor.dedicated_units, floor.utilization) == (pytest.approx(16.2), 1, 1.0)
    peak = got["all_dedicated_at_peak"]
    assert (peak.cost, peak.dedicated_units) == (pytest.approx(21.0), 3)
    assert peak.utilization == pytest.approx(500 / 900)
    assert portfolio([100, 100, 300], PRICES)[0].name == "median_floor_plus_spill"


def test_a_traces_load_over_time_feeds_the_portfolio():
    from kvsched.capacity import load_series

    # Requests at 0 s, 30 s, 70 s of 600, 600 and 1200 tokens -> per minute 20, 20 tok/s.
    series = load_series([0, 30, 70], [600, 600, 1200], bucket_s=60)
    assert series.tolist() == [20.0, 20.0]
    per_minute = portfolio(series, PRICES, hours_per_point=1 / 60)
    payg = next(p for p in per_minute if p.name == "all_pay_as_you_go")
    assert payg.cost == pytest.approx(2400 / 1e6 * 10)  # every token once, at 10 $/Mtok


def test_config_overrides_and_a_context_that_does_not_fit_once():
    c = capacity("llama-3-8b", "h100")
    cfg = c.scheduler_config(max_num_seqs=1024)
    assert cfg.max_batched_tokens >= cfg.max_num_seqs == 1024
    with pytest.raises(CapacityError, match="not one sequence"):
        capacity("llama-3-70b", "h100", devices=2, context=32768)


def test_an_int8_kv_cache_counts_its_scales():
    m = MODELS["llama-3-8b"]
    # int8 elements + one float32 scale per token per KV head, for K and for V:
    # 2 x 32 layers x 8 heads x (128 x 1 + 4) = 67,584 bytes, against 131,072 for bf16.
    assert m.kv_bytes_per_token(kv_dtype="int8") == 2 * 32 * 8 * (128 + 4) == 67_584
    assert m.kv_bytes_per_token(kv_dtype="bf16") == m.kv_bytes_per_token(2) == 131_072
    assert m.kv_bytes_per_token(kv_dtype="float32") == 262_144
    with pytest.raises(CapacityError, match="kv_dtype"):
        m.kv_bytes_per_token(kv_dtype="int3")

    c = capacity("llama-3-8b", "h100", kv_dtype="int8")
    assert c.kv_bytes_per_token == 67_584
    assert c.kv_blocks == int((80e9 * 0.9 - 16.06e9) // (67_584 * 16)) == 51_731
    assert c.max_concurrent_seqs == 51_731 // 512 == 101
    bf16 = capacity("llama-3-8b", "h100")
    assert c.kv_tokens / bf16.kv_tokens == pytest.approx(131_072 / 67_584, rel=1e-3)  # ~1.94x
    # The bare element size still works and knows nothing of scales.
    assert capacity("llama-3-8b", "h100", kv_dtype_bytes=1).kv_bytes_per_token == 65_536
    with pytest.raises(CapacityError, match="not both"):
        capacity("llama-3-8b", "h100", kv_dtype="int8", kv_dtype_bytes=1)


# -- sliding-window layers, the cost table, help text ------------------------------


def test_gemma_2_sliding_window_layers_keep_only_their_window():
    m = MODELS["gemma-2-9b"]
    assert (m.sliding_window, m.sliding_layers, m.layers) == (4096, 21, 42)
    per_layer = 344_064 / 42
    # Within the window every layer keeps every token; past it, 21 layers stop at 4,096.
    assert m.kv_bytes_per_sequence(4096) == 344_064 * 4096
    assert m.kv_bytes_per_sequence(8192) == per_layer * (21 * 8192 + 21 * 4096)
    assert m.kv_bytes_per_sequence(8192) == pytest.approx(0.75 * 344_064 * 8192)
    c = capacity("gemma-2-9b", "h100", context=8192)
    usable = 80e9 * 0.9 - 9.24e9 * 2
    assert c.max_concurrent_seqs == int(usable // (0.75 * 344_064 * 8192)) == 25
    assert c.full_context_seqs == 18  # every layer at 8k: 33% more per sequence
    # kvsched's pages hold every layer: its scheduler gets the full-context figure.
    assert c.scheduler_config().max_num_seqs == 18
    big = capacity("gemma-2-27b", "h100", context=8192)
    assert big.max_concurrent_seqs > big.full_context_seqs
    # Models without sliding windows: unchanged.
    llama = capacity("llama-3-8b", "h100", context=8192)
    assert llama.max_concurrent_seqs == llama.full_context_seqs == 52
    assert MODELS["llama-3-8b"].kv_bytes_per_sequence(8192) == 131_072 * 8192


def test_a_missing_engineering_cost_leaves_self_hosting_out_not_the_table(capsys):
    from kvsched.cli import main

    assert main(["capacity", "--load", "150", "--payg", "10", "--ptu-hour", "4",
                 "--ptu-tps", "100", "--device-hour", "2", "--device-tps", "100"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "pay_as_you_go        5.40 $/h" in out and "provisioned          8.00 $/h" in out
    assert "self_hosted   " not in out
    assert "self_hosted left out: --engineering-hour" in out
    assert "provisioned units: throughput units of --ptu-tps 100 tokens/s each" in out
    # The library still refuses to cost self-hosting without it.
    with pytest.raises(CapacityError, match="engineering_per_hour"):
        compare(150, Prices(10.0, device_per_hour=2.0, device_tokens_per_s=100.0))


def test_the_cost_table_says_where_self_hosted_units_come_from(capsys):
    from kvsched.cli import main

    assert main(["capacity", "--load", "150", "--payg", "10", "--device-hour", "2",
                 "--device-tps", "100", "--engineering-hour", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "self_hosted          5.00 $/h  units    2" in out
    assert "self_hosted units: accelerators (h100) of --device-tps 100 tokens/s each" in out


def test_every_cli_option_has_help_with_its_unit_or_default():
    import argparse
    import re

    from kvsched.cli import build_parser

    unit = re.compile(
        r"tokens|seconds|bytes|\$|count|fraction|tokens/s|\bx\b|requests|port|seed|pages"
    )
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    checked = 0
    for name, parser in sub.choices.items():
        for a in parser._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            where = f"kvsched {name} {'/'.join(a.option_strings)}"
            assert a.help, f"{where}: no help"
            if a.default is not None and a.default is not False:
                assert "default" in a.help, f"{where}: default {a.default!r} not said"
            if a.type in (int, float):
                assert "default" in a.help, f"{where}: no default said"
                assert unit.search(a.help), f"{where}: no unit in {a.help!r}"
            checked += 1
    assert checked > 40


def test_devices_past_the_kv_heads_each_still_hold_a_whole_head():
    """Worked per device, independently of the replica-wide formula: each of n
    devices holds ceil(8 / n) of Llama-3-8B's 8 KV heads, 1/n of the weights, and
    fits floor(its free HBM / its bytes per token) tokens (whole pages of 16)."""
    m = MODELS["llama-3-8b"]
    for n in (1, 2, 4, 8, 16, 32):
        heads = -(-8 // n)
        per_device_token = 2 * 32 * heads * 128 * 2  # K and V, 32 layers, bf16
        free = 80e9 * 0.9 - 8.03e9 * 2 / n
        pages = int(free // (per_device_token * 16))
        c = capacity("llama-3-8b", "h100", devices=n)
        # Within one page of the per-device count (the replica pools its free
        # bytes; a device cannot use another's).
        assert abs(c.kv_blocks - pages) <= 1, (n, c.kv_blocks, pages)
        assert c.kv_bytes_per_token == n * per_device_token
    assert m.kv_copies(8) == 1.0 and m.kv_copies(16) == 2.0 and m.kv_copies(3) == 9 / 8
    # SmolLM2's 3 KV heads over 2 devices: 2 each, 4 stored.
    assert MODELS["smollm2-135m"].kv_copies(2) == 4 / 3
    # Hosts count as devices of the one replica.
    assert (capacity("llama-3-70b", "h100", devices=8, hosts=2).kv_bytes_per_token
            == 2 * MODELS["llama-3-70b"].kv_bytes_per_token(2))  # fmt: skip


def test_a_device_count_the_model_cannot_split_over_is_refused_with_the_counts_that_can():
    """Tensor parallelism splits the query heads and the MLP evenly, and the KV
    heads evenly or in whole copies: other counts were priced as if they ran."""
    cases = [
        (
            "llama-3-8b",
            3,
            1,
            r"query heads \(32\) cannot split evenly over 3 ",
            "1, 2, 4, 8, 16, 32",
        ),
        ("qwen2.5-7b", 8, 1, r"query heads \(28\) cannot split evenly over 8 ", "1, 2, 4)"),
        # 28 devices would split the heads (7 copies of each KV head), not the MLP.
        ("qwen2.5-7b", 14, 2, r"MLP width \(18944\) cannot split evenly over 28 ", "1, 2, 4)"),
        ("smollm2-135m", 2, 1, r"query heads \(9\) cannot split evenly over 2 ", "1, 3)"),
        ("llama-3-70b", 3, 4, r"query heads \(64\) cannot split evenly over 12 ", "32, 64"),
    ]
    for model, devices, hosts, why, counts in cases:
        with pytest.raises(CapacityError, match=why) as e:
            capacity(model, "h100", devices=devices, hosts=hosts)
        assert counts in str(e.value), e.value
    # Past the KV heads in whole copies runs, and so does an unknown shape.
    assert MODELS["llama-3-70b"].tensor_parallel_error(16) is None
    assert MODELS["gemma-2-27b"].tensor_parallel_error(32) is None
    unknown = dataclasses.replace(MODELS["llama-3-8b"], query_heads=0, ffn=0)
    assert unknown.tensor_parallel_error(24) is None  # 3 copies of each KV head
    six = dataclasses.replace(MODELS["llama-3-8b"], kv_heads=6, query_heads=0, ffn=0)
    assert "6 KV heads neither split over 4" in (six.tensor_parallel_error(4) or "")
