//! Counters and latency histograms, per tenant. Fixed buckets (Prometheus style),
//! so observing is a few nanoseconds and exposition needs no per-request state.

/// Upper bounds of the latency buckets, in seconds (1-2-5 steps, 0.5 ms to 500 s).
pub const LATENCY_BOUNDS: [f64; 19] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0,
    100.0, 200.0, 500.0,
];

#[derive(Clone, Debug)]
pub struct Histogram {
    /// counts[i] = observations <= LATENCY_BOUNDS[i] and above the previous bound;
    /// the last slot counts those above every bound.
    counts: [u64; LATENCY_BOUNDS.len() + 1],
    sum: f64,
    count: u64,
    /// The last value observed and its bucket: the decodes of one step share
    /// their inter-token gap, so most observations skip the search.
    memo: (f64, usize),
}

/// Equal when the observations are (the memo is a cache, not state).
impl PartialEq for Histogram {
    fn eq(&self, other: &Self) -> bool {
        self.counts == other.counts && self.sum == other.sum && self.count == other.count
    }
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: [0; LATENCY_BOUNDS.len() + 1],
            sum: 0.0,
            count: 0,
            memo: (f64::NAN, 0), // NaN equals nothing: the first value searches
        }
    }
}

impl Histogram {
    pub fn observe(&mut self, seconds: f64) {
        let v = seconds.max(0.0);
        let i = if v == self.memo.0 {
            self.memo.1
        } else {
            let i = LATENCY_BOUNDS.partition_point(|&b| b < v);
            self.memo = (v, i);
            i
        };
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// Per-bucket (not cumulative) counts; the last is the overflow bucket.
    pub fn counts(&self) -> &[u64] {
        &self.counts
    }

    /// Estimate of quantile `q` (0..=1), interpolating linearly inside a bucket.
    /// None when empty. Coarse by design: exact per-request figures come with
    /// each finished request.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * self.count as f64;
        let mut seen = 0.0;
        for (i, &c) in self.counts.iter().enumerate() {
            if c == 0 {
                continue;
            }
            let next = seen + c as f64;
            if rank <= next {
                let lo = if i == 0 { 0.0 } else { LATENCY_BOUNDS[i - 1] };
                let hi = LATENCY_BOUNDS.get(i).copied().unwrap_or(lo * 2.0);
                return Some(lo + (hi - lo) * ((rank - seen) / c as f64));
            }
            seen = next;
        }
        Some(*LATENCY_BOUNDS.last().expect("non-empty"))
    }
}

/// What a tenant's requests went through, since the tenant was added.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TenantMetrics {
    /// Submit to entering the running set (first time).
    pub queue_time: Histogram,
    /// Submit to first generated token.
    pub ttft: Histogram,
    /// Between consecutive generated tokens of one request.
    pub inter_token: Histogram,
    /// Submit to finish.
    pub e2e: Histogram,
    /// Prompt tokens of admitted requests.
    pub tokens_in: u64,
    /// Generated tokens.
    pub tokens_out: u64,
    /// Prompt (and recomputed) tokens run through prefill.
    pub prefill_tokens: u64,
    /// Times one of its sequences was preempted (memory pressure or priority).
    pub preemptions: u64,
    /// Prefix cache, at submit: full prompt blocks looked up (all but the last
    /// prompt token can be served) and found.
    pub prefix_query_blocks: u64,
    pub prefix_hit_blocks: u64,
    /// Prompt tokens of the requests looked up, and those served from the cache.
    pub prefix_query_tokens: u64,
    pub prefix_hit_tokens: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_and_quantiles() {
        let mut h = Histogram::default();
        assert_eq!(h.quantile(0.5), None);
        for _ in 0..99 {
            h.observe(0.003); // (0.002, 0.005]
        }
        h.observe(7.0); // (5, 10]
        assert_eq!(h.count(), 100);
        assert!((h.sum() - (0.297 + 7.0)).abs() < 1e-9);
        let p50 = h.quantile(0.5).unwrap();
        assert!((0.002..=0.005).contains(&p50), "{p50}");
        let p100 = h.quantile(1.0).unwrap();
        assert!((5.0..=10.0).contains(&p100), "{p100}");
        h.observe(1e6);
        assert_eq!(h.counts()[LATENCY_BOUNDS.len()], 1);
        h.observe(0.001);
        assert_eq!(h.counts()[1], 1, "a bound belongs to its own bucket (le)");
    }
}
