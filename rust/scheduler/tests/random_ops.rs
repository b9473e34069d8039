//! One generator of random scheduler operations for every fuzz suite.
//!
//! A suite names its `Mix`: which operations it draws, how often, and the
//! ranges of their arguments; its runner gives each operation its oracle. An
//! operation a mix gives weight 0 is never drawn (not drawn and ignored, which
//! would thin the suite's runs), and an argument a mix leaves out is drawn as a
//! constant, so each suite draws exactly the operations and ranges it did when
//! it had an enum of its own.

use super::*;
use proptest::strategy::{BoxedStrategy, Union};
use std::ops::{Range, RangeInclusive};

#[derive(Clone, Debug)]
pub enum Op {
    /// Submit to tenant `t` a prompt of `n` tokens of family `fam`, for up to
    /// `m` new tokens: with stop tokens when `stop`, with a cache salt of `salt`
    /// bytes, and with the token at `divergent` changed (the prompt leaves its
    /// family there).
    Submit {
        t: usize,
        n: usize,
        m: usize,
        fam: i32,
        stop: bool,
        salt: Option<u8>,
        divergent: Option<usize>,
    },
    /// One step, and between its plan and its commit: cancel the `pick`-th
    /// live request, and submit (tenant, family, prompt length).
    Step {
        cancel_mid: Option<usize>,
        submit_mid: Option<(usize, i32, usize)>,
    },
    /// Cancel the `pick`-th live request.
    Cancel { pick: usize },
    /// Change tenant `t`'s configuration: each `Some` is set, each `None` left.
    Update {
        t: usize,
        floor: Option<usize>,
        cap: Option<Option<usize>>,
        step_cap: Option<Option<usize>>,
        weight: Option<u8>,
        tier: Option<u32>,
        ns: Option<u8>,
    },
    /// Reconfigure the scheduler live: max_num_seqs, max_batched_tokens,
    /// max_seq_len, the overhead reserve (an index into `RESERVES`), the
    /// ladder on or off, priority preemption on or off.
    Reconf {
        seqs: usize,
        mbt: usize,
        msl: usize,
        reserve: u8,
        ladder: bool,
        preempt: bool,
    },
    /// Drain, with a deadline `delta` hundredths of a second from now.
    Drain { delta: i32 },
    /// Let `dt` hundredths of a second pass.
    Wait { dt: u8 },
    /// Remove tenant `t` (cancelling its requests first when `cancel_all`),
    /// and when `readd`, add it back in namespace `ns`.
    Remove {
        t: usize,
        cancel_all: bool,
        readd: bool,
        ns: u8,
    },
}

/// The overhead reserves `Op::Reconf` picks from.
pub const RESERVES: [f64; 4] = [0.0, 0.1, 0.3, 0.6];

/// The prefix namespace `ns` names: 0 is the tenant's own.
pub fn namespace(ns: u8) -> Option<String> {
    match ns {
        0 => None,
        1 => Some("g".into()),
        _ => Some("h".into()),
    }
}

impl Op {
    /// `c` with an `Update`'s changes applied (a cap no lower than the floor).
    pub fn updated(&self, mut c: TenantConfig) -> TenantConfig {
        let Op::Update {
            floor,
            cap,
            step_cap,
            weight,
            tier,
            ns,
            ..
        } = *self
        else {
            panic!("not an update: {self:?}");
        };
        if let Some(floor) = floor {
            c.kv_floor_blocks = floor;
        }
        if let Some(cap) = cap {
            c.kv_cap_blocks = cap.map(|cap| cap.max(c.kv_floor_blocks));
        }
        if let Some(step_cap) = step_cap {
            c.max_step_tokens = step_cap;
        }
        if let Some(weight) = weight {
            c.weight = weight as f64;
        }
        if let Some(tier) = tier {
            c.tier = tier;
        }
        if let Some(ns) = ns {
            c.prefix_namespace = namespace(ns);
        }
        c
    }
}

/// Ranges of the tenant, family and prompt length of a submit between a
/// step's plan and its commit.
pub type MidSubmit = (Range<usize>, Range<i32>, Range<usize>);

/// How often a suite draws each operation, and from what ranges.
pub struct Mix {
    pub submit: u32,
    pub step: u32,
    pub cancel: u32,
    pub update: u32,
    pub reconf: u32,
    pub drain: u32,
    pub wait: u32,
    pub remove: u32,
    /// Submit's tenant, prompt length, max_tokens, family.
    pub submit_tenants: Range<usize>,
    pub prompt_len: Range<usize>,
    pub max_tokens: Range<usize>,
    pub families: Range<i32>,
    /// Probability of stop tokens.
    pub stop: f64,
    /// Probability and range of a salt, of a divergent token.
    pub salt: Option<(f64, Range<u8>)>,
    pub divergent: Option<(f64, Range<usize>)>,
    /// Probability of a cancel between a step's plan and its commit.
    pub cancel_mid: f64,
    /// Probability of a submit there, and its tenant, family and length.
    pub submit_mid: Option<(f64, MidSubmit)>,
    /// The tenants Update and Remove pick from, and what Update changes.
    pub tenants: Range<usize>,
    pub floor: Option<Range<usize>>,
    pub cap: Option<(f64, Range<usize>)>,
    pub step_cap: Option<(f64, Range<usize>)>,
    pub weight: Option<Range<u8>>,
    pub tier: Option<Range<u32>>,
    pub ns: Option<Range<u8>>,
}

