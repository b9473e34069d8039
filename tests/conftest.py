"""Shared test set-up: hypothesis profiles, and slow marks given by name
(`SLOW_ELSEWHERE`): one case of a parametrized test, which a decorator cannot
mark alone, and the slow tests of the attention-kernel files, marked from here.

`ci` (the default) keeps the suite within CI's budget on 2 cores; run the long one
with KVSCHED_HYPOTHESIS=long for a deeper search.

The tiers (markers registered in pyproject.toml; --strict-markers refuses others):

    pytest -m "not slow" tests benches      # the quick tier
    pytest -m "not slow and not model and not subprocess" tests benches
    pytest tests benches --benchmark-disable -n 2 -m "not alone"  # .ci/run: everything,
    pytest tests benches --benchmark-disable -m alone              # in two passes

`slow` tests take more than a few seconds each (4 s or more in a full run on a
shared 2-core machine); `model` tests need the real SmolLM2 GGUF; `subprocess`
tests start other processes; an `alone` test times the machine: .ci/run runs
those in a pass of their own, and under pytest-xdist none runs beside another test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("long", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("KVSCHED_HYPOTHESIS", "ci"))

# The slow tests of the attention-kernel test files, marked here by name: a test
# function's name (every parametrization), or a name with its [parameters] for
# one case of a parametrized test (which a decorator cannot mark alone).
# tests/test_markers.py checks that each name is still a test of its file.
SLOW_ELSEWHERE: dict[str, set[str]] = {
    "test_engine_attention.py": {
        "test_gpu_query_blocks_never_straddle_sequences_and_cover_every_row_once",
        "test_pallas_matches_the_reference_on_mixed_plans",
        "test_the_gpu_kernel_matches_jaxs_gpu_paged_attention_on_decode",
        "test_the_gpu_kernel_matches_the_reference_per_dtype",
        "test_the_gpu_kernel_with_split_kv_matches_the_reference",
        "test_tpu_v2_decode_path_matches_jaxs_tpu_decode_kernel",
        "test_tpu_v2_matches_the_reference_at_tpu_page_sizes",
        "test_tpu_v2_matches_the_reference_on_mixed_plans",
        "test_tpu_v2_prefetch_chain_crosses_grid_steps",
        "test_tpu_v2_reads_the_packed_layout_and_a_stacked_cache",
    },
    "test_engine_jax_backend.py": {
        "test_jax_backend_in_bfloat16_on_a_mixed_plan",
        "test_jax_backend_matches_our_reference_on_mixed_plans",
        "test_jax_reference_is_what_the_backend_runs_off_tpu",
        "test_the_engine_generates_the_same_greedy_tokens_as_the_reference_backend",
        "test_the_jax_kernel_in_the_tpu_interpreter_on_one_small_plan",
    },
    "test_kernel_cost.py": {
        "test_tpu_v2_counts_are_what_it_does_in_the_interpreter",
    },
    "test_tpu_head_dim.py": {
        "test_a_layer_of_the_stacked_caches_equals_that_layer_sliced[16-split]",
        "test_head_dims_match_the_reference_on_mixed_plans[9-3-64-packed-8-float32-2e-05]",
        "test_head_dims_match_the_reference_on_mixed_plans[4-2-256-split-8-float32-2e-05]",
        "test_head_dims_match_the_reference_on_mixed_plans[4-4-64-packed-16-float32-2e-05]",
    },
}


@pytest.hookimpl(trylast=True)  # after the tmp_path plugin's
def pytest_configure(config: pytest.Config) -> None:
    """One persistent JAX compilation cache for the whole run, unless the caller
    set one: many tests build engines of the same shapes, and each Engine jits
    its own step, so without it every one compiles the same programs again.
    pytest-xdist's workers, and the processes tests start, inherit it from
    this process's environment. A size limit makes JAX lock the folder around
    each read and write (filelock), so that workers never read an entry half
    written. It lives in this run's temporary folder."""
    if _is_worker(config) or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    try:
        import filelock  # noqa: F401 - what JAX locks the folder with
    except ImportError:
        return
    factory: pytest.TempPathFactory = config._tmp_path_factory  # type: ignore[attr-defined]
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(factory.getbasetemp() / "jax-cache")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        names = SLOW_ELSEWHERE.get(item.path.name)
        if names and (item.name in names or getattr(item, "originalname", None) in names):
            item.add_marker(pytest.mark.slow)
    if _is_worker(config):
        # With workers (pytest-xdist, .ci/run's -n 2, handing out one test at a
        # time), the longest tests start first, so none starts last on one worker
        # while the other idles: slow tests of the real models (the peer checks,
        # the examples), then other slow tests, then the rest, each group in
        # file order (a stable sort). Tests marked `alone` come last: one waits
        # for the other worker's current test to end, short by then (first, it
        # waited minutes behind a peer check, idle). Keeping a file's tests
        # together (its module fixtures made once) made the run slower: 31 min
        # against 27, the real-model tests overlapping longer. The workers
        # collect, and sort alike.
        items.sort(key=lambda item: 3 if _alone(item) else _weight(item))


def _is_worker(config: pytest.Config) -> bool:
    """A pytest-xdist worker's session (not one a test started: the variable
    pytest-xdist sets is inherited by child processes, its config entry not)."""
    return hasattr(config, "workerinput")


def _alone(item: pytest.Item) -> bool:
    return item.get_closest_marker("alone") is not None


def _weight(item: pytest.Item) -> int:
    marks = {m.name for m in item.iter_markers()}
    if "slow" not in marks:
        return 2
    return 0 if marks & {"model", "gemma"} else 1


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    """Under pytest-xdist, a test marked `alone` (one that times the machine:
    calibration, the overlap benchmark's idle shares) runs while no other worker
    runs a test: every test (benches' included), from its fixtures' set-up to
    their teardown, holds a shared lock on one file of this run, an `alone` test
    the exclusive one. A second file is a turnstile each test passes through
    exclusively to ask for its lock, so a waiting `alone` test is not starved by
    other workers' shared locks overlapping. Without workers, nothing to do."""
    if not _is_worker(item.config):
        return (yield)
    import fcntl  # POSIX, as the machines this suite runs on are

    # The workers' temporary folders share this run's parent (pytest removes old ones).
    factory: pytest.TempPathFactory = item.config._tmp_path_factory  # type: ignore[attr-defined]
    run = factory.getbasetemp().parent
    alone = _alone(item)
    with open(run / "alone.lock", "a") as lock:
        with open(run / "alone.turnstile", "a") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        return (yield)
