//! The degradation ladder: a ten-times burst climbs the rungs in order,
//! keeps tier 0 fast and descends; what counts as pressure.

use super::*;
use crate::ladder::{Action, Rung, Signal};

const DT: f64 = 0.01;

pub(super) fn ladder() -> LadderConfig {
    let rung = |signal, engage, release, action| Rung {
        signal,
        engage,
        release,
        action,
    };
    LadderConfig {
        rungs: vec![
            rung(Signal::ReservedShare, 0.9, 0.6, Action::ShedLowestTier),
            rung(Signal::QueueDepth, 8.0, 2.0, Action::CapMaxTokens(8)),
            rung(Signal::OldestWaitS, 0.5, 0.1, Action::MaxRunning(4)),
            rung(Signal::OldestWaitS, 1.0, 0.2, Action::RejectFast),
        ],
        retry_after_s: 0.25,
    }
}

struct Run {
    gold_ttft: Vec<f64>,
    gold_rejected: usize,
    bulk_reasons: BTreeMap<&'static str, usize>,
    moves: Vec<(usize, bool, f64)>,
    capped: usize,
    /// Bulk requests displaced (ended `Shed`) for gold's.
    displaced: usize,
    level_at_end: usize,
}

/// Gold (tier 0) sends one request every 10 steps throughout; bulk (tier 1)
/// sends three per step from step 100 to 200 (ten times what 8 slots of
/// 24-token requests sustain: ~0.3 per step), then one every 10 steps.
fn burst(with_ladder: bool) -> Run {
    let mut c = SchedulerConfig {
        num_blocks: 241,
        block_size: 8,
        max_num_seqs: 8,
        max_batched_tokens: 64,
        max_seq_len: 128,
        overhead_reserve: 0.0,
        max_waiting: 64,
        long_prefill_chunk: 64,
        preempt_lower_tiers: true,
        ..SchedulerConfig::default()
    };
    if with_ladder {
        c.ladder = ladder();
    }
    let mut h = Harness::new(c);
    h.dt = DT;
    let mut gold = TenantConfig::new("gold");
    gold.tier = 0;
    h.tenant(gold);
    let mut bulk = TenantConfig::new("bulk");
    bulk.tier = 1;
    h.tenant(bulk);
    let mut gold_ids = Vec::new();
    let mut run = Run {
        gold_ttft: Vec::new(),
        gold_rejected: 0,
        bulk_reasons: BTreeMap::new(),
        moves: Vec::new(),
        capped: 0,
        displaced: 0,
        level_at_end: 0,
    };
    for step in 0..900 {
        let mut sends: Vec<(&str, i32)> = Vec::new();
        if step % 10 == 0 && step < 700 {
            sends.push(("gold", 1));
        }
        let bulk_n = match step {
            100..200 => 3,
            _ if step < 700 && step % 10 == 5 => 1,
            _ => 0,
        };
        sends.extend(std::iter::repeat_n(("bulk", 2), bulk_n));
        for (k, (t, fam)) in sends.into_iter().enumerate() {
            let p = prompt(24, fam * 1000 + step * 7 + k as i32);
            match h.s.submit(t, &p, 24, h.now) {
                Ok(id) if t == "gold" => gold_ids.push(id),
                Ok(_) => *run.bulk_reasons.entry("admitted").or_default() += 1,
                Err(e) => {
                    let r = e.reason().unwrap().as_str();
                    if t == "gold" {
                        run.gold_rejected += 1;
                    } else {
                        *run.bulk_reasons.entry(r).or_default() += 1;
                    }
                }
            }
        }
        if h.step().is_none() {
            h.now += DT;
        }
        for e in h.s.take_events() {
            match e {
                SchedulerEvent::Ladder(m) => run.moves.push((m.rung, m.up, m.at)),
                SchedulerEvent::MaxTokensCapped { admitted, .. } => {
                    assert_eq!(admitted, 8);
                    run.capped += 1;
                }
                SchedulerEvent::Displaced { tenant, .. } => {
                    assert_eq!(tenant, "bulk");
                    run.displaced += 1;
                }
            }
        }
    }
    h.run(2000);
    run.level_at_end = h.s.ladder().level();
    for id in gold_ids {
        let f = &h.finished[&id];
        run.gold_ttft.push(f.first_token - f.arrival);
    }
    run
}

