//! Every integer knob at its extremes: 0, 1, MAX - 1, MAX,
//! 2^31 - 1, 2^32, 2^63 and powers of two, for the scheduler's and the
//! tenants' configuration, submit's `max_tokens` and the live updates. Each
//! case ends in one of two ways: a typed `InvalidConfig` (or, for a request,
//! a rejection), or a scheduler that runs random submit / step / commit /
//! cancel / update operations with `check_invariants` holding after every
//! one, no `Internal` error and no panic (the test build checks overflow, so
//! a wrapping sum panics here).

use super::*;

/// The values every integer knob is tried with.
fn extreme() -> BoxedStrategy<usize> {
    prop_oneof![
        3 => prop::sample::select(vec![
            0,
            1,
            2,
            3,
            (1 << 31) - 1,
            1 << 31,
            1 << 32,
            1 << 63,
            usize::MAX - 8,
            usize::MAX - 1,
            usize::MAX,
        ]),
        2 => (0u32..64).prop_map(|k| 1usize << k),
        2 => 0usize..80,
    ]
    .boxed()
}

fn extreme_u32() -> BoxedStrategy<u32> {
    prop_oneof![
        prop::sample::select(vec![0, 1, 2, u32::MAX - 1, u32::MAX, i32::MAX as u32]),
        0u32..5,
    ]
    .boxed()
}

fn extreme_rate() -> BoxedStrategy<Option<f64>> {
    prop::option::of(prop::sample::select(vec![
        0.0,
        1e-300,
        1e-6,
        0.5,
        1.0,
        100.0,
        1e15,
        1e300,
        f64::MAX,
        f64::INFINITY,
        f64::NAN,
        -1.0,
    ]))
    .boxed()
}

#[derive(Clone, Debug)]
struct Knobs {
    num_blocks: usize,
    block_size: usize,
    max_num_seqs: usize,
    max_batched_tokens: usize,
    max_seq_len: usize,
    max_waiting: usize,
    long_prefill_chunk: usize,
    buckets: Option<Vec<usize>>,
    watermark: Option<usize>,
}

fn knobs() -> impl Strategy<Value = Knobs> {
    // The pool's two knobs mostly small (every scheduler built here allocates
    // its pool and plan buffers), but extreme too: those are validated only.
    let small_or_extreme = || prop_oneof![4 => 2usize..300, 1 => extreme()];
    (
        (
            small_or_extreme(),
            prop_oneof![3 => 1usize..33, 1 => extreme()],
        ),
        (
            prop_oneof![2 => 1usize..16, 1 => extreme()],
            prop_oneof![2 => 16usize..2048, 1 => extreme()],
            prop_oneof![2 => 2usize..2048, 1 => extreme()],
            extreme(),
            extreme(),
        ),
        prop_oneof![
            2 => Just(None),
            1 => prop::collection::vec(extreme(), 1..5).prop_map(Some),
        ],
        prop::option::of(extreme()),
    )
        .prop_map(
            |((nb, bs), (seqs, mbt, msl, mw, lpc), buckets, watermark)| Knobs {
                num_blocks: nb,
                block_size: bs,
                max_num_seqs: seqs,
                max_batched_tokens: mbt,
                max_seq_len: msl,
                max_waiting: mw,
                long_prefill_chunk: lpc,
                buckets: buckets.map(|mut b| {
                    b.sort_unstable();
                    b.dedup();
                    b
                }),
                watermark,
            },
        )
}

#[derive(Clone, Debug)]
struct Tenantknobs {
    floor: usize,
    cap: Option<usize>,
    max_concurrent: Option<u32>,
    tier: u32,
    rate: Option<f64>,
    burst: Option<f64>,
    max_step_tokens: Option<usize>,
}

fn tenant_knobs() -> impl Strategy<Value = Tenantknobs> {
    (
        prop_oneof![2 => Just(0usize), 1 => extreme()],
        prop::option::of(extreme()),
        prop::option::of(extreme_u32()),
        extreme_u32(),
        extreme_rate(),
        extreme_rate(),
        prop::option::of(extreme()),
    )
        .prop_map(
            |(floor, cap, max_concurrent, tier, rate, burst, max_step_tokens)| Tenantknobs {
                floor,
                cap,
                max_concurrent,
                tier,
                rate,
                burst,
                max_step_tokens,
            },
        )
}

impl Tenantknobs {
    fn config(&self, name: &str) -> TenantConfig {
        let mut c = TenantConfig::new(name);
        c.kv_floor_blocks = self.floor;
        c.kv_cap_blocks = self.cap;
        c.max_concurrent = self.max_concurrent;
        c.tier = self.tier;
        c.rate_tokens_per_s = self.rate;
        c.burst_tokens = self.burst;
        c.max_step_tokens = self.max_step_tokens;
        c
    }
}

#[derive(Clone, Debug)]
enum XOp {
    Submit {
        t: usize,
        len: usize,
        max_tokens: usize,
    },
    Step,
    Cancel {
        pick: usize,
    },
    Update {
        t: usize,
        knobs: Tenantknobs,
    },
    Reconf {
        seqs: usize,
        mbt: usize,
        msl: usize,
        waiting: usize,
    },
    Time {
        now: f64,
    },
}

