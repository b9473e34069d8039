"""The simulator on small workloads: the comparisons it exists to make."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvsched
from kvsched.sim import scenarios, workloads
from kvsched.sim.simulator import StepCost, simulate
from kvsched.sim.traces import read_azure

COST = StepCost.preset("llama-3-8b", "h100")
DATA = Path(__file__).parent / "data"


def test_the_step_cost_is_compute_bound_for_prefill_and_memory_bound_for_decode():
    one = COST.seconds(1, 1000) - COST.overhead_s
    weights_read = 8.03e9 * 2 / (3.35e12 * 0.8)
    assert one == pytest.approx(weights_read + 1000 * 131_072 / (3.35e12 * 0.8))
    big = COST.seconds(8192, 8192) - COST.overhead_s
    assert big == pytest.approx(8192 * 2 * 8.03e9 / (989e12 * 0.5))


def mixed():
    base = kvsched.SchedulerConfig(
        num_blocks=20001, block_size=16, max_num_seqs=64, max_batched_tokens=2048,
        max_seq_len=32768, long_prefill_chunk=2048, max_waiting=256,
    )  # fmt: skip
    arrivals = workloads.prefill_vs_decode(seconds=20, long_rate=1.0)
    tenants = [kvsched.TenantConfig("chat", tier=0), kvsched.TenantConfig("docs", tier=1)]
    return base, arrivals, tenants


def test_continuous_batching_beats_static_at_the_same_batch_cap():
    base, arrivals, tenants = mixed()
    cont, static = scenarios.run(base, tenants, arrivals, COST,
                                 [scenarios.Scenario("continuous"),
                                  scenarios.Scenario("static", static_batching=True)])  # fmt: skip
    assert cont.throughput() > 1.1 * static.throughput()
    assert cont.summary()["chat"]["ttft_p99"] < static.summary()["chat"]["ttft_p99"]


def test_chunked_prefill_lowers_the_decode_tenants_p99_inter_token_time():
    base, arrivals, tenants = mixed()
    chunked, unchunked = scenarios.run(base, tenants, arrivals, COST, [
        scenarios.Scenario("chunked"),
        scenarios.Scenario("unchunked", {"long_prefill_chunk": 32768, "max_batched_tokens": 32768}),
    ])  # fmt: skip
    # A 30k-token prompt in one step stalls every decode for ~1 s.
    assert chunked.summary()["chat"]["itl_p99"] < 0.2 < unchunked.summary()["chat"]["itl_p99"]


def test_the_ladder_keeps_tier_0_within_target_under_a_10x_burst():
    base = kvsched.SchedulerConfig(
        num_blocks=1201, block_size=16, max_num_seqs=32, max_batched_tokens=2048,
        max_seq_len=4096, long_prefill_chunk=1024, max_waiting=128, overhead_reserve=0.0,
    )  # fmt: skip
    arrivals = workloads.burst(seconds=40, base_rate=1.5, burst_factor=10, burst=(10, 20),
                               output=256)  # fmt: skip
    tenants = [kvsched.TenantConfig("gold", tier=0), kvsched.TenantConfig("bulk", tier=1)]
    off, on = scenarios.run(base, tenants, arrivals, COST, [
        scenarios.Scenario("no_ladder"), scenarios.Scenario("ladder", {"ladder": "default"}),
    ])  # fmt: skip
    gold_on, gold_off = on.summary()["gold"], off.summary()["gold"]
    assert gold_on["rejected"] == {} and gold_off["rejected"], "without it, gold is refused"
    assert gold_on["ttft_p99"] < 0.1, "tier 0's target: first token within 100 ms"
    assert on.summary()["bulk"]["rejected"].get("shed", 0) > 0
    assert on.stats["ladder"]["rungs"][0]["climbs"] > 0


def test_every_scenario_runs_the_azure_excerpt_without_an_out_of_memory():
    reqs = read_azure(DATA / "azure_code_head400.csv")
    assert len(reqs) == 399 and reqs[0].context_tokens == 4808
    arrivals = workloads.azure(reqs, time_scale=0.25)  # four times the load
    base = kvsched.SchedulerConfig(
        num_blocks=8001, block_size=16, max_num_seqs=64, max_batched_tokens=4096,
        max_seq_len=16384, long_prefill_chunk=2048, max_waiting=128,
    )  # fmt: skip
    tenants = [kvsched.TenantConfig("interactive", tier=0), kvsched.TenantConfig("batch", tier=1)]
    results = scenarios.run(base, tenants, arrivals, COST, scenarios.standard(base))
    for r in results:
        assert r.step_errors == 0, r.name
        ended = sum(
            row["finished"] + row["capped"] + sum(row["rejected"].values())
            for row in r.summary().values()
        )
        assert ended == len(arrivals), f"{r.name}: every request ends finished or rejected"
    text = scenarios.table(results)
    assert "static" in text and "reserve_20%" in text


@pytest.mark.slow
def test_plots_are_written(tmp_path):
    base, arrivals, tenants = mixed()
    res = [simulate(base, tenants, arrivals[:30], COST, name="continuous")]
    paths = scenarios.plot(res, str(tmp_path))
    assert [Path(p).name for p in paths] == ["ttft_cdf.png", "pool_use.png", "ladder_level.png"]
    assert all(Path(p).stat().st_size > 1000 for p in paths)


def test_the_kvsched_command(tmp_path, capsys):
    from kvsched.cli import main

    assert main(["capacity", "--model", "llama-3-8b", "--accelerator", "h100", "--load", "150",
                 "--payg", "10", "--device-hour", "2", "--device-tps", "100",
                 "--engineering-hour", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "131,072 bytes" in out and "26,674 of 16" in out and "self_hosted" in out
    assert main(["capacity", "--model", "llama-3-70b", "--accelerator", "h100"]) == 2
    assert "does not fit" in capsys.readouterr().err
    csv = str(DATA / "azure_code_head400.csv")
    assert main(["simulate", "--trace", "azure", "--trace-path", csv, "--limit", "100",
                 "--scenarios", "continuous,static", "--plots", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "100 requests (azure)" in out and "static" in out and "0 OOM" in out
    assert (tmp_path / "ttft_cdf.png").exists()
    assert main(["simulate", "--scenarios", "nope", "--trace", "burst"]) == 2
    assert main(["simulate", "--trace", "burst", "--chunk", "0"]) == 2  # a typed InvalidConfig
    with pytest.raises(SystemExit):
        main(["capacity", "--model", "llama-3-9b"])


# -- static batching's leftovers, inter-token percentiles, time scale --------------


def test_static_batching_keeps_what_does_not_fit_for_the_next_batch():
    base = kvsched.SchedulerConfig(num_blocks=201, block_size=16, max_num_seqs=16,
                                   max_batched_tokens=2048, max_seq_len=1024,
                                   overhead_reserve=0.0)  # fmt: skip
    arrivals = workloads.burst(seconds=5, base_rate=4, burst_factor=1, gold_rate=0.5)
    tenants = [kvsched.TenantConfig("gold", tier=0), kvsched.TenantConfig("bulk", tier=1)]
    (static,) = scenarios.run(base, tenants, arrivals, COST,
                              [scenarios.Scenario("static", static_batching=True)])  # fmt: skip
    # 200 pages hold 4 of these at once, not 16: every request still runs, in turn.
    assert all(r.outcome == "finished" for r in static.records), static.summary()


def test_inter_token_percentiles_are_exact_gaps():
    base, arrivals, tenants = mixed()
    (r,) = scenarios.run(base, tenants, arrivals[:40], COST, [scenarios.Scenario("c")])
    gaps = sorted(r.gaps["chat"])
    assert r.summary()["chat"]["itl_p99"] == pytest.approx(float(np.percentile(gaps, 99)))
    assert len(gaps) == sum(x.output_len - 1 for x in r.records
                            if x.tenant == "chat" and x.outcome == "finished")  # fmt: skip


def test_time_scale_compresses_synthetic_workloads_too():
    a = workloads.burst(seconds=40)
    b = workloads.scale_time(a, 0.25)
    assert [x.at * 0.25 for x in a] == [x.at for x in b]
    assert len(a) == len(b)


# -- the ladder protects tier 0; capped requests are not "done" ----------------


@pytest.mark.parametrize("load", [3, 10])
def test_the_ladder_is_no_worse_for_tier_0_on_a_squeezed_azure_window(load):
    """The Azure code trace's first 225 s (the excerpt CI has;
    benches/tier0_ladder.py replays a 10-minute window of the full trace) at 3x
    and 10x load, split by prompt length into interactive (tier 0) and batch
    (tier 1), on the scheduler `kvsched simulate` sizes for llama-3-8b on one
    H100. The default ladder's rungs act on the lower tier only: max_running
    and reject_fast rungs that also held tier 0 back raised its p99 TTFT at 10x
    (5.67 s -> 6.40 s)."""
    from kvsched.capacity import capacity

    full = workloads.azure(read_azure(DATA / "azure_code_head400.csv"))
    arrivals = scenarios.squeezed_window(full, 0.0, 240.0, load)
    longest = max(len(a.prompt) + a.max_tokens for a in arrivals)
    base = capacity(
        "llama-3-8b", "h100", context=max(8192, -(-longest // 16) * 16)
    ).scheduler_config(
        max_num_seqs=128, max_batched_tokens=8192, long_prefill_chunk=2048, max_waiting=512
    )
    tenants = [kvsched.TenantConfig("interactive", tier=0), kvsched.TenantConfig("batch", tier=1)]
    off, on = scenarios.ladder_vs_none(base, tenants, arrivals, COST)
    top_off, top_on = off.summary()["interactive"], on.summary()["interactive"]
    assert top_on["ttft_p99"] <= top_off["ttft_p99"], (top_on, top_off)
    assert sum(top_on["rejected"].values()) <= sum(top_off["rejected"].values())
    assert top_on["capped"] == 0
    # The ladder did act: on the lower tier.
    assert on.summary()["batch"]["rejected"].get("shed", 0) > 0
    assert on.stats["ladder"]["rungs"][0]["climbs"] > 0


def test_capped_requests_are_reported_apart_from_done():
    base = kvsched.SchedulerConfig(num_blocks=1201, block_size=16, max_num_seqs=2,
                                   max_batched_tokens=1024, max_seq_len=2048, max_waiting=64,
                                   ladder=[{"signal": "queue_depth", "engage": 2, "release": 1,
                                            "action": "cap_max_tokens", "value": 16}])  # fmt: skip
    arrivals = workloads.burst(seconds=10, base_rate=4, burst_factor=3, gold_rate=1.0,
                               prompt=128, output=64)  # fmt: skip
    tenants = [kvsched.TenantConfig("gold", tier=0), kvsched.TenantConfig("bulk", tier=1)]
    (r,) = scenarios.run(base, tenants, arrivals, COST, [scenarios.Scenario("capped")])
    gold, bulk = r.summary()["gold"], r.summary()["bulk"]
    assert gold["capped"] == 0 and gold["tokens_short"] == 0, "tier 0 is never capped"
    capped = [x for x in r.records if x.outcome == "capped"]
    assert bulk["capped"] == len(capped) > 0
    assert all(x.tenant == "bulk" and x.output_len == 16 < x.asked_max_tokens for x in capped)
    assert bulk["tokens_short"] == sum(x.asked_max_tokens - 16 for x in capped)
    ended = bulk["finished"] + bulk["capped"] + sum(bulk["rejected"].values())
    assert ended == bulk["requests"]
    assert "capped (short)" in scenarios.table([r])
    assert f"{bulk['capped']} ({bulk['tokens_short']})" in scenarios.table([r])


# -- what the table and plots show ------------------------------------------------


def squeezed_pool():
    """A pool small enough that reserve admission refuses (pool_full), over-commit
    preempts and the default ladder climbs."""
    base = kvsched.SchedulerConfig(num_blocks=201, block_size=16, max_num_seqs=16,
                                   max_batched_tokens=2048, max_seq_len=1024, max_waiting=8,
                                   ladder="default")  # fmt: skip
    arrivals = workloads.burst(seconds=10, base_rate=4, burst_factor=3, gold_rate=1.0,
                               prompt=256, output=256)  # fmt: skip
    tenants = [kvsched.TenantConfig("gold", tier=0), kvsched.TenantConfig("bulk", tier=1)]
    return scenarios.run(base, tenants, arrivals, COST, [
        scenarios.Scenario("reserve"),
        scenarios.Scenario("overcommit", {"admission": "overcommit", "watermark_blocks": 1}),
    ])  # fmt: skip


def test_the_table_shows_promised_pages_beside_used_and_preemptions():
    reserve, over = squeezed_pool()
    assert reserve.summary()["bulk"]["rejected"]["pool_full"] > 0
    sh = reserve.pool_shares()
    # Reserve admission refuses on promised pages, not used ones.
    assert sh["promised_mean"] > sh["used_mean"] and sh["promised_peak"] > sh["used_peak"]
    assert over.preemptions == over.stats["preemptions"] > 0
    text = scenarios.table([reserve, over])
    assert f"promised {sh['promised_mean']:.0%}/{sh['promised_peak']:.0%}" in text
    assert f"used {sh['used_mean']:.0%} mean/{sh['used_peak']:.0%} peak" in text
    assert f"{over.preemptions} preempted" in text and "0 preempted" in text


def test_ttft_cdf_counts_a_refusal_as_an_infinite_ttft():
    reserve, _ = squeezed_pool()
    bulk = reserve.summary()["bulk"]
    x, y = reserve.ttft_cdf("bulk")
    served = bulk["finished"] + bulk["capped"]
    assert len(x) == served and served < bulk["requests"]
    assert y[-1] == pytest.approx(served / bulk["requests"]) and y[-1] < 1
    assert list(x) == sorted(x)


def test_plots_label_shares_integer_levels_and_keep_legends_off_the_data():
    import dataclasses

    results = squeezed_pool()
    # A ladder that never climbed: all levels 0 still get integer ticks.
    flat = {**results[0].timeline, "ladder_level": [0.0] * len(results[0].timeline["t"])}
    results.append(dataclasses.replace(results[0], name="no_ladder", timeline=flat))
    figs = scenarios.plot_figures(results)
    try:
        pool = figs["pool_use.png"].axes
        assert len(pool) == len(results), "one panel per scenario"
        for ax in pool:
            assert "share" in ax.get_ylabel() and len(ax.get_lines()) == 2  # used, promised
            assert {ln.get_label() for ln in ax.get_lines()} == {"used", "promised"}
        legend = pool[0].get_legend()
        assert legend is not None and legend.get_bbox_to_anchor().x0 >= pool[0].bbox.x1 - 1
        ladder = figs["ladder_level.png"].axes
        assert any(max(r.timeline["ladder_level"]) > 0 for r in results)
        for ax in ladder:
            lo, hi = ax.get_ylim()
            ticks = [t for t in ax.get_yticks() if lo <= t <= hi]
            assert all(float(t).is_integer() for t in ticks) and 0 in ticks, ticks
        cdf = figs["ttft_cdf.png"]
        assert len(cdf.legends) == 1 and all(ax.get_legend() is None for ax in cdf.axes)
        assert all("offered" in ax.get_ylabel() for ax in cdf.axes)
    finally:
        import matplotlib.pyplot as plt

        plt.close("all")


def test_the_readmes_chunked_prefill_claim_reproduces_from_the_cli(capsys):
    from kvsched.cli import main

    assert main(["simulate", "--trace", "prefill-vs-decode",
                 "--scenarios", "continuous,unchunked"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "step budget 2,048 tokens, prefill chunk 2,048" in out
    assert "ITL p50/p99/p99.9/max (ms)" in out
    rows = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) > 5 and f[1] == "chat":
            rows[f[0]] = [float(x) for x in f[6].split("/")]  # p50/p99/p99.9/max, ms
    chunked, unchunked = rows["continuous"], rows["unchunked"]
    assert chunked[1] < 100 < 800 < unchunked[1]
    assert chunked[3] < 100 < unchunked[3]
    docs = (Path(__file__).resolve().parents[1] / "docs" / "capacity.md").read_text()
    claim = " ".join(docs.split("On the prefill-heavy mix, ", 1)[1].split("\n\n")[0].split())
    assert "kvsched simulate --trace prefill-vs-decode" in claim
    assert f"p99 and max at {chunked[1]:.1f} ms" in claim and chunked[1] == chunked[3]
    assert f"stalls it {unchunked[3]:.1f} ms (p99 = max)" in claim
    assert unchunked[1] == unchunked[3]
    assert f"({chunked[0]:.1f} ms against {unchunked[0]:.1f} ms" in claim
    assert main(["simulate", "--trace", "prefill-vs-decode", "--scenarios", "continuous",
                 "--max-batched-tokens", "8192"]) == 0  # fmt: skip
    line = next(x for x in capsys.readouterr().out.splitlines() if x.split()[1:2] == ["chat"])
    big = float(line.split()[6].split("/")[3])
    assert f"`--max-batched-tokens 8192` chunked prefill's max is {big:.1f} ms" in claim


def _rows(out: str) -> dict[str, list[str]]:
    """Each scenario's table lines (tenant rows and its (all) line, minus the
    wall time), by scenario name."""
    rows: dict[str, list[str]] = {}
    name = ""
    for line in out.splitlines():
        if "s wall" in line:
            rows[name].append(line.rsplit(",", 1)[0])
        elif line[:1].isalpha() and not line.startswith(("scenario", "pool pages")):
            name = line.split()[0]
            rows.setdefault(name, []).append(line[12:])  # without the name
    return rows


@pytest.mark.slow
def test_scenarios_run_at_a_load_where_they_differ_and_say_so(capsys):
    """The bundled Azure trace whole: at its own rate the reserve scenarios print
    the figures of the default; at the default --load (2x) they differ."""
    from kvsched.cli import main
    from kvsched.sim.setup import DEFAULT_LOAD

    wanted = "continuous,reserve_5%,reserve_20%"
    assert main(["simulate", "--trace", "azure", "--scenarios", "continuous,reserve_5%",
                 "--load", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "load 1x the workload's arrival rate\n" in out
    one = _rows(out)
    # Rows: batch, interactive, (all). At 1x tier 0 gets the same figures.
    assert one["continuous"][1] == one["reserve_5%"][1], "at 1x: the same figures"
    assert DEFAULT_LOAD["azure"] == 2.0
    assert main(["simulate", "--trace", "azure", "--scenarios", wanted]) == 0
    out = capsys.readouterr().out
    assert "load 2x the workload's arrival rate (the default for this trace" in out
    two = _rows(out)
    assert two["continuous"][1] != two["reserve_5%"][1] != two["reserve_20%"][1]
    assert "pool_full" in two["continuous"][1], "the pool is under pressure"
    # --load 2 is --time-scale 0.5: the same arrivals.
    assert main(["simulate", "--trace", "azure", "--scenarios", "reserve_20%",
                 "--load", "1", "--time-scale", "0.5"]) == 0  # fmt: skip
    assert _rows(capsys.readouterr().out)["reserve_20%"] == two["reserve_20%"]
    for bad in ("0", "-1", "nan"):
        assert main(["simulate", "--trace", "burst", "--load", bad]) == 2
        assert "--load" in capsys.readouterr().err
