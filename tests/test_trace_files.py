"""Any trace: the generic CSV / JSON-lines reader, arrivals drawn at a rate,
`kvsched.sim.file_workload`, `kvsched simulate --trace-path FILE` and the
table's SLO columns."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

import kvsched
from kvsched.cli import main
from kvsched.sim import file_workload, scenarios, workloads
from kvsched.sim.setup import engine_for, parse_tiers
from kvsched.sim.simulator import simulate
from kvsched.sim.slo import attainment, parse_slos
from kvsched.sim.traces import TraceError, read_mooncake, read_requests

DATA = Path(__file__).resolve().parent / "data"


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_csv_and_json_lines_read_the_same_requests(tmp_path):
    csv = write(tmp_path / "t.csv", "prompt_tokens,output_tokens,arrival_s,tenant,extra\n"
                "100,10,5.5,chat,x\n" "2000,4,2.5,docs,y\n" "300,30,2.5,chat,z\n")  # fmt: skip
    rows = [
        {"prompt_tokens": 100, "output_tokens": 10, "arrival_s": 5.5, "tenant": "chat"},
        {"prompt_tokens": 2000, "output_tokens": 4, "arrival_s": 2.5, "tenant": "docs"},
        {"prompt_tokens": 300, "output_tokens": 30, "arrival_s": 2.5, "tenant": "chat"},
    ]
    jsonl = tmp_path / "t.jsonl.gz"
    with gzip.open(jsonl, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    a, b, c = read_requests(csv), read_requests(str(jsonl)), read_requests(rows)
    key = [(r.prompt_tokens, r.output_tokens, r.arrival_s, r.tenant) for r in a]
    # Sorted by arrival (stable: equal times keep file order), the first at 0 s.
    assert key == [(2000, 4, 0.0, "docs"), (300, 30, 0.0, "chat"), (100, 10, 3.0, "chat")]
    assert key == [(r.prompt_tokens, r.output_tokens, r.arrival_s, r.tenant) for r in b]
    assert key == [(r.prompt_tokens, r.output_tokens, r.arrival_s, r.tenant) for r in c]
    assert [r.line for r in a] == [3, 4, 2]  # where each was read
    # A spreadsheet's byte-order mark is not part of the first column's name.
    bom = tmp_path / "bom.csv"
    bom.write_bytes("prompt_tokens,output_tokens\n7,5\n".encode("utf-8-sig"))
    assert read_requests(str(bom))[0].prompt_tokens == 7
    # No tenant column: one tenant, "default"; no arrival_s: None (a rate is needed).
    plain = read_requests(write(tmp_path / "p.csv", "output_tokens,prompt_tokens\n5,7\n"))
    assert plain[0].tenant == "default" and plain[0].arrival_s is None
    assert (plain[0].prompt_tokens, plain[0].output_tokens) == (7, 5)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("prompt_tokens,arrival_s\n5,0\n", "line 1, column 'output_tokens': missing"),
        ("prompt_tokens,output_tokens\n5,3\n-5,3\n", "line 3, column 'prompt_tokens'"),
        ("prompt_tokens,output_tokens\n5,2.5\n", "line 2, column 'output_tokens'"),
        ("prompt_tokens,output_tokens\n5,0\n", "line 2, column 'output_tokens'"),
        ("prompt_tokens,output_tokens\nabc,3\n", "line 2, column 'prompt_tokens'"),
        ("prompt_tokens,output_tokens,arrival_s\n5,3,-1\n", "line 2, column 'arrival_s'"),
        ("prompt_tokens,output_tokens,arrival_s\n5,3,nan\n", "line 2, column 'arrival_s'"),
        ("prompt_tokens,output_tokens,arrival_s\n5,3,1\n5,3,\n", "line 3, column 'arrival_s'"),
        ("prompt_tokens,output_tokens,hash_ids\n600,3,[1]\n", "line 2, column 'hash_ids'"),
        ("prompt_tokens,output_tokens,hash_ids\n6,3,1 x\n", "line 2, column 'hash_ids'"),
        ("prompt_tokens,output_tokens\n5,3,9\n", "line 2: 3 fields"),
        ("prompt_tokens,output_tokens\n", "no requests"),
    ],
)
def test_a_bad_csv_names_the_line_and_column(tmp_path, text, where):
    path = write(tmp_path / "bad.csv", text)
    with pytest.raises(TraceError, match=where) as e:
        read_requests(path)
    assert "bad.csv" in str(e.value)


def test_a_bad_json_line_names_the_line_and_column(tmp_path):
    good = '{"prompt_tokens": 5, "output_tokens": 3}\n'
    cases = {
        good + "\n" + '{"prompt_tokens": 5}\n': "line 3, column 'output_tokens': missing",
        good + '{"prompt_tokens": 5, "output_tokens": 3.5}\n': "line 2, column 'output_tokens'",
        good + '{"prompt_tokens": true, "output_tokens": 3}\n': "line 2, column 'prompt_tokens'",
        good + '{"prompt_tokens": 5, "output_tokens": 3, "tenant": 7}\n': "line 2, column 'tenant'",
        good + "{oops\n": "line 2: not JSON",
        good + "[5, 3]\n": "line 2: expected a JSON object",
        "\n[" + good + "]\n": "line 2: a JSON array; expected JSON lines",
    }
    for text, where in cases.items():
        with pytest.raises(TraceError, match=where):
            read_requests(write(tmp_path / "bad.jsonl", text))
    assert len(read_requests(write(tmp_path / "ok.jsonl", good + good))) == 2
    with pytest.raises(TraceError, match="record 2, column 'prompt_tokens'"):
        read_requests([{"prompt_tokens": 1, "output_tokens": 1}, {"output_tokens": 1}])


def test_hash_ids_give_the_mooncake_prompts(tmp_path):
    """A Mooncake excerpt rewritten as a generic trace: the same prompts token for
    token (512-token blocks; a shared id, a shared prefix) and the same arrivals."""
    src = read_mooncake(DATA / "mooncake_head600.jsonl", limit=40)
    path = tmp_path / "m.jsonl"
    lines = [
        {"arrival_s": r.arrival, "prompt_tokens": r.input_length,
         "output_tokens": r.output_length, "hash_ids": list(r.hash_ids)}
        for r in src
    ]  # fmt: skip
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    mine, _ = file_workload(str(path))
    theirs = workloads.mooncake(src)
    assert len(mine) == len(theirs) == 40
    for a, b in zip(mine, theirs, strict=True):
        assert a.at == b.at and a.max_tokens == b.max_tokens
        assert np.array_equal(a.prompt, b.prompt)
    # In CSV, a list as "[1, 2]" or "1 2"; both give the same tokens.
    csv = write(tmp_path / "h.csv", 'prompt_tokens,output_tokens,hash_ids\n600,1,"[7, 8]"\n'
                "600,1,7 8\n520,1,7 9\n")  # fmt: skip
    a, b, c = (x.prompt for x in file_workload(csv, rate=1.0)[0])
    assert np.array_equal(a, b) and np.array_equal(a[:512], c[:512]) and len(c) == 520
    assert not np.array_equal(a[512:520], c[512:])


def test_arrival_times_at_a_rate_and_burstiness():
    for b in (1.0, 3.0, 0.5):
        t = workloads.arrival_times(20_000, 5.0, burstiness=b, seed=1)
        gaps = np.diff(np.concatenate([[0.0], t]))
        assert np.all(gaps >= 0)
        assert abs(gaps.mean() - 0.2) < 0.2 * (0.03 * b + 0.01)  # 5 requests/s
        assert abs(gaps.std() / gaps.mean() - b) < 0.06 * b  # the coefficient of variation
    again = workloads.arrival_times(50, 5.0, seed=1)
    assert np.array_equal(again, workloads.arrival_times(50, 5.0, seed=1))
    for bad in ({"rate": 0.0}, {"rate": float("nan")}, {"rate": 1.0, "burstiness": 0.0}):
        with pytest.raises(ValueError, match="rate|burstiness"):
            workloads.arrival_times(10, **bad)


def test_file_workload_from_records_in_memory():
    records = [{"prompt_tokens": 64 + i, "output_tokens": 8, "tenant": "ab"[i % 2]}
               for i in range(40)]  # fmt: skip
    arrivals, tenants = file_workload(records, rate=4.0, tiers={"b": 1})
    assert [(t.name, t.tier) for t in tenants] == [("a", 0), ("b", 1)]
    assert [len(a.prompt) for a in arrivals] == [64 + i for i in range(40)]
    faster, _ = file_workload(records, rate=4.0, load=2.0)
    assert [x.at for x in faster] == pytest.approx([a.at / 2 for a in arrivals])
    with pytest.raises(ValueError, match="no arrival_s"):
        file_workload(records)
    with pytest.raises(ValueError, match="give rate= too"):
        file_workload(records, burstiness=2.0)
    with pytest.raises(ValueError, match="'c', not a tenant"):
        file_workload(records, rate=1.0, tiers={"c": 1})
    assert parse_tiers(["a=0", " b = 2"]) == {"a": 0, "b": 2}
    for bad in (["a"], ["a=-1"], ["a=x"], ["=1"], ["a=1", "a=2"]):
        with pytest.raises(ValueError, match="tier"):
            parse_tiers(bad)


def test_kvsched_simulate_reads_any_trace(tmp_path, capsys):
    rows = "".join(f"{200 + 50 * i},{16 + i},{'ab'[i % 2]}\n" for i in range(30))
    path = write(tmp_path / "mine.csv", "prompt_tokens,output_tokens,tenant\n" + rows)
    assert main(["simulate", "--trace-path", path, "--rate", "3", "--burstiness", "2",
                 "--tier", "b=1", "--scenarios", "continuous",
                 "--slo", "a:ttft=0.5", "--slo", "*:ttft=10,itl=1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "30 requests (mine.csv)" in out and "a (tier 0), b (tier 1)" in out
    assert "gamma gaps of CV 2, seed 0" in out and "SLO met" in out and "goodput r/s" in out
    # Told apart from --trace azure --trace-path (that trace's format): no --trace here.
    assert main(["simulate", "--trace-path", path, "--scenarios", "continuous"]) == 2
    assert "no arrival_s" in capsys.readouterr().err
    assert main(["simulate", "--trace", "azure", "--trace-path", path, "--rate", "3"]) == 2
    assert "--rate applies to a generic trace" in capsys.readouterr().err
    assert main(["simulate", "--trace-path", path, "--rate", "3", "--slo", "c:ttft=1"]) == 2
    assert "'c', not a tenant" in capsys.readouterr().err
    assert main(["simulate", "--trace", "azure", "--hash-block", "16"]) == 2
    assert "--hash-block applies to a generic trace" in capsys.readouterr().err
    assert main(["simulate", "--trace-path", path, "--burstiness", "2"]) == 2
    assert "give --rate too" in capsys.readouterr().err
    # The Azure trace given without --trace azure: read as generic, and told so.
    assert main(["simulate", "--trace-path", str(DATA / "azure_code_head400.csv")]) == 2
    assert "Azure trace's format: --trace azure --trace-path" in capsys.readouterr().err
    mooncake = str(DATA / "mooncake_head600.jsonl")
    assert main(["simulate", "--trace-path", mooncake, "--limit", "5"]) == 2
    assert "Mooncake trace's format: --trace mooncake" in capsys.readouterr().err
    bad = write(tmp_path / "bad.csv", "prompt_tokens,output_tokens\n10,-2\n")
    assert main(["simulate", "--trace-path", bad, "--rate", "3"]) == 2
    assert "line 2, column 'output_tokens'" in capsys.readouterr().err


def test_the_table_shows_slo_attainment_and_goodput():
    records = [{"prompt_tokens": 3000 if i % 3 == 0 else 100, "output_tokens": 40,
                "tenant": "docs" if i % 3 == 0 else "chat"} for i in range(60)]  # fmt: skip
    arrivals, tenants = file_workload(records, rate=20.0)
    engine = engine_for(arrivals)
    r = simulate(engine.config, tenants, arrivals, engine.cost, name="continuous")
    slos = parse_slos(["chat:ttft=0.05,itl=0.02"])
    att = attainment(r, slos)["chat"]
    assert 0 < att.met < att.offered  # a case that misses some
    text = scenarios.table([r], slos)
    row = next(line for line in text.splitlines() if line.startswith("continuous  chat"))
    assert f"{att.share:.1%}" in row and f"{att.goodput_rps:.3f}" in row
    missed = {c: k for c, k in att.misses.items() if k}
    assert str(missed) in row
    docs = next(line for line in text.splitlines() if "docs" in line and "continuous" in line)
    assert docs.endswith("; no SLO")
    assert "SLO met" not in scenarios.table([r])  # without SLOs, the table as before
    assert kvsched.sim.file_workload is file_workload
