"""The examples run as tests, so the README's commands keep working."""

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_accounts_for_every_request(capsys):
    table = load("quickstart").main(seed=1, n_requests=200)
    ended = sum(row["finished"] + sum(row["rejected"].values()) for row in table.values())
    assert ended == 200, "every request ends finished or rejected with a reason"
    assert all(row["finished"] > 0 for row in table.values())
    # The top tier's requests wait least for their first token.
    assert table["chat"]["ttft_p50"] < table["batch"]["ttft_p50"]
    # chat's shared system prompt is served from the prefix cache after the first.
    assert table["chat"]["cached_share"] > 0.3
    assert table["batch"]["cached_share"] == 0.0
    assert "TTFT p50/p99" in capsys.readouterr().out


def test_quickstart_says_which_rungs_of_the_ladder_engaged_and_if_they_were_released(capsys):
    """The ladder line names each rung that engaged (a rung of the default
    ladder) and how often, and whether all were released by the end; a load that
    never needs the ladder says so."""
    import re

    import kvsched

    config = kvsched.SchedulerConfig(num_blocks=129, block_size=16, ladder="default")
    rungs = {r["action"] for r in kvsched.Scheduler(config).stats()["ladder"]["rungs"]}
    quickstart = load("quickstart")
    quickstart.main(seed=1, n_requests=200)  # an overload: the ladder climbs
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "ladder" in x]
    shown = re.fullmatch(r"degradation ladder: (.+); (all released by the end|"
                         r"still \d+ rung\(s\) up at the end)", line)  # fmt: skip
    assert shown, line
    for part in shown[1].split(", "):
        engaged = re.fullmatch(r"(\w+) engaged (\d+) time\(s\)", part)
        assert engaged and engaged[1] in rungs and int(engaged[2]) >= 1, part
    quickstart.main(seed=1, n_requests=10)  # a light load
    lines = capsys.readouterr().out.splitlines()
    assert [x for x in lines if "ladder" in x] == ["degradation ladder: never engaged"]


@pytest.mark.slow
@pytest.mark.parametrize("overlap", ["auto", "on"])
def test_the_example_engine_accounts_for_every_request_and_never_recompiles(overlap):
    """On CPU the example runs its steps in turn unless asked (`--overlap
    auto`: the model step runs on the host's own cores); overlapped, alike."""
    import pytest

    pytest.importorskip("jax")
    table = load("engine").main(["--model", "tiny", "--requests", "40", "--seconds", "1.5",
                                 "--overlap", overlap, "--quiet"])  # fmt: skip
    run = table.pop("_run")
    assert run["overlap"] == (overlap == "on")
    ended = sum(row["finished"] + sum(row["rejected"].values()) for row in table.values())
    assert ended == 40
    assert run["programs_after"] == run["programs"], "nothing compiled after warmup"
    assert table["chat"]["cached_share"] > 0.3, "chat's system prompt is served from the cache"


@pytest.mark.slow
@pytest.mark.model
def test_the_main_job_serves_the_real_model_in_real_text_and_prints_what_the_readme_shows(
    capsys,
):
    """The README's first command as it stands (`python examples/engine.py`): every
    request ends, real answers, and its output is the README's, line by line
    (figures aside)."""
    import pytest

    from readme_output import assert_shows, text_block

    pytest.importorskip("jax")
    pytest.importorskip("gguf")
    from smollm2_helpers import smollm2_file

    smollm2_file()  # skips with the reason when the model cannot be fetched
    table = load("engine").main([])
    assert_shows(text_block("loaded SmolLM2"), capsys.readouterr().out)
    run = table.pop("_run")
    ended = sum(row["finished"] + sum(row["rejected"].values()) for row in table.values())
    assert ended == 24, "every request ends finished or refused with a reason"
    assert run["programs_after"] == run["programs"]
    texts, labels = run["texts"], run["labels"]
    assert set(run["ended"]) == set(texts), "every admitted request's stream ended"
    for rid, (tenant, question) in labels.items():
        words = texts[rid].split()
        assert len(words) >= 3, (tenant, question, texts[rid])
        if "capital of France" in question:
            assert "Paris" in texts[rid]
    # digest's stop string ("\n") ends its summaries at the first line break.
    assert all("\n" not in texts[r] for r, (t, _) in labels.items() if t == "digest")


@pytest.mark.slow
@pytest.mark.gemma
def test_the_main_job_serves_gemma3_in_kv_cache_groups():
    """`python examples/engine.py --model gemma3`: Gemma 3 270M, its window and
    global layers in KV-cache groups, answers every tenant in real text."""
    import pytest

    pytest.importorskip("jax")
    pytest.importorskip("gguf")
    from gemma3_helpers import gemma3_file

    gemma3_file()  # skips with the reason when the model cannot be fetched
    table = load("engine").main(["--model", "gemma3", "--requests", "4", "--quiet"])
    run = table.pop("_run")
    ended = sum(row["finished"] + sum(row["rejected"].values()) for row in table.values())
    assert ended == 4 and run["programs_after"] == run["programs"]
    # Real text: most answers are several words (a short answer is one).
    texts = [t for t in run["texts"].values() if len(t.split()) >= 3]
    assert len(texts) >= 3, run["texts"]


@pytest.mark.slow
def test_the_gpu_check_script_runs_its_checks_in_the_interpreter(capsys):
    import pytest

    pytest.importorskip("jax")
    spec = importlib.util.spec_from_file_location(
        "gpu_check", EXAMPLES.parent / "benches" / "gpu_check.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.main(["--interpret"])
    assert out["ran"] and out["ok"] and out["max_error"] < 1e-2
    # One real mixed plan, and the decode table with the cost model's columns.
    text = capsys.readouterr().out
    assert out["mixed"] and "a mixed one" in text
    kernel = next(line.split() for line in text.splitlines() if "pallas_gpu" in line)
    assert kernel[3].endswith("%") and kernel[5].endswith("%") and kernel[6] == "latency"
    assert 0 < out["model_share"] < 1 and out["model_s"] > 0


@pytest.mark.slow
@pytest.mark.model
def test_the_embedding_example_streams_real_answers_over_its_socket():
    import asyncio

    import pytest

    pytest.importorskip("jax")
    pytest.importorskip("gguf")
    from smollm2_helpers import smollm2_file

    smollm2_file()  # skips with the reason when the model cannot be fetched
    example = load("embed_async")
    ae, gg = example.build("smollm2")

    async def talk() -> list[str]:
        server = await example.serve(ae, gg, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answers = []
        for q in ("What is the capital of France?", "Name a colour."):
            writer.write(q.encode() + b"\n")
            answers.append((await asyncio.wait_for(reader.readuntil(b"\n\n"), 60)).decode())
        writer.close()
        server.close()
        await server.wait_closed()
        return answers

    try:
        answers = asyncio.run(talk())
    finally:
        ae.stop()
    assert "Paris" in answers[0]
    assert len(answers[1].split()) >= 1
    assert ae.scheduler.live_requests == 0
