"""The extension's Rust heap (mimalloc, rust/heap.rs): its count is what
benches/scaling.py reports as memory, so it has to rise and fall with a scheduler."""

import gc

import kvsched
from kvsched import _core


def test_heap_count_follows_a_scheduler_built_and_dropped():
    before = _core._heap_bytes()
    sched = kvsched.Scheduler(
        kvsched.SchedulerConfig(
            num_blocks=100_000, block_size=16, max_num_seqs=64,
            max_batched_tokens=4096, max_seq_len=4096,
        )
    )  # fmt: skip
    built = _core._heap_bytes()
    assert built - before > 100_000 * 4  # at least a word per page
    del sched
    gc.collect()
    assert _core._heap_bytes() - before < (built - before) // 100
