use super::*;
use proptest::prelude::*;

#[test]
fn fresh_pool_hands_out_pages_from_one_and_never_the_null_page() {
    let mut pool = BlockPool::new(5, 16).unwrap();
    let mut got: Vec<u32> = Vec::new();
    pool.allocate_into(4, &mut got).unwrap();
    assert_eq!(got, vec![1, 2, 3, 4]);
    assert_eq!(pool.free_count(), 0);
    assert_eq!(
        pool.allocate_one(),
        Err(KvError::OutOfPages {
            requested: 1,
            free: 0
        })
    );
}

#[test]
fn a_pool_without_prefix_cache_allocates_frees_and_names_nothing() {
    let mut pool = BlockPool::with_prefix_cache(4, 16, false).unwrap();
    let mut got: Vec<u32> = Vec::new();
    pool.allocate_into(3, &mut got).unwrap();
    assert_eq!(got, vec![1, 2, 3]);
    assert!(pool.allocate_one().is_err(), "exhausted: no evictable page");
    assert!(
        !pool.register(1, CacheKey::new(7), Scope::Shared),
        "nothing is named"
    );
    assert_eq!(pool.cache().lookup(CacheKey::new(7)), None);
    pool.retain(&got[..1]).unwrap();
    assert!(pool.free(&[0, 1]).is_err());
    pool.free(&got).unwrap();
    pool.free(&got[..1]).unwrap();
    assert_eq!((pool.available(), pool.cache().evictable()), (3, 0));
    pool.check_invariants().unwrap();
}

#[test]
fn batch_allocate_beyond_free_takes_nothing() {
    let mut pool = BlockPool::new(4, 16).unwrap();
    let mut got: Vec<u32> = Vec::new();
    assert!(pool.allocate_into(4, &mut got).is_err());
    assert!(got.is_empty());
    assert_eq!(pool.free_count(), 3);
}

#[test]
fn bad_frees_are_typed_and_change_nothing() {
    let mut pool = BlockPool::new(8, 16).unwrap();
    let mut got: Vec<i32> = Vec::new();
    pool.allocate_into(3, &mut got).unwrap();
    let before = pool.clone();
    for bad in [
        vec![0i32],
        vec![8],
        vec![-1],
        vec![5],
        vec![1, 2, 1],
        vec![1, 2, 0],
    ] {
        let err = pool.free(&bad).unwrap_err();
        assert!(matches!(err, KvError::InvalidPage { .. }), "{bad:?}: {err}");
        assert_eq!(pool.free, before.free);
        assert_eq!(pool.refcount, before.refcount);
    }
    pool.free(&got).unwrap();
    assert!(pool.free(&got[..1]).is_err(), "double free must fail");
    pool.check_invariants().unwrap();
}

#[test]
fn shared_pages_free_on_last_reference() {
    let mut pool = BlockPool::new(4, 16).unwrap();
    let p = pool.allocate_one().unwrap();
    pool.retain(&[p as i64]).unwrap();
    assert_eq!(pool.shared(), 1);
    pool.free(&[p as i64]).unwrap();
    assert_eq!((pool.shared(), pool.used()), (0, 1));
    pool.free(&[p as i64]).unwrap();
    assert_eq!(pool.used(), 0);
    assert!(pool.retain(&[p as i64]).is_err(), "retain of a free page");
}

#[test]
fn config_limits() {
    assert!(BlockPool::new(1, 16).is_err());
    assert!(BlockPool::new(16, 0).is_err());
    assert!(BlockPool::new(1 << 27, 16).is_err(), "slots overflow int32");
}

#[test]
fn evictable_pages_go_after_free_ones_oldest_first_and_a_hit_revives_them() {
    let mut pool = BlockPool::new(7, 16).unwrap();
    let mut pages: Vec<u32> = Vec::new();
    pool.allocate_into(4, &mut pages).unwrap(); // 1..=4; 5, 6 free
    for (i, &p) in pages.iter().enumerate() {
        assert!(pool.register(p, CacheKey::new(100 + i as u128), Scope::Tenant(0)));
    }
    // Released last to first: 4 is the oldest evictable page, 1 the newest.
    pool.free(&pages).unwrap();
    assert_eq!(
        (pool.free_count(), pool.available(), pool.used()),
        (2, 6, 0)
    );
    pool.check_invariants().unwrap();
    // A hit on page 2 takes it off the evictable list.
    pool.retain(&[2u32]).unwrap();
    assert_eq!(pool.available(), 5);
    let mut got: Vec<u32> = Vec::new();
    pool.allocate_into(4, &mut got).unwrap();
    assert_eq!(
        got,
        vec![5, 6, 4, 3],
        "free pages, then the oldest evictable"
    );
    assert_eq!(
        pool.cache().lookup(CacheKey::new(103)),
        None,
        "an evicted page loses its name"
    );
    assert_eq!(
        pool.cache().lookup(CacheKey::new(101)),
        Some(2),
        "the referenced page keeps it"
    );
    assert_eq!(pool.cache().evictions(), 2);
    let mut more: Vec<u32> = Vec::new();
    pool.allocate_into(1, &mut more).unwrap();
    assert_eq!(more, vec![1]);
    assert!(
        pool.allocate_one().is_err(),
        "page 2 is referenced: never evicted"
    );
    pool.check_invariants().unwrap();
}

