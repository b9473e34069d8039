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

/// Which of `Mix`'s weights an operation is drawn by.
fn kind(op: &Op) -> usize {
    match op {
        Op::Submit { .. } => 0,
        Op::Step { .. } => 1,
        Op::Cancel { .. } => 2,
        Op::Update { .. } => 3,
        Op::Reconf { .. } => 4,
        Op::Drain { .. } => 5,
        Op::Wait { .. } => 6,
        Op::Remove { .. } => 7,
    }
}

/// The smallest and largest value seen of each ranged argument.
#[derive(Default)]
struct Seen {
    lo: BTreeMap<&'static str, i64>,
    hi: BTreeMap<&'static str, i64>,
    some: BTreeMap<&'static str, (u32, u32)>,
}

impl Seen {
    fn value(&mut self, name: &'static str, v: i64) {
        let lo = self.lo.entry(name).or_insert(v);
        *lo = (*lo).min(v);
        let hi = self.hi.entry(name).or_insert(v);
        *hi = (*hi).max(v);
    }
    /// A value that must lie in `r` (when drawn at all).
    fn within<T: Into<i64> + Copy>(&mut self, name: &'static str, v: T, r: &Range<T>) {
        let (v, lo, hi) = (v.into(), r.start.into(), r.end.into());
        assert!(lo <= v && v < hi, "{name} = {v} outside {lo}..{hi}");
        self.value(name, v);
    }
    /// Counts how often an optional or boolean argument was drawn.
    fn drawn(&mut self, name: &'static str, yes: bool) {
        let e = self.some.entry(name).or_default();
        e.0 += yes as u32;
        e.1 += 1;
    }
    /// Every value of `r` was reachable: its ends were both drawn.
    fn covers<T: Into<i64> + Copy>(&self, name: &'static str, r: &Range<T>) {
        let (lo, hi) = (r.start.into(), r.end.into() - 1);
        assert_eq!(
            (self.lo.get(name), self.hi.get(name)),
            (Some(&lo), Some(&hi)),
            "{name}"
        );
    }
    /// Drawn with probability `p` (within sampling error).
    fn rate(&self, name: &'static str, p: f64) {
        let (yes, all) = self.some.get(name).copied().unwrap_or((0, 1));
        let got = yes as f64 / all as f64;
        assert!((got - p).abs() < 0.03, "{name}: {got} drawn, {p} asked");
    }
}

fn usize_range(r: &Range<usize>) -> Range<i64> {
    r.start as i64..r.end as i64
}

fn check_op(mix: &Mix, op: &Op, seen: &mut Seen) {
    let ur = usize_range;
    match *op {
        Op::Submit {
            t,
            n,
            m,
            fam,
            stop,
            salt,
            divergent,
        } => {
            seen.within("submit t", t as i64, &ur(&mix.submit_tenants));
            seen.within("n", n as i64, &ur(&mix.prompt_len));
            seen.within("m", m as i64, &ur(&mix.max_tokens));
            seen.within("fam", fam, &mix.families);
            seen.drawn("stop", stop);
            seen.drawn("salt", salt.is_some());
            seen.drawn("divergent", divergent.is_some());
            if let Some(s) = salt {
                seen.within("salt", s, &mix.salt.clone().unwrap().1);
            }
            if let Some(d) = divergent {
                seen.within(
                    "divergent",
                    d as i64,
                    &ur(&mix.divergent.clone().unwrap().1),
                );
            }
        }
        Op::Step {
            cancel_mid,
            submit_mid,
        } => {
            seen.drawn("cancel_mid", cancel_mid.is_some());
            seen.drawn("submit_mid", submit_mid.is_some());
            if let Some((t, fam, n)) = submit_mid {
                let (_, (rt, rf, rn)) = mix.submit_mid.clone().unwrap();
                seen.within("mid t", t as i64, &ur(&rt));
                seen.within("mid fam", fam, &rf);
                seen.within("mid n", n as i64, &ur(&rn));
            }
        }
        Op::Cancel { .. } => {}
        Op::Update {
            t,
            floor,
            cap,
            step_cap,
            weight,
            tier,
            ns,
        } => {
            seen.within("update t", t as i64, &ur(&mix.tenants));
            assert_eq!(floor.is_some(), mix.floor.is_some());
            assert_eq!(cap.is_some(), mix.cap.is_some());
            assert_eq!(step_cap.is_some(), mix.step_cap.is_some());
            assert_eq!(weight.is_some(), mix.weight.is_some());
            assert_eq!(tier.is_some(), mix.tier.is_some());
            assert_eq!(ns.is_some(), mix.ns.is_some());
            if let Some(f) = floor {
                seen.within("floor", f as i64, &ur(mix.floor.as_ref().unwrap()));
            }
            if let Some(c) = cap {
                seen.drawn("cap", c.is_some());
                if let Some(c) = c {
                    seen.within("cap", c as i64, &ur(&mix.cap.clone().unwrap().1));
                }
            }
            if let Some(c) = step_cap {
                seen.drawn("step_cap", c.is_some());
                if let Some(c) = c {
                    seen.within("step_cap", c as i64, &ur(&mix.step_cap.clone().unwrap().1));
                }
            }
            if let Some(w) = weight {
                seen.within("weight", w, mix.weight.as_ref().unwrap());
            }
            if let Some(x) = tier {
                seen.within("tier", x, mix.tier.as_ref().unwrap());
            }
            if let Some(x) = ns {
                seen.within("ns", x, mix.ns.as_ref().unwrap());
            }
        }
        Op::Reconf {
            seqs,
            mbt,
            msl,
            reserve,
            ladder,
            preempt,
        } => {
            seen.within("seqs", seqs as i64, &(1..7));
            seen.within("mbt", mbt as i64, &(6..49));
            seen.within("msl", msl as i64, &(2..129));
            seen.within("reserve", reserve, &(0..4));
            seen.drawn("ladder", ladder);
            seen.drawn("preempt", preempt);
        }
        Op::Drain { delta } => seen.within("delta", delta, &(-5..40)),
        Op::Wait { dt } => seen.within("dt", dt, &(0..40)),
        Op::Remove {
            t,
            cancel_all,
            readd,
            ns,
        } => {
            seen.within("remove t", t as i64, &ur(&mix.tenants));
            seen.drawn("cancel_all", cancel_all);
            seen.drawn("readd", readd);
            seen.within("remove ns", ns, &(0..3));
        }
    }
}