fn xops() -> impl Strategy<Value = Vec<XOp>> {
    let op = prop_oneof![
        6 => (0usize..3, prop_oneof![3 => 1usize..100, 1 => 0usize..2], extreme())
            .prop_map(|(t, len, max_tokens)| XOp::Submit { t, len, max_tokens }),
        6 => Just(XOp::Step),
        1 => any::<usize>().prop_map(|pick| XOp::Cancel { pick }),
        1 => (0usize..2, tenant_knobs()).prop_map(|(t, knobs)| XOp::Update { t, knobs }),
        1 => (extreme(), extreme(), extreme(), extreme())
            .prop_map(|(seqs, mbt, msl, waiting)| XOp::Reconf { seqs, mbt, msl, waiting }),
        1 => prop::sample::select(vec![
            0.0, 1.0, 59.0, 1e6, 1e11, 1e12, 1e13, 1e308, -1.0, f64::NAN, f64::INFINITY,
        ])
        .prop_map(|now| XOp::Time { now }),
    ];
    prop::collection::vec(op, 1..60)
}

/// An error a call with extreme values may give: anything typed but Internal
/// (a kvsched bug).
fn typed(e: &KvError) -> bool {
    !matches!(e, KvError::Internal(_))
}

fn build(k: &Knobs) -> KvResult<SchedulerConfig> {
    let config = SchedulerConfig {
        num_blocks: k.num_blocks,
        block_size: k.block_size,
        max_num_seqs: k.max_num_seqs,
        max_batched_tokens: k.max_batched_tokens,
        max_seq_len: k.max_seq_len,
        max_waiting: k.max_waiting,
        long_prefill_chunk: k.long_prefill_chunk,
        token_buckets: k.buckets.clone(),
        admission: match k.watermark {
            None => AdmissionMode::Reserve,
            Some(w) => AdmissionMode::Overcommit {
                watermark_blocks: w,
            },
        },
        full_validation: true,
        ..SchedulerConfig::default()
    };
    config.validate()?;
    Ok(config)
}

/// Run `ops` on a scheduler of `config` with tenants of `tenants`.
fn run(config: SchedulerConfig, tenants: &[Tenantknobs], ops: &[XOp]) -> Result<(), String> {
    let s = match Scheduler::new(config) {
        Ok(s) => s,
        Err(KvError::InvalidConfig(_)) => return Ok(()),
        Err(e) => return Err(format!("Scheduler::new: {e}")),
    };
    let mut s = s;
    let shape = *s.plan_shape();
    let mut bufs = [OwnedPlanBuffers::new(&shape), OwnedPlanBuffers::new(&shape)];
    let names = ["x0", "x1", "x2"];
    for (k, name) in tenants.iter().zip(names) {
        match s.add_tenant(k.config(name)) {
            Ok(()) | Err(KvError::InvalidConfig(_)) => {}
            Err(e) => return Err(format!("add_tenant: {e}")),
        }
    }
    s.check_invariants()?;
    let mut now = 0.0;
    let mut live: Vec<u64> = Vec::new();
    for op in ops {
        let result: KvResult<()> = match op {
            XOp::Submit { t, len, max_tokens } => {
                let prompt: Vec<i32> = (0..*len as i32).map(|i| i % 97 + 1).collect();
                s.submit(names[*t], &prompt, *max_tokens, now).map(|id| {
                    live.push(id);
                })
            }
            XOp::Step => {
                let parity = s.next_parity();
                match s.step(now, &mut bufs[parity].as_mut()) {
                    Ok(Some(out)) => {
                        let sampled = vec![5; out.num_seqs];
                        s.commit(out.step_id, &sampled, now).map(|ev| {
                            live.retain(|id| !ev.finished.iter().any(|f| f.id == *id));
                        })
                    }
                    Ok(None) => Ok(()),
                    Err(e) => Err(e),
                }
            }
            XOp::Cancel { pick } => {
                if live.is_empty() {
                    Ok(())
                } else {
                    let id = live.remove(pick % live.len());
                    s.cancel_at(id, now).map(|_| ())
                }
            }
            XOp::Update { t, knobs } => s.update_tenant(knobs.config(names[*t]), now),
            XOp::Reconf {
                seqs,
                mbt,
                msl,
                waiting,
            } => {
                let c = SchedulerConfig {
                    max_num_seqs: *seqs,
                    max_batched_tokens: *mbt,
                    max_seq_len: *msl,
                    max_waiting: *waiting,
                    ..s.config().clone()
                };
                s.update_config(c)
            }
            XOp::Time { now: t } => {
                // A time the scheduler takes moves the harness's clock;
                // one it refuses must change nothing.
                let before = s.stats(now);
                match s.submit("none", &[1], 1, *t) {
                    Err(KvError::InvalidRequest(_)) => {
                        if s.stats(now) != before {
                            return Err(format!("a refused time {t} changed the stats"));
                        }
                    }
                    _ => now = *t,
                }
                Ok(())
            }
        };
        if let Err(e) = &result {
            if !typed(e) {
                return Err(format!("{op:?}: {e}"));
            }
        }
        s.check_invariants()
            .map_err(|e| format!("after {op:?}: {e}"))?;
        now += 0.01;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(600))]

    #[test]
    fn extreme_knobs_give_a_typed_error_or_a_working_scheduler(
        k in knobs(),
        tenants in prop::collection::vec(tenant_knobs(), 1..3),
        ops in xops(),
    ) {
        let config = match build(&k) {
            Ok(c) => c,
            Err(KvError::InvalidConfig(_)) => return Ok(()),
            Err(e) => return Err(TestCaseError::fail(format!("validate: {e}"))),
        };
        // Build only what this test can afford to allocate (the pool and its
        // plan buffers); larger valid configs were validated above.
        if config.num_blocks > 1024 || config.num_blocks * config.block_size > 1 << 16 {
            return Ok(());
        }
        run(config, &tenants, &ops).map_err(TestCaseError::fail)?;
    }
}

