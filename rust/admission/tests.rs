//! Admission's pure decisions, at their edges: exact fits and one block over,
//! zero limits, the order of the checks, and what each refusal asks to wait for.

use super::*;
use crate::tenant::{TenantConfig, Tenants};
use std::cell::Cell;

/// A tenant as the scheduler would hold it, with no usage yet.
fn tenant(config: TenantConfig) -> Tenant {
    let mut ts = Tenants::default();
    let id = ts.add(config, 1000).unwrap();
    ts.get(id).clone()
}

fn plain() -> Tenant {
    tenant(TenantConfig::new("a"))
}

/// 8-token blocks, 100 usable, nothing committed, no ladder.
fn cap() -> Capacity {
    Capacity {
        block_size: 8,
        max_seq_len: 1024,
        usable_blocks: 100,
        committed_blocks: 0,
        live_requests: 0,
        max_live_requests: 10,
        overcommit_watermark_blocks: None,
        shed_tier: None,
        reject_fast_would_wait: false,
        shed_retry_after: 0.25,
        // Set per request by `decide_with`, as the scheduler does.
        final_blocks: 0,
        prompt_blocks: 0,
    }
}

/// What `decide` asked and answered: (result, shared_hits asked, room asked).
struct Asked {
    result: Result<Admission, Rejection>,
    shared_asked: bool,
    room: Option<Room>,
}

fn decide_with(
    t: &Tenant,
    c: &Capacity,
    prompt_len: usize,
    max_tokens: usize,
    hits: usize,
) -> Asked {
    let shared_asked = Cell::new(false);
    let room = Cell::new(None);
    let prompt = vec![1; prompt_len];
    // What a request of one KV-cache group reserves (the scheduler sizes a
    // hybrid model's: see crate::groups).
    let c = &Capacity {
        final_blocks: (prompt_len + max_tokens).div_ceil(c.block_size),
        prompt_blocks: prompt_len.div_ceil(c.block_size),
        ..*c
    };
    let result = decide(
        t,
        c,
        &prompt,
        max_tokens,
        0.0,
        || {
            assert!(!shared_asked.replace(true), "shared_hits asked twice");
            hits
        },
        |r| {
            assert!(room.replace(Some(r)).is_none(), "room_wait asked twice");
            Some(4.5)
        },
    );
    Asked {
        result,
        shared_asked: shared_asked.get(),
        room: room.get(),
    }
}

fn blocks(t: &Tenant, c: &Capacity, prompt_len: usize, max_tokens: usize) -> usize {
    decide_with(t, c, prompt_len, max_tokens, 0)
        .result
        .unwrap()
        .blocks
}

fn refused(a: &Asked) -> (RejectReason, Option<f64>) {
    let r = a.result.as_ref().unwrap_err();
    (r.reason, r.retry_after)
}

fn permanent(a: &Asked) -> bool {
    a.result.as_ref().unwrap_err().permanent
}

// ---------------------------------------------------------------------------
// check_request

#[test]
fn a_request_is_invalid_when_empty_zero_length_or_negative() {
    let t = plain();
    let why = |p: &[i32], m| check_request(&t, 64, None, p, m).unwrap_err();
    let r = why(&[], 1);
    assert_eq!((r.reason, r.retry_after), (RejectReason::Invalid, None));
    assert_eq!(r.tenant.as_deref(), Some("a"));
    assert_eq!(why(&[1], 0).reason, RejectReason::Invalid);
    let r = why(&[5, 0, -1, 7, -9], 1);
    assert_eq!(r.reason, RejectReason::Invalid);
    assert!(
        r.message.contains("token 2 is negative (-1)"),
        "{}",
        r.message
    );
    assert_eq!(why(&[i32::MIN], 1).reason, RejectReason::Invalid);
    // Zero and the largest id are valid ids.
    assert!(check_request(&t, 64, None, &[0, i32::MAX], 1).is_ok());
}

#[test]
fn a_request_of_exactly_max_seq_len_fits_and_one_token_more_is_too_long() {
    let t = plain();
    assert!(check_request(&t, 64, None, &[1; 60], 4).is_ok());
    let r = check_request(&t, 64, None, &[1; 60], 5).unwrap_err();
    assert_eq!((r.reason, r.retry_after), (RejectReason::TooLong, None));
    assert!(check_request(&t, 64, None, &[1; 64], 1).is_err());
    // max_tokens near usize::MAX saturates instead of wrapping into a fit.
    let r = check_request(&t, 64, None, &[1; 3], usize::MAX).unwrap_err();
    assert_eq!(r.reason, RejectReason::TooLong);
    assert!(check_request(&t, usize::MAX, None, &[1; 3], usize::MAX - 3).is_ok());
}

