"""BlockPool through the Python API: batch calls, refcounts, typed errors."""

import numpy as np
import pytest

import kvsched


def counts(pool: kvsched.BlockPool) -> tuple[int, int, int, int]:
    return pool.total, pool.free_pages, pool.used, pool.shared


def test_allocate_returns_int32_pages_and_never_the_null_page():
    pool = kvsched.BlockPool(9, 16)
    pages = pool.allocate(8)
    assert pages.dtype == np.int32 and pages.shape == (8,)
    assert sorted(pages.tolist()) == list(range(1, 9))
    assert kvsched.NULL_PAGE not in pages
    assert counts(pool) == (8, 0, 8, 0)
    pool.free(pages)
    assert counts(pool) == (8, 8, 0, 0)


def test_allocating_more_than_free_takes_nothing():
    pool = kvsched.BlockPool(5, 16)
    held = pool.allocate(2)
    with pytest.raises(kvsched.OutOfPages):
        pool.allocate(3)
    assert counts(pool) == (4, 2, 2, 0)
    pool.free(held)


def test_shared_pages_are_freed_by_their_last_owner():
    pool = kvsched.BlockPool(5, 16)
    pages = pool.allocate(2)
    pool.retain(pages[:1])
    assert pool.refcount(int(pages[0])) == 2 and pool.shared == 1
    pool.free(pages)
    assert counts(pool) == (4, 3, 1, 0)
    pool.free(pages[:1])
    assert counts(pool) == (4, 4, 0, 0)


@pytest.mark.parametrize(
    "bad",
    [
        np.array([0], np.int32),  # the null page
        np.array([-1], np.int32),
        np.array([99], np.int32),
        np.array([4], np.int32),  # never allocated
        np.array([1, 2, 1], np.int32),  # double free within one batch
        np.array([1, 2, 0], np.int32),  # good pages then a bad one: all or nothing
    ],
)
def test_bad_frees_raise_pool_error_and_change_nothing(bad):
    pool = kvsched.BlockPool(8, 16)
    held = pool.allocate(3)  # pages 1, 2, 3
    before = [pool.refcount(p) for p in range(8)], counts(pool)
    with pytest.raises(kvsched.PoolError):
        pool.free(bad)
    assert ([pool.refcount(p) for p in range(8)], counts(pool)) == before
    pool.free(held)
    with pytest.raises(kvsched.PoolError, match="double free"):
        pool.free(held[:1])


@pytest.mark.parametrize(
    "bad",
    [
        np.array([1, 2], np.int64),
        np.array([1.0]),
        [1, 2],
        np.array([[1, 2]], np.int32),
        "1",
    ],
)
def test_free_of_wrong_type_is_invalid_request(bad):
    pool = kvsched.BlockPool(8, 16)
    pool.allocate(2)
    with pytest.raises(kvsched.InvalidRequest, match="int32"):
        pool.free(bad)
    assert counts(pool) == (7, 5, 2, 0)


def test_non_contiguous_view_frees_the_pages_it_shows():
    pool = kvsched.BlockPool(9, 16)
    pages = pool.allocate(8)
    pool.free(pages[::2])  # a strided view: copied, then freed
    assert counts(pool) == (8, 4, 4, 0)
    assert all(pool.refcount(int(p)) == 0 for p in pages[::2])
    assert all(pool.refcount(int(p)) == 1 for p in pages[1::2])


def test_single_page_calls_and_refcount_bounds():
    pool = kvsched.BlockPool(3, 4)
    page = pool.allocate_one()
    assert page in (1, 2)
    pool.free_one(page)
    with pytest.raises(kvsched.PoolError):
        pool.free_one(page)
    with pytest.raises(kvsched.PoolError):
        pool.refcount(3)


@pytest.mark.parametrize("num_blocks, block_size", [(1, 16), (16, 0), (1 << 27, 16)])
def test_bad_pool_config(num_blocks, block_size):
    with pytest.raises(kvsched.InvalidConfig):
        kvsched.BlockPool(num_blocks, block_size)
