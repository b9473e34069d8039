//! The dicts of `Scheduler.stats()` and `Scheduler.pressure()`: pool counts,
//! per-tenant usage and latency histograms, rejections by reason, the ladder.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::ladder::rung_dict;
use crate::error::RejectReason;
use crate::ladder::{Ladder, Pressure};
use crate::metrics::{Histogram, LATENCY_BOUNDS};
use crate::scheduler::{self, Lifecycle};

/// Everything `stats()` reports, taken under the scheduler's lock.
pub(super) struct Snapshot {
    pub stats: scheduler::SchedulerStats,
    pub ladder: Ladder,
    pub pressure: Pressure,
    pub lifecycle: Lifecycle,
    pub events_dropped: u64,
}

impl Snapshot {
    pub(super) fn take(s: &scheduler::Scheduler, now: f64) -> Self {
        Snapshot {
            stats: s.stats(now),
            ladder: s.ladder().clone(),
            pressure: s.pressure(now),
            lifecycle: s.lifecycle(),
            events_dropped: s.events_dropped(),
        }
    }

    pub(super) fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = stats_dict(py, &self.stats)?;
        d.set_item("lifecycle", self.lifecycle.as_str())?;
        d.set_item("ladder", ladder_stats(py, &self.ladder)?)?;
        d.set_item("pressure", pressure_dict(py, &self.pressure)?)?;
        d.set_item("events_dropped", self.events_dropped)?;
        Ok(d)
    }
}

fn reasons_dict<'py>(
    py: Python<'py>,
    counts: &[u64; RejectReason::COUNT],
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for r in RejectReason::ALL {
        d.set_item(r.as_str(), counts[r.index()])?;
    }
    Ok(d)
}

fn histogram_dict<'py>(py: Python<'py>, h: &Histogram) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("count", h.count())?;
    d.set_item("sum", h.sum())?;
    let mut cumulative = Vec::with_capacity(LATENCY_BOUNDS.len() + 1);
    let mut acc = 0u64;
    for &c in h.counts() {
        acc += c;
        cumulative.push(acc);
    }
    d.set_item("buckets", cumulative)?;
    d.set_item("p50", h.quantile(0.5))?;
    d.set_item("p99", h.quantile(0.99))?;
    Ok(d)
}

fn stats_dict<'py>(
    py: Python<'py>,
    st: &scheduler::SchedulerStats,
) -> PyResult<Bound<'py, PyDict>> {
    let p = &st.pool;
    let pool = PyDict::new(py);
    pool.set_item("num_blocks", p.num_blocks)?;
    pool.set_item("block_size", p.block_size)?;
    pool.set_item("total", p.total)?;
    pool.set_item("free", p.free)?;
    pool.set_item("used", p.used)?;
    pool.set_item("shared", p.shared)?;
    pool.set_item("overhead_reserve", p.overhead_reserve)?;
    pool.set_item("usable", p.usable)?;
    pool.set_item("reserved", p.reserved)?;
    pool.set_item("committed", p.committed)?;
    pool.set_item("cached", p.cached)?;
    pool.set_item("evictable", p.evictable)?;
    pool.set_item("evictions", p.evictions)?;

    let tenants = PyDict::new(py);
    for t in &st.tenants {
        let m = &t.metrics;
        let d = PyDict::new(py);
        d.set_item("tier", t.tier)?;
        d.set_item("weight", t.weight)?;
        d.set_item("kv_floor_blocks", t.kv_floor_blocks)?;
        d.set_item("kv_cap_blocks", t.kv_cap_blocks)?;
        d.set_item("reserved_blocks", t.reserved_blocks)?;
        d.set_item("used_blocks", t.used_blocks)?;
        d.set_item("shared_blocks", t.shared_blocks)?;
        d.set_item("live_requests", t.live_requests)?;
        d.set_item("waiting", t.waiting)?;
        d.set_item("running", t.running)?;
        d.set_item("admitted", t.admitted)?;
        d.set_item("finished", t.finished)?;
        d.set_item("cancelled", t.cancelled)?;
        d.set_item("rejected", reasons_dict(py, &t.rejected)?)?;
        d.set_item("rate_tokens_available", t.rate_tokens_available)?;
        d.set_item("tokens_in", m.tokens_in)?;
        d.set_item("tokens_out", m.tokens_out)?;
        d.set_item("prefill_tokens", m.prefill_tokens)?;
        d.set_item("preemptions", m.preemptions)?;
        let prefix = PyDict::new(py);
        prefix.set_item("query_blocks", m.prefix_query_blocks)?;
        prefix.set_item("hit_blocks", m.prefix_hit_blocks)?;
        prefix.set_item("query_tokens", m.prefix_query_tokens)?;
        prefix.set_item("hit_tokens", m.prefix_hit_tokens)?;
        let rate = |hit: u64, query: u64| {
            if query == 0 {
                0.0
            } else {
                hit as f64 / query as f64
            }
        };
        prefix.set_item(
            "hit_rate_blocks",
            rate(m.prefix_hit_blocks, m.prefix_query_blocks),
        )?;
        prefix.set_item(
            "hit_rate_tokens",
            rate(m.prefix_hit_tokens, m.prefix_query_tokens),
        )?;
        d.set_item("prefix_cache", prefix)?;
        d.set_item("virtual_time", t.vtime)?;
        d.set_item("queue_time", histogram_dict(py, &m.queue_time)?)?;
        d.set_item("ttft", histogram_dict(py, &m.ttft)?)?;
        d.set_item("inter_token", histogram_dict(py, &m.inter_token)?)?;
        d.set_item("e2e", histogram_dict(py, &m.e2e)?)?;
        tenants.set_item(&t.name, d)?;
    }

    let out = PyDict::new(py);
    out.set_item("pool", pool)?;
    out.set_item("tenants", tenants)?;
    out.set_item("live_requests", st.live_requests)?;
    out.set_item("running", st.running)?;
    out.set_item("waiting", st.waiting)?;
    out.set_item("steps", st.steps)?;
    out.set_item("preemptions", st.preemptions)?;
    out.set_item("displaced", st.displaced)?;
    out.set_item("rejected", reasons_dict(py, &st.rejected)?)?;
    out.set_item("step_gap", histogram_dict(py, &st.step_gap)?)?;
    Ok(out)
}

pub(super) fn pressure_dict<'py>(py: Python<'py>, p: &Pressure) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("reserved_share", p.reserved_share)?;
    d.set_item("queue_depth", p.queue_depth)?;
    d.set_item("oldest_wait_s", p.oldest_wait_s)?;
    Ok(d)
}

/// The ladder's state for stats(): level, each rung with its climbs, and the
/// seconds spent at each level.
pub(super) fn ladder_stats<'py>(py: Python<'py>, l: &Ladder) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("level", l.level())?;
    let rungs = PyList::empty(py);
    for (i, r) in l.config().rungs.iter().enumerate() {
        let rd = rung_dict(py, r)?;
        rd.set_item("engaged", i < l.level())?;
        rd.set_item("climbs", l.climbs()[i])?;
        rungs.append(rd)?;
    }
    d.set_item("rungs", rungs)?;
    d.set_item("seconds_at_level", l.time_at().to_vec())?;
    Ok(d)
}