impl Mix {
    /// Nothing drawn; a suite's mix starts from here.
    pub const NONE: Mix = Mix {
        submit: 0,
        step: 0,
        cancel: 0,
        update: 0,
        reconf: 0,
        drain: 0,
        wait: 0,
        remove: 0,
        submit_tenants: 0..1,
        prompt_len: 1..2,
        max_tokens: 1..2,
        families: 0..1,
        stop: 0.0,
        salt: None,
        divergent: None,
        cancel_mid: 0.0,
        submit_mid: None,
        tenants: 0..1,
        floor: None,
        cap: None,
        step_cap: None,
        weight: None,
        tier: None,
        ns: None,
    };
}

fn flag(p: f64) -> BoxedStrategy<bool> {
    if p > 0.0 {
        prop::bool::weighted(p).boxed()
    } else {
        Just(false).boxed()
    }
}

fn maybe<S>(p: f64, s: S) -> BoxedStrategy<Option<S::Value>>
where
    S: Strategy + 'static,
    S::Value: Clone,
{
    if p > 0.0 {
        prop::option::weighted(p, s).boxed()
    } else {
        Just(None).boxed()
    }
}

fn some<S>(s: Option<S>) -> BoxedStrategy<Option<S::Value>>
where
    S: Strategy + 'static,
    S::Value: Clone,
{
    match s {
        Some(s) => s.prop_map(Some).boxed(),
        None => Just(None).boxed(),
    }
}

/// Draws one operation of `mix`.
pub fn op(mix: &Mix) -> impl Strategy<Value = Op> {
    let mut arms: Vec<(u32, BoxedStrategy<Op>)> = Vec::new();
    if mix.submit > 0 {
        let salt = mix
            .salt
            .clone()
            .map_or(Just(None).boxed(), |(p, r)| maybe(p, r));
        let divergent = mix
            .divergent
            .clone()
            .map_or(Just(None).boxed(), |(p, r)| maybe(p, r));
        let s = (
            mix.submit_tenants.clone(),
            mix.prompt_len.clone(),
            mix.max_tokens.clone(),
            mix.families.clone(),
            flag(mix.stop),
            salt,
            divergent,
        )
            .prop_map(|(t, n, m, fam, stop, salt, divergent)| Op::Submit {
                t,
                n,
                m,
                fam,
                stop,
                salt,
                divergent,
            });
        arms.push((mix.submit, s.boxed()));
    }
    if mix.step > 0 {
        let submit_mid = mix
            .submit_mid
            .clone()
            .map_or(Just(None).boxed(), |(p, r)| maybe(p, r));
        let s = (maybe(mix.cancel_mid, any::<usize>()), submit_mid).prop_map(
            |(cancel_mid, submit_mid)| Op::Step {
                cancel_mid,
                submit_mid,
            },
        );
        arms.push((mix.step, s.boxed()));
    }
    if mix.cancel > 0 {
        let s = any::<usize>().prop_map(|pick| Op::Cancel { pick });
        arms.push((mix.cancel, s.boxed()));
    }
    if mix.update > 0 {
        let cap = mix.cap.clone().map(|(p, r)| maybe(p, r));
        let step_cap = mix.step_cap.clone().map(|(p, r)| maybe(p, r));
        let s = (
            mix.tenants.clone(),
            some(mix.floor.clone()),
            some(cap),
            some(step_cap),
            some(mix.weight.clone()),
            some(mix.tier.clone()),
            some(mix.ns.clone()),
        )
            .prop_map(|(t, floor, cap, step_cap, weight, tier, ns)| Op::Update {
                t,
                floor,
                cap,
                step_cap,
                weight,
                tier,
                ns,
            });
        arms.push((mix.update, s.boxed()));
    }
    if mix.reconf > 0 {
        let r = |r: RangeInclusive<usize>| r;
        let s = (
            r(1..=6),
            r(6..=48),
            r(2..=128),
            0u8..RESERVES.len() as u8,
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(seqs, mbt, msl, reserve, ladder, preempt)| Op::Reconf {
                seqs,
                mbt,
                msl,
                reserve,
                ladder,
                preempt,
            });
        arms.push((mix.reconf, s.boxed()));
    }
    if mix.drain > 0 {
        let s = (-5i32..40).prop_map(|delta| Op::Drain { delta });
        arms.push((mix.drain, s.boxed()));
    }
    if mix.wait > 0 {
        let s = (0u8..40).prop_map(|dt| Op::Wait { dt });
        arms.push((mix.wait, s.boxed()));
    }
    if mix.remove > 0 {
        let s = (
            mix.tenants.clone(),
            any::<bool>(),
            prop::bool::weighted(0.8),
            0u8..3,
        )
            .prop_map(|(t, cancel_all, readd, ns)| Op::Remove {
                t,
                cancel_all,
                readd,
                ns,
            });
        arms.push((mix.remove, s.boxed()));
    }
    Union::new_weighted(arms)
}

/// Draws a run of `len` operations of `mix`.
pub fn ops(mix: &Mix, len: Range<usize>) -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(mix), len)
}