/// What submit and restore check of a request's ids.
fn ids(t: &Tenant, vocab: Option<u32>, prompt: &[i32], generated: &[i32]) -> Result<(), Rejection> {
    check_request(t, usize::MAX, vocab, prompt, 1)?;
    check_vocab(t, vocab, generated, "generated token")
}

#[test]
fn ids_at_or_above_the_vocabulary_are_invalid_and_the_first_one_is_named() {
    let t = plain();
    assert!(ids(&t, None, &[i32::MAX], &[i32::MAX]).is_ok());
    assert!(ids(&t, Some(512), &[0, 511], &[511]).is_ok());
    let r = ids(&t, Some(512), &[3, 512, 9999], &[]).unwrap_err();
    assert_eq!((r.reason, r.retry_after), (RejectReason::Invalid, None));
    assert!(
        r.message
            .contains("prompt token 1 is 512, outside the vocabulary of 512 (ids 0..=511)"),
        "{}",
        r.message
    );
    let r = ids(&t, Some(512), &[3], &[7, 600]).unwrap_err();
    assert!(
        r.message.contains("generated token 1 is 600"),
        "{}",
        r.message
    );
    // A vocabulary beyond i32 holds every id.
    assert!(ids(&t, Some(u32::MAX), &[i32::MAX], &[]).is_ok());
    assert!(ids(&t, Some(1 << 31), &[i32::MAX], &[]).is_ok());
}

#[test]
fn the_vocabulary_test_agrees_with_a_plain_comparison_at_every_edge() {
    let t = plain();
    // (A vocabulary of 0 is refused by the config.)
    let vocabs = [1u32, 2, 511, 512, 65_536, (1 << 31) - 1, 1 << 31, u32::MAX];
    let ids = [
        0,
        1,
        510,
        511,
        512,
        65_535,
        65_536,
        i32::MAX - 1,
        i32::MAX,
        -1,
        i32::MIN,
    ];
    let mut seed = 7u64;
    for &vocab in &vocabs {
        for n in 0..40 {
            // Mostly in range, with an edge id at a random place.
            let list: Vec<i32> = (0..n)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    ids[(seed % ids.len() as u64) as usize]
                })
                .collect();
            // Negative ids are check_request's to refuse, not this check's.
            let first_oov = list.iter().position(|&x| i64::from(x) >= i64::from(vocab));
            let got = check_vocab(&t, Some(vocab), &list, "id");
            match first_oov {
                None => assert!(got.is_ok(), "{vocab} {list:?}"),
                Some(at) => {
                    let msg = got.unwrap_err().message;
                    assert!(
                        msg.starts_with(&format!("id {at} is ")),
                        "{vocab} {list:?}: {msg}"
                    );
                }
            }
            // The prompt check reads the ids once for both tests: a negative
            // id is reported first, then the first one outside the vocabulary.
            if list.is_empty() {
                continue;
            }
            let got = check_request(&t, usize::MAX, Some(vocab), &list, 1);
            let msg = got.as_ref().err().map(|r| r.message.clone());
            let want = match (list.iter().position(|&x| x < 0), first_oov) {
                (Some(at), _) => Some(format!("prompt token {at} is negative")),
                (None, Some(at)) => Some(format!("prompt token {at} is {}, outside", list[at])),
                (None, None) => None,
            };
            match want {
                None => assert!(got.is_ok(), "{vocab} {list:?}: {msg:?}"),
                Some(w) => assert!(
                    msg.as_deref().is_some_and(|m| m.starts_with(&w)),
                    "{vocab} {list:?}: {msg:?}, wanted {w}"
                ),
            }
        }
    }
}

#[test]
fn the_permanent_checks_come_first() {
    let t = plain();
    // Empty and too long: empty is reported.
    assert!(check_request(&t, 4, None, &[], 100)
        .unwrap_err()
        .message
        .contains("empty"));
    // Negative and too long: negative is reported.
    let r = check_request(&t, 4, None, &[-1; 10], 100).unwrap_err();
    assert_eq!(r.reason, RejectReason::Invalid);
}

// ---------------------------------------------------------------------------
// decide: what a request reserves