#[test]
fn retain_cached_takes_hits_and_refuses_an_unnamed_page_whole() {
    let mut pool = BlockPool::new(8, 16).unwrap();
    let mut pages: Vec<u32> = Vec::new();
    pool.allocate_into(4, &mut pages).unwrap();
    for (i, &p) in pages[..3].iter().enumerate() {
        pool.register(p, CacheKey::new(50 + i as u128), Scope::Shared);
    }
    pool.retain(&pages[..1]).unwrap();
    pool.free(&pages).unwrap(); // 2 and 3 parked; 1 still held; 4 free
    let before = pool.clone();
    assert!(pool.retain_cached(&[2, 4]).is_err(), "page 4 is not cached");
    assert_eq!(pool.refcount, before.refcount);
    assert_eq!(pool.cache().evictable(), 2);
    pool.retain_cached(&[1, 2, 3]).unwrap();
    assert_eq!(
        (pool.refcount(1), pool.refcount(2), pool.refcount(3)),
        (2, 1, 1)
    );
    assert_eq!((pool.shared(), pool.cache().evictable()), (1, 0));
    pool.check_invariants().unwrap();
}

#[test]
fn a_failed_free_puts_parked_pages_back() {
    let mut pool = BlockPool::new(5, 16).unwrap();
    let mut pages: Vec<u32> = Vec::new();
    pool.allocate_into(2, &mut pages).unwrap();
    pool.register(pages[1], CacheKey::new(7), Scope::Shared);
    // Freed last to first: pages[1] is parked, then the null page fails.
    assert!(pool.free(&[0, pages[1]]).is_err());
    assert_eq!(pool.refcount(pages[1]), 1);
    assert_eq!(pool.cache().evictable(), 0);
    pool.check_invariants().unwrap();
}

#[test]
fn partitioned_pages_park_on_their_tenants_list_and_only_its_allocations_evict_them() {
    let mut pool = BlockPool::new(9, 16).unwrap();
    pool.partition_by_tenant();
    let (mut a, mut b): (Vec<u32>, Vec<u32>) = (Vec::new(), Vec::new());
    pool.allocate_into_for(0, 3, &mut a).unwrap(); // 1 2 3
    pool.allocate_into_for(1, 3, &mut b).unwrap(); // 4 5 6
    for (i, &p) in a.iter().chain(&b).enumerate() {
        pool.register(
            p,
            CacheKey::new(10 + i as u128),
            Scope::Tenant(p as usize / 4),
        );
    }
    pool.free_counting_by(0, &a, None).unwrap();
    pool.free_counting_by(1, &b, None).unwrap();
    assert_eq!(
        (pool.cache().parked_by(0), pool.cache().parked_by(1)),
        (3, 3)
    );
    assert_eq!((pool.free_count(), pool.available()), (2, 8));
    pool.check_invariants().unwrap();
    // Tenant 1 may take the free pages and its own, never tenant 0's.
    let mut more: Vec<u32> = Vec::new();
    let err = pool.allocate_into_for(1, 6, &mut more).unwrap_err();
    assert_eq!(
        err,
        KvError::OutOfPages {
            requested: 6,
            free: 5
        }
    );
    assert!(more.is_empty());
    pool.allocate_into_for(1, 4, &mut more).unwrap();
    assert_eq!(more, vec![7, 8, 6, 5], "free pages, then its oldest");
    assert_eq!(
        (pool.cache().parked_by(0), pool.cache().parked_by(1)),
        (3, 1)
    );
    for (i, &p) in a.iter().enumerate() {
        assert_eq!(
            pool.cache().lookup(CacheKey::new(10 + i as u128)),
            Some(p),
            "kept"
        );
    }
    // A hit takes a page off its list; trimming frees the oldest.
    pool.retain_cached(&[1]).unwrap();
    assert_eq!(pool.cache().parked_by(0), 2);
    assert_eq!(pool.trim_parked(0, 1), 1);
    assert_eq!(
        pool.cache().lookup(CacheKey::new(12)),
        None,
        "page 3, the oldest, went"
    );
    assert_eq!(pool.forget_tenant(0), 1);
    assert_eq!(pool.cache().parked_by(0), 0);
    pool.check_invariants().unwrap();
}