/// A tenant floor no pool can hold (sums of floors and reservations that
/// would wrap): refused as InvalidConfig, and nothing changes.
#[test]
fn a_floor_larger_than_any_pool_is_refused_and_changes_nothing() {
    let mut s = sched(256, 16);
    s.add_tenant(tenant("a", 4, None)).unwrap();
    let committed = s.tenants().committed();
    for floor in [usize::MAX, 1 << 63, 1 << 32, (1 << 31) + 5] {
        let err = s.add_tenant(tenant("z", floor, None)).unwrap_err();
        assert!(
            matches!(&err, KvError::InvalidConfig(m) if m.contains("kv_floor_blocks")),
            "{err}"
        );
        let err = s.update_tenant(tenant("a", floor, None), 0.0).unwrap_err();
        assert!(matches!(err, KvError::InvalidConfig(_)), "{err}");
        assert_eq!(s.tenants().committed(), committed);
        assert_eq!(s.tenants().by_name("a").unwrap().config.kv_floor_blocks, 4);
    }
    // A floor within int32 but beyond this pool: refused by the pool's bound.
    let err = s.add_tenant(tenant("z", 1 << 30, None)).unwrap_err();
    assert!(
        matches!(&err, KvError::InvalidConfig(m) if m.contains("usable")),
        "{err}"
    );
    s.check_invariants().unwrap();
}

#[test]
fn a_huge_max_waiting_means_no_limit_but_the_pool() {
    for max_waiting in [usize::MAX, usize::MAX - 8, 1 << 63] {
        let mut s = Scheduler::new(SchedulerConfig {
            max_waiting,
            ..config(256, 16)
        })
        .unwrap();
        s.add_tenant(TenantConfig::new("a")).unwrap();
        for k in 0..20 {
            s.submit("a", &prompt(4, k), 4, 0.0).unwrap();
        }
        s.check_invariants().unwrap();
    }
}

#[test]
fn a_huge_watermark_reserves_the_final_length() {
    for w in [usize::MAX, usize::MAX - 1, 1 << 63] {
        let mut s = Scheduler::new(SchedulerConfig {
            admission: AdmissionMode::Overcommit {
                watermark_blocks: w,
            },
            ..config(256, 16)
        })
        .unwrap();
        s.add_tenant(TenantConfig::new("a")).unwrap();
        // 4 + 300 tokens: 19 blocks at its final length.
        s.submit("a", &prompt(4, 1), 252, 0.0).unwrap();
        assert_eq!(s.tenants().committed(), 16, "ceil(256 / 16)");
        s.check_invariants().unwrap();
    }
}

/// Plan buffers are bounded by what the pool can use, so configs that ask
/// for absurd shapes build small schedulers instead of crashing.
#[test]
fn plan_shapes_are_bounded_by_the_pool() {
    let base = SchedulerConfig {
        num_blocks: 1024,
        block_size: 16,
        ..SchedulerConfig::default()
    };
    for c in [
        SchedulerConfig {
            max_seq_len: (1 << 31) - 1,
            ..base.clone()
        },
        SchedulerConfig {
            max_num_seqs: 100_000_000,
            max_batched_tokens: 100_000_000,
            ..base.clone()
        },
        SchedulerConfig {
            max_batched_tokens: (1 << 31) - 1,
            ..base.clone()
        },
        SchedulerConfig {
            max_batched_tokens: usize::MAX,
            max_num_seqs: usize::MAX,
            ..base.clone()
        },
    ] {
        let s = Scheduler::new(c.clone()).unwrap();
        let shape = *s.plan_shape();
        assert!(shape.max_seqs <= 1023, "{shape:?}");
        assert!(shape.pages_per_seq <= 1023, "{shape:?}");
        assert!(
            shape.max_tokens <= 16384,
            "{shape:?}: 1023 pages of 16 slots"
        );
        assert!(s.max_running() <= shape.max_seqs);
        // The same config again is not a restart.
        let mut s = s;
        s.update_config(c).unwrap();
    }
}
