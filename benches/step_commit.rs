//! Step + commit per running sequence, by size of the running set, in Rust
//! alone: the steadier twin of `benches/scaling.py` for the question whether
//! the cost per sequence grows with the running set (no interpreter between
//! the calls, step and commit timed apart).
//!
//! The workload is scaling.py's (benches/bench_planner.py): `n` sequences
//! decoding (64-token prompts, 6,000 tokens each, none finishes during a run)
//! and four 7,000-token prompts in 256-token chunks, each replaced by another
//! when its prefill completes; one tenant, pages of 16 tokens. Sizes run in
//! turn, `--repeats` times, each run a fresh scheduler; a run's figure is the
//! median of its rounds, and the table gives the median of the runs.
//!
//!     cargo bench --bench step_commit -- [--cache on|off] [--repeats 5]
//!         [--rounds 1500] [--sizes 512,1024,2048,4096]

use kvsched::planner::OwnedPlanBuffers;
use kvsched::scheduler::{Scheduler, SchedulerConfig};
use kvsched::tenant::TenantConfig;
use std::time::Instant;

// The extension's heap (rust/heap.rs), so the figures are the module's (with
// the `python` feature the library installs it itself; run without it).
#[cfg(not(feature = "python"))]
#[global_allocator]
static HEAP: mimalloc::MiMalloc = mimalloc::MiMalloc;

const BLOCK: usize = 16;
const PROMPT: usize = 64;
const DECODE_TOKENS: usize = 6000;
const LONG_PROMPT: usize = 7000;

/// Prompt ids from a fixed linear congruential stream (any ids do).
struct Ids(u64);

impl Ids {
    fn prompt(&mut self, len: usize) -> Vec<i32> {
        (0..len)
            .map(|_| {
                self.0 = self
                    .0
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((self.0 >> 33) % 32000) as i32
            })
            .collect()
    }
}

struct Run {
    s: Scheduler,
    bufs: [OwnedPlanBuffers; 2],
    ids: Ids,
    now: f64,
    sampled: Vec<i32>,
}

impl Run {
    fn new(n: usize, cache: bool) -> Run {
        let per_seq = (PROMPT + DECODE_TOKENS).div_ceil(BLOCK);
        let config = SchedulerConfig {
            num_blocks: n * per_seq + 8 * (LONG_PROMPT / BLOCK + 2) + 16,
            block_size: BLOCK,
            max_num_seqs: n + 4,
            max_batched_tokens: (n + 4 * 256).max(2048),
            max_seq_len: 8192,
            long_prefill_chunk: 256,
            overhead_reserve: 0.0,
            max_waiting: 8,
            prefix_caching: cache,
            ..SchedulerConfig::default()
        };
        let mut s = Scheduler::new(config).expect("a valid config");
        s.add_tenant(TenantConfig::new("t")).expect("a new tenant");
        let shape = *s.plan_shape();
        let mut run = Run {
            s,
            bufs: [OwnedPlanBuffers::new(&shape), OwnedPlanBuffers::new(&shape)],
            ids: Ids(1),
            now: 0.0,
            sampled: vec![7; n + 4],
        };
        for _ in 0..n {
            run.submit(PROMPT, DECODE_TOKENS);
        }
        while run.round().0 < n {}
        for _ in 0..4 {
            run.submit(LONG_PROMPT, 1);
        }
        for _ in 0..13 {
            run.round();
        }
        run
    }

    fn submit(&mut self, len: usize, max_tokens: usize) {
        let prompt = self.ids.prompt(len);
        self.s
            .submit("t", &prompt, max_tokens, self.now)
            .expect("admitted");
    }

    /// One step and its commit: the decodes planned, and the seconds each took.
    fn round(&mut self) -> (usize, f64, f64) {
        let parity = self.s.next_parity();
        let t0 = Instant::now();
        let out = self
            .s
            .step(self.now, &mut self.bufs[parity].as_mut())
            .expect("a plan")
            .expect("something runs");
        let t1 = Instant::now();
        let events = self
            .s
            .commit(out.step_id, &self.sampled[..out.num_seqs], self.now)
            .expect("committed");
        let t2 = Instant::now();
        for _ in 0..events.finished.len() {
            self.submit(LONG_PROMPT, 1);
        }
        self.now += 0.02;
        let secs = |d: std::time::Duration| d.as_secs_f64();
        (out.num_decode, secs(t1 - t0), secs(t2 - t1))
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median ns per sequence of (step, commit, both) over `rounds` rounds at `n`.
fn measure(n: usize, cache: bool, rounds: usize) -> [f64; 3] {
    let mut run = Run::new(n, cache);
    let (mut step, mut commit, mut both) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let (decodes, a, b) = run.round();
        assert_eq!(decodes, n, "every sequence still decoding");
        step.push(a);
        commit.push(b);
        both.push(a + b);
    }
    let per_seq = |v| median(v) * 1e9 / n as f64;
    [per_seq(step), per_seq(commit), per_seq(both)]
}

fn main() {
    let mut cache = false;
    let (mut repeats, mut rounds) = (5, 1500);
    let mut sizes = vec![512, 1024, 2048, 4096];
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            "--cache" => cache = value() == "on",
            "--repeats" => repeats = value().parse().expect("--repeats N"),
            "--rounds" => rounds = value().parse().expect("--rounds N"),
            "--sizes" => {
                sizes = value()
                    .split(',')
                    .map(|s| s.parse().expect("--sizes 1024,4096"))
                    .collect()
            }
            // What `cargo bench` passes to every bench binary.
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    let mut runs: Vec<Vec<[f64; 3]>> = vec![Vec::new(); sizes.len()];
    for _ in 0..repeats {
        for (i, &n) in sizes.iter().enumerate() {
            runs[i].push(measure(n, cache, rounds));
        }
    }
    let cache_word = if cache { "on" } else { "off" };
    println!(
        "step + commit per running sequence, prefix cache {cache_word}, median of {repeats} runs \
         of {rounds} rounds"
    );
    println!("| sequences | step ns/seq | commit ns/seq | both ns/seq | both / at 1,024 | runs |");
    println!("|---|---|---|---|---|---|");
    let col = |i: usize, c: usize| median(runs[i].iter().map(|r| r[c]).collect());
    let at_1024 = sizes.iter().position(|&n| n == 1024).map(|i| col(i, 2));
    for (i, &n) in sizes.iter().enumerate() {
        let both = col(i, 2);
        let ratio = at_1024.map_or("-".to_string(), |b| format!("{:.3}", both / b));
        let each: Vec<String> = runs[i].iter().map(|r| format!("{:.1}", r[2])).collect();
        println!(
            "| {n} | {:.2} | {:.2} | {both:.2} | {ratio} | {} |",
            col(i, 0),
            col(i, 1),
            each.join(" ")
        );
    }
}