#[test]
fn reserve_mode_reserves_the_final_length_rounded_up_to_blocks() {
    let (t, c) = (plain(), cap());
    assert_eq!(blocks(&t, &c, 1, 1), 1);
    assert_eq!(blocks(&t, &c, 7, 1), 1, "8 tokens: exactly one block");
    assert_eq!(blocks(&t, &c, 8, 1), 2, "9 tokens: one over");
    assert_eq!(blocks(&t, &c, 15, 1), 2);
    assert_eq!(blocks(&t, &c, 16, 1), 3);
    assert_eq!(blocks(&t, &c, 1, 799), 100, "the whole usable pool");
    let a = decide_with(&t, &c, 40, 24, 0).result.unwrap();
    assert_eq!(
        a,
        Admission {
            blocks: 8,
            rate_cost: 64.0
        }
    );
}

#[test]
fn block_size_one_reserves_one_block_per_token() {
    let t = plain();
    let c = Capacity {
        block_size: 1,
        ..cap()
    };
    assert_eq!(blocks(&t, &c, 37, 5), 42);
}

#[test]
fn overcommit_reserves_the_prompt_and_the_watermark_but_never_more_than_the_final_length() {
    let t = plain();
    let c = Capacity {
        overcommit_watermark_blocks: Some(2),
        ..cap()
    };
    assert_eq!(blocks(&t, &c, 16, 100), 4, "2 prompt blocks + 2");
    assert_eq!(blocks(&t, &c, 17, 100), 5, "3 prompt blocks + 2");
    assert_eq!(
        blocks(&t, &c, 8, 1),
        2,
        "the final length (9 tokens) is less"
    );
    assert_eq!(blocks(&t, &c, 8, 24), 3, "prompt + 2 = final length");
    let c = Capacity {
        overcommit_watermark_blocks: Some(0),
        ..cap()
    };
    assert_eq!(blocks(&t, &c, 16, 100), 2, "watermark 0: the prompt alone");
}

#[test]
fn overcommit_refuses_for_ever_a_request_longer_than_the_pool() {
    let t = plain();
    let c = Capacity {
        overcommit_watermark_blocks: Some(1),
        usable_blocks: 10,
        ..cap()
    };
    // 80 tokens: exactly the pool.
    assert!(decide_with(&t, &c, 8, 72, 0).result.is_ok());
    let a = decide_with(&t, &c, 8, 73, 0);
    assert_eq!(refused(&a), (RejectReason::PoolFull, None));
    assert_eq!(a.room, None, "nothing that ends can make room");
}

// ---------------------------------------------------------------------------
// decide: the tenant's cap

#[test]
fn a_cap_counts_every_reservation_and_an_exact_fit_passes() {
    let mut c = TenantConfig::new("a");
    c.kv_cap_blocks = Some(5);
    let mut t = tenant(c);
    t.reserved_blocks = 3;
    let c = Capacity {
        committed_blocks: 3,
        ..cap()
    };
    assert_eq!(blocks(&t, &c, 8, 8), 2, "3 + 2 = the cap");
    let a = decide_with(&t, &c, 8, 9, 0);
    assert_eq!(refused(&a), (RejectReason::TenantBudget, Some(4.5)));
    assert!(!permanent(&a), "it fits once its own requests end");
    assert_eq!(a.room, Some(Room::TenantBlocks(1)), "one block over");
    assert!(!a.shared_asked);
}

#[test]
fn a_request_larger_than_the_cap_is_refused_for_ever() {
    let mut c = TenantConfig::new("a");
    c.kv_cap_blocks = Some(5);
    let t = tenant(c);
    assert_eq!(blocks(&t, &cap(), 20, 20), 5);
    let a = decide_with(&t, &cap(), 20, 21, 0);
    assert_eq!(refused(&a), (RejectReason::TenantBudget, None));
    assert!(permanent(&a));
    assert_eq!(a.room, None);
}

#[test]
fn a_cap_of_zero_refuses_everything_for_ever() {
    let mut c = TenantConfig::new("a");
    c.kv_cap_blocks = Some(0);
    let t = tenant(c);
    let a = decide_with(&t, &cap(), 1, 1, 0);
    assert_eq!(refused(&a), (RejectReason::TenantBudget, None));
}