/// The generator draws a mix's operations at its weights, each argument over
/// exactly its range (both ends reached, nothing outside) and each optional
/// one at its probability; an operation or argument the mix leaves out is
/// never drawn.
#[test]
fn each_mix_draws_exactly_its_operations_weights_and_ranges() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mixes = [
        ("admission", &super::admission::ADMISSION_MIX),
        ("plan rows", &super::plan_rows_fuzz::ROWS_MIX),
        ("lifecycle", &super::lifecycle_fuzz::LIFECYCLE_MIX),
        ("prefix", &super::prefix_fuzz::PREFIX_MIX),
    ];
    const N: usize = 20_000;
    for (name, mix) in mixes {
        let mut runner = TestRunner::deterministic();
        let strategy = op(mix);
        let mut counts = [0usize; 8];
        let mut seen = Seen::default();
        for _ in 0..N {
            let op = strategy.new_tree(&mut runner).unwrap().current();
            counts[kind(&op)] += 1;
            check_op(mix, &op, &mut seen);
        }
        let weights = [
            mix.submit, mix.step, mix.cancel, mix.update, mix.reconf, mix.drain, mix.wait,
            mix.remove,
        ];
        let total: u32 = weights.iter().sum();
        for (k, (&w, &c)) in weights.iter().zip(&counts).enumerate() {
            let want = w as f64 / total as f64;
            let got = c as f64 / N as f64;
            assert!(
                (got - want).abs() < 0.01,
                "{name}: kind {k} drawn {got}, weight {want}"
            );
            assert_eq!(w == 0, c == 0, "{name}: kind {k}");
        }
        if mix.submit > 0 {
            seen.covers("submit t", &usize_range(&mix.submit_tenants));
            seen.covers("n", &usize_range(&mix.prompt_len));
            seen.covers("m", &usize_range(&mix.max_tokens));
            seen.covers("fam", &mix.families);
            seen.rate("stop", mix.stop);
            seen.rate("salt", mix.salt.as_ref().map_or(0.0, |o| o.0));
            seen.rate("divergent", mix.divergent.as_ref().map_or(0.0, |o| o.0));
            if let Some((_, r)) = &mix.salt {
                seen.covers("salt", r);
            }
            if let Some((_, r)) = &mix.divergent {
                seen.covers("divergent", &usize_range(r));
            }
        }
        if mix.step > 0 {
            seen.rate("cancel_mid", mix.cancel_mid);
            seen.rate("submit_mid", mix.submit_mid.as_ref().map_or(0.0, |m| m.0));
            if let Some((_, (t, fam, n))) = &mix.submit_mid {
                seen.covers("mid t", &usize_range(t));
                seen.covers("mid fam", fam);
                seen.covers("mid n", &usize_range(n));
            }
        }
        if mix.update > 0 {
            seen.covers("update t", &usize_range(&mix.tenants));
            if let Some(r) = &mix.floor {
                seen.covers("floor", &usize_range(r));
            }
            if let Some((p, r)) = &mix.cap {
                seen.rate("cap", *p);
                seen.covers("cap", &usize_range(r));
            }
            if let Some((p, r)) = &mix.step_cap {
                seen.rate("step_cap", *p);
                seen.covers("step_cap", &usize_range(r));
            }
            for (arg, r) in [("weight", &mix.weight), ("ns", &mix.ns)] {
                if let Some(r) = r {
                    seen.covers(arg, r);
                }
            }
            if let Some(r) = &mix.tier {
                seen.covers("tier", r);
            }
        }
        if mix.reconf > 0 {
            for (arg, r) in [("seqs", 1..7), ("mbt", 6..49), ("msl", 2..129)] {
                seen.covers(arg, &r);
            }
            seen.covers("reserve", &(0u8..4));
            seen.rate("ladder", 0.5);
            seen.rate("preempt", 0.5);
        }
        if mix.drain > 0 {
            seen.covers("delta", &(-5..40));
        }
        if mix.wait > 0 {
            seen.covers("dt", &(0u8..40));
        }
        if mix.remove > 0 {
            seen.covers("remove t", &usize_range(&mix.tenants));
            seen.covers("remove ns", &(0u8..3));
            seen.rate("cancel_all", 0.5);
            seen.rate("readd", 0.8);
        }
    }
}