fn p99(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[(v.len() * 99 / 100).min(v.len() - 1)]
}

#[test]
fn a_ten_times_burst_climbs_the_rungs_in_order_keeps_tier_0_fast_and_descends() {
    let mut on = burst(true);
    let mut off = burst(false);

    // Every rung engaged, in order, and all were released once the burst was
    // absorbed, in reverse order.
    let ups: Vec<usize> = on.moves.iter().filter(|m| m.1).map(|m| m.0).collect();
    assert_eq!(&ups[..4], &[0, 1, 2, 3], "moves: {:?}", on.moves);
    let first_release = on.moves.iter().position(|m| !m.1).unwrap();
    assert!(
        on.moves[first_release].2 > 1.0,
        "nothing released during the burst"
    );
    assert_eq!(on.level_at_end, 0, "moves: {:?}", on.moves);
    let downs: Vec<usize> = on.moves.iter().filter(|m| !m.1).map(|m| m.0).collect();
    assert_eq!(downs.last(), Some(&0));
    // Rung 1 caps max_tokens of the tiers below the top only (the ladder
    // protects tier 0), and bulk, the only lower tier here, is shed by rung 0
    // whenever rung 1 is engaged: nothing is capped, gold's requests least of
    // all. (`cap_applies_below_the_top_tier_only` covers the cap on a middle
    // tier.)
    assert_eq!(on.capped, 0, "tier 0's max_tokens are never capped");
    assert!(on.bulk_reasons.get("shed").copied().unwrap_or(0) > 0);

    // Tier 0: never refused, first token within 0.1 s (10 steps) at p99.
    assert_eq!(on.gold_rejected, 0);
    let p = p99(&mut on.gold_ttft);
    assert!(p <= 0.1, "gold p99 ttft {p}");
    // Without the ladder the burst fills the pool: gold is not refused, it
    // displaces bulk's waiting requests instead.
    assert_eq!(off.gold_rejected, 0, "{:?}", off.bulk_reasons);
    assert!(off.displaced > 0, "{:?}", off.bulk_reasons);
    let p_off = p99(&mut off.gold_ttft);
    eprintln!(
        "ladder on: gold p99 ttft {p:.3} s, 0 refused, bulk {:?}, {} capped, moves {:?}",
        on.bulk_reasons, on.capped, on.moves
    );
    eprintln!(
        "ladder off: gold p99 ttft {p_off:.3} s, {} refused, bulk {:?}, {} displaced",
        off.gold_rejected, off.bulk_reasons, off.displaced
    );
}

#[test]
fn oldest_wait_counts_from_the_preemption_not_the_arrival() {
    let mut c = config(200, 8);
    c.max_num_seqs = 1;
    c.preempt_lower_tiers = true;
    let mut h = Harness::new(c);
    h.dt = 0.1;
    let mut lo = TenantConfig::new("lo");
    lo.tier = 1;
    h.tenant(lo);
    h.tenant(TenantConfig::new("hi"));
    h.submit("lo", &prompt(8, 1), 200);
    for _ in 0..100 {
        h.step(); // lo runs for 10 s while nobody waits
    }
    h.submit("hi", &prompt(8, 2), 4);
    h.step(); // lo is preempted for hi
    let wait = h.s.pressure(h.now).oldest_wait_s;
    assert!(wait <= 0.1 + 1e-9, "oldest wait {wait}");
}

#[test]
fn a_refused_invalid_request_does_not_move_the_ladder() {
    let mut c = config(200, 8);
    c.ladder = LadderConfig {
        rungs: vec![Rung {
            signal: Signal::QueueDepth,
            engage: 1.0,
            release: 0.5,
            action: Action::RejectFast,
        }],
        retry_after_s: 1.0,
    };
    let mut h = Harness::new(c);
    h.tenant(TenantConfig::new("a"));
    h.submit("a", &prompt(8, 1), 4);
    assert_eq!(reason(h.s.submit("a", &[], 4, h.now)), Some("invalid"));
    assert_eq!(
        reason(h.s.submit("a", &prompt(300, 1), 4, h.now)),
        Some("too_long")
    );
    assert_eq!(h.s.ladder().level(), 0);
    assert!(h.s.take_events().is_empty());
}