#[test]
fn without_a_cap_a_request_is_bounded_by_the_usable_pool_only() {
    let mut t = plain();
    // Its reservations do not count against a cap it does not have...
    t.reserved_blocks = 90;
    let c = Capacity {
        committed_blocks: 90,
        ..cap()
    };
    assert_eq!(
        blocks(&t, &c, 8, 72),
        10,
        "...only against the pool: exact fit"
    );
    let a = decide_with(&t, &c, 8, 73, 0);
    assert_eq!(refused(&a).0, RejectReason::PoolFull);
    // ...and one request larger than the pool is refused for ever.
    let a = decide_with(&plain(), &cap(), 8, 793, 0);
    assert_eq!(refused(&a), (RejectReason::TenantBudget, None));
}

// ---------------------------------------------------------------------------
// decide: concurrency

#[test]
fn a_tenant_at_its_concurrency_limit_waits_for_one_of_its_own() {
    let mut c = TenantConfig::new("a");
    c.max_concurrent = Some(2);
    let mut t = tenant(c);
    t.live_requests = 1;
    assert!(decide_with(&t, &cap(), 1, 1, 0).result.is_ok());
    t.live_requests = 2;
    let a = decide_with(&t, &cap(), 1, 1, 0);
    assert_eq!(refused(&a), (RejectReason::Concurrency, Some(4.5)));
    assert_eq!(a.room, Some(Room::TenantRequests(1)));
    // Over the limit (lowered while requests live): all the excess must end.
    t.live_requests = 5;
    let a = decide_with(&t, &cap(), 1, 1, 0);
    assert_eq!(a.room, Some(Room::TenantRequests(4)));
}

#[test]
fn a_concurrency_limit_of_zero_refuses_every_request() {
    let mut c = TenantConfig::new("a");
    c.max_concurrent = Some(0);
    let a = decide_with(&tenant(c), &cap(), 1, 1, 0);
    assert_eq!(a.room, Some(Room::TenantRequests(1)));
    let c = Capacity {
        max_live_requests: 0,
        ..cap()
    };
    let a = decide_with(&plain(), &c, 1, 1, 0);
    assert_eq!(refused(&a).0, RejectReason::Concurrency);
    assert_eq!(a.room, Some(Room::Requests(1)));
}

#[test]
fn a_full_scheduler_waits_for_as_many_requests_as_it_is_over() {
    let c = Capacity {
        live_requests: 9,
        ..cap()
    };
    assert!(decide_with(&plain(), &c, 1, 1, 0).result.is_ok());
    let c = Capacity {
        live_requests: 10,
        ..cap()
    };
    assert_eq!(
        decide_with(&plain(), &c, 1, 1, 0).room,
        Some(Room::Requests(1))
    );
    let c = Capacity {
        live_requests: 13,
        ..cap()
    };
    assert_eq!(
        decide_with(&plain(), &c, 1, 1, 0).room,
        Some(Room::Requests(4))
    );
}

// ---------------------------------------------------------------------------
// decide: the pool

#[test]
fn the_pool_admits_an_exact_fit_and_refuses_one_block_more() {
    let c = Capacity {
        committed_blocks: 96,
        ..cap()
    };
    assert_eq!(blocks(&plain(), &c, 16, 16), 4);
    let a = decide_with(&plain(), &c, 16, 17, 0);
    assert_eq!(refused(&a), (RejectReason::PoolFull, Some(4.5)));
    assert_eq!(
        a.room,
        Some(Room::Pool {
            blocks: 5,
            shared: 0
        })
    );
    assert!(a
        .result
        .unwrap_err()
        .message
        .contains("4 of 100 usable blocks"));
}

#[test]
fn a_tenant_grows_into_its_own_floor_without_asking_the_pool_for_more() {
    let mut c = TenantConfig::new("a");
    c.kv_floor_blocks = 10;
    let mut t = tenant(c);
    t.reserved_blocks = 4;
    // The pool is fully promised, 10 of it to this tenant's floor.
    let c = Capacity {
        committed_blocks: 100,
        ..cap()
    };
    assert_eq!(blocks(&t, &c, 40, 8), 6, "4 + 6 = the floor");
    let a = decide_with(&t, &c, 40, 9, 0);
    assert_eq!(refused(&a).0, RejectReason::PoolFull);
    assert_eq!(
        a.room,
        Some(Room::Pool {
            blocks: 7,
            shared: 0
        })
    );
}