#[derive(Clone, Debug)]
enum Op {
    Alloc(usize),
    Free(Vec<usize>), // indices into the held list
    Retain(Vec<usize>),
    FreeRaw(i64),
    /// Name a held page in the prefix cache (index into the held list).
    Register(usize),
    /// Reference an evictable page again (a cache hit; index into the LRU).
    Hit(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0usize..6).prop_map(Op::Alloc),
        prop::collection::vec(0usize..64, 0..5).prop_map(Op::Free),
        prop::collection::vec(0usize..64, 0..3).prop_map(Op::Retain),
        (-2i64..20).prop_map(Op::FreeRaw),
        (0usize..64).prop_map(Op::Register),
        (0usize..64).prop_map(Op::Hit),
    ]
}

proptest! {
    /// The pool against a naive model: a map page -> references.
    #[test]
    fn pool_matches_naive_model(ops in prop::collection::vec(op(), 1..200)) {
        const N: usize = 16;
        let mut pool = BlockPool::new(N, 4).unwrap();
        let mut model = [0u32; N];
        // One entry per reference held by the test.
        let mut held: Vec<i64> = Vec::new();
        // Named pages, and the evictable ones oldest first.
        let mut named = [false; N];
        let mut lru: std::collections::VecDeque<i64> = Default::default();
        let mut next_key = 1u128;
        for op in ops {
            match op {
                Op::Alloc(n) => {
                    let available = model.iter().skip(1).filter(|&&r| r == 0).count();
                    let unnamed = available - lru.len();
                    let mut out: Vec<i64> = Vec::new();
                    let res = pool.allocate_into(n, &mut out);
                    prop_assert_eq!(res.is_ok(), n <= available);
                    for (i, &p) in out.iter().enumerate() {
                        prop_assert!(p > 0 && (p as usize) < N);
                        prop_assert_eq!(model[p as usize], 0, "page handed out twice");
                        if i < unnamed {
                            prop_assert!(!named[p as usize], "evicted while free pages remain");
                        } else {
                            prop_assert_eq!(lru.pop_front(), Some(p), "not the oldest evictable");
                            named[p as usize] = false;
                        }
                        model[p as usize] = 1;
                    }
                    held.extend(out);
                }
                Op::Register(i) if !held.is_empty() => {
                    let p = held[i % held.len()];
                    if !named[p as usize] {
                        prop_assert!(pool.register(p as u32, CacheKey::new(next_key), Scope::Shared));
                        named[p as usize] = true;
                        next_key += 1;
                    }
                }
                Op::Hit(i) if !lru.is_empty() => {
                    let p = lru.remove(i % lru.len()).unwrap();
                    pool.retain(&[p]).unwrap();
                    model[p as usize] = 1;
                    held.push(p);
                }
                Op::Register(_) | Op::Hit(_) => {}
                Op::Free(idx) | Op::Retain(idx) if held.is_empty() => { let _ = idx; }
                Op::Free(idx) => {
                    let mut pick: Vec<usize> = idx.iter().map(|i| i % held.len()).collect();
                    pick.sort_unstable();
                    pick.dedup();
                    let pages: Vec<i64> = pick.iter().map(|&i| held[i]).collect();
                    pool.free(&pages).unwrap();
                    // Released last to first.
                    for &p in pages.iter().rev() {
                        model[p as usize] -= 1;
                        if model[p as usize] == 0 && named[p as usize] { lru.push_back(p); }
                    }
                    for &i in pick.iter().rev() { held.swap_remove(i); }
                }
                Op::Retain(idx) => {
                    let pages: Vec<i64> = idx.iter().map(|i| held[i % held.len()]).collect();
                    pool.retain(&pages).unwrap();
                    for &p in &pages { model[p as usize] += 1; }
                    held.extend(pages);
                }
                Op::FreeRaw(p) => {
                    let ok = p > 0 && (p as usize) < N && model[p as usize] > 0;
                    let res = pool.free(&[p]);
                    prop_assert_eq!(res.is_ok(), ok);
                    if ok {
                        model[p as usize] -= 1;
                        if model[p as usize] == 0 && named[p as usize] { lru.push_back(p); }
                        let at = held.iter().position(|&h| h == p).unwrap();
                        held.swap_remove(at);
                    }
                }
            }
            pool.check_invariants().map_err(TestCaseError::fail)?;
            for (p, &rc) in model.iter().enumerate() {
                prop_assert_eq!(pool.refcount(p as u32), rc);
            }
            let used = model.iter().filter(|&&r| r > 0).count();
            prop_assert_eq!(pool.used(), used);
            prop_assert_eq!(pool.free_count() + lru.len() + used, N - 1);
            prop_assert_eq!(pool.cache().evictable(), lru.len());
            prop_assert_eq!(pool.shared(), model.iter().filter(|&&r| r >= 2).count());
        }
    }
}