#[test]
fn pages_the_tenant_already_holds_cost_the_pool_nothing() {
    let mut t = plain();
    t.reserved_blocks = 10;
    t.shared_blocks = 2; // footprint 8
    let c = Capacity {
        committed_blocks: 98,
        ..cap()
    };
    // 5 blocks, 3 of them hits on pages the tenant holds: 8 + 5 - 3 = 10 more
    // than its footprint of 8 is 2: exactly the 2 unpromised.
    let a = decide_with(&t, &c, 32, 8, 3);
    assert!(a.shared_asked);
    assert_eq!(a.result.unwrap().blocks, 5);
    let a = decide_with(&t, &c, 32, 8, 2);
    assert_eq!(refused(&a).0, RejectReason::PoolFull);
    assert_eq!(
        a.room,
        Some(Room::Pool {
            blocks: 5,
            shared: 4
        })
    );
}

#[test]
fn shared_hits_are_asked_only_when_the_pool_is_consulted() {
    let c = Capacity {
        shed_tier: Some(0),
        ..cap()
    };
    assert!(!decide_with(&plain(), &c, 1, 1, 0).shared_asked);
    let c = Capacity {
        max_live_requests: 0,
        ..cap()
    };
    assert!(!decide_with(&plain(), &c, 1, 1, 0).shared_asked);
    assert!(decide_with(&plain(), &cap(), 1, 1, 0).shared_asked);
}

// ---------------------------------------------------------------------------
// decide: the ladder, the rate limit, and the order of the checks

#[test]
fn the_ladder_sheds_its_tier_and_requests_that_would_wait_with_its_retry_after() {
    let c = Capacity {
        shed_tier: Some(1),
        ..cap()
    };
    assert!(
        decide_with(&plain(), &c, 1, 1, 0).result.is_ok(),
        "tier 0 passes"
    );
    let mut low = TenantConfig::new("low");
    low.tier = 1;
    let a = decide_with(&tenant(low), &c, 1, 1, 0);
    assert_eq!(refused(&a), (RejectReason::Shed, Some(0.25)));
    assert_eq!(a.room, None);
    let c = Capacity {
        reject_fast_would_wait: true,
        ..cap()
    };
    assert_eq!(
        refused(&decide_with(&plain(), &c, 1, 1, 0)),
        (RejectReason::Shed, Some(0.25))
    );
}

#[test]
fn the_rate_limit_charges_the_final_length_and_a_full_burst_is_an_exact_fit() {
    let mut c = TenantConfig::new("a");
    c.rate_tokens_per_s = Some(10.0);
    c.burst_tokens = Some(64.0);
    let t = tenant(c);
    let a = decide_with(&t, &cap(), 40, 24, 0).result.unwrap();
    assert_eq!(a.rate_cost, 64.0);
    let a = decide_with(&t, &cap(), 40, 25, 0);
    assert_eq!(
        refused(&a),
        (RejectReason::RateLimited, None),
        "more than the burst"
    );
    assert!(permanent(&a));
    assert_eq!(a.room, None);
}

#[test]
fn a_refusal_names_the_most_permanent_reason() {
    // Over its cap, at its concurrency limit, the pool full and shed: the
    // shed comes first (the ladder is cheaper than anything below it), then
    // the cap, then concurrency, then the pool.
    let mut tc = TenantConfig::new("a");
    tc.kv_cap_blocks = Some(4);
    tc.max_concurrent = Some(1);
    let mut t = tenant(tc);
    t.reserved_blocks = 4;
    t.live_requests = 1;
    let full = Capacity {
        committed_blocks: 100,
        live_requests: 10,
        ..cap()
    };
    let shed = Capacity {
        shed_tier: Some(0),
        ..full
    };
    assert_eq!(
        refused(&decide_with(&t, &shed, 8, 8, 0)).0,
        RejectReason::Shed
    );
    assert_eq!(
        refused(&decide_with(&t, &full, 8, 8, 0)).0,
        RejectReason::TenantBudget
    );
    t.reserved_blocks = 0;
    assert_eq!(
        refused(&decide_with(&t, &full, 8, 8, 0)).0,
        RejectReason::Concurrency
    );
    t.live_requests = 0;
    let a = decide_with(&t, &full, 8, 8, 0);
    assert_eq!(a.room, Some(Room::Requests(1)), "the scheduler's own limit");
    let pool_only = Capacity {
        live_requests: 0,
        ..full
    };
    assert_eq!(
        refused(&decide_with(&t, &pool_only, 8, 8, 0)).0,
        RejectReason::PoolFull
    );
}
