//! A decode's commit without its request: the running set keeps, beside each
//! sequence's hot record, a `Tail` holding what a commit needs of the request
//! (the time of its last token, the tokens it may still sample, its stop
//! tokens) and the tokens it sampled since the request was last brought up to
//! date. A decode's commit writes one sequential line there and opens neither
//! the request nor the end of its token list, two lines at random addresses
//! per sequence per step that made the per-sequence cost grow with the
//! running set once it outgrew the L2 cache.
//!
//! The request catches up (`Scheduler::settle`) when the tail is full, when
//! the decode fills a block the prefix cache names, when it leaves the
//! running set (`remove_running`: finished, cancelled, preempted, handed
//! back), and before a commit goes through the request (`commit_opened`).
//! Until then its `tokens`, `num_computed` and last-token time lag by the
//! tail's `n` tokens: readers that take `&self` add them (`unsettled`,
//! `output_of`, and `Scheduler::request`, which returns a copy). The tail's
//! tokens themselves exist nowhere else: `check_hot` checks its last one
//! against the hot record, and the tests' fake engine every one of them
//! against the KV it reads back.

use super::*;

/// Tokens a tail holds: a request is opened once every this many decodes.
pub(super) const TAIL_TOKENS: usize = 10;

/// Stop tokens a tail checks itself; a request with more has its list read
/// on every commit (the request's own path).
const INLINE_STOPS: usize = 2;

/// See the module comment. 64 bytes, one line per running sequence.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(64))]
pub(super) struct Tail {
    /// When its last token was committed (negative before its first).
    pub(super) last_at: f64,
    /// Tokens it may still sample: max_tokens less those generated.
    pub(super) left: u32,
    /// Tokens in `buf`, sampled since the request was last settled.
    pub(super) n: u8,
    /// Stop tokens in `stops`; more than `INLINE_STOPS` when they do not fit.
    num_stops: u8,
    stops: [i32; INLINE_STOPS],
    pub(super) buf: [i32; TAIL_TOKENS],
}

const _: () = assert!(std::mem::size_of::<Tail>() == 64);

impl Tail {
    /// The tail of a settled request `r`.
    pub(super) fn of(r: &Request) -> Tail {
        let mut stops = [0; INLINE_STOPS];
        let num_stops = match r.stop_token_ids.len() {
            n if n <= INLINE_STOPS => {
                stops[..n].copy_from_slice(&r.stop_token_ids);
                n as u8
            }
            _ => INLINE_STOPS as u8 + 1,
        };
        Tail {
            last_at: r.last_token_at,
            left: left(r, r.generated()),
            n: 0,
            num_stops,
            stops,
            buf: [0; TAIL_TOKENS],
        }
    }

    /// Whether it can decide a commit by itself: its stop tokens fit.
    #[inline]
    pub(super) fn decides(&self) -> bool {
        usize::from(self.num_stops) <= INLINE_STOPS
    }

    /// Whether it describes `r` once its `n` tokens are added.
    pub(super) fn agrees_with(&self, r: &Request) -> bool {
        let mut settled = *self;
        settled.n = 0;
        let expected = Tail {
            left: left(r, r.generated() + usize::from(self.n)),
            last_at: if self.n > 0 {
                self.last_at
            } else {
                r.last_token_at
            },
            ..Tail::of(r)
        };
        settled.buf = [0; TAIL_TOKENS];
        settled == expected
    }

    /// Bring `r` up to date with the tokens held here.
    #[inline]
    pub(super) fn settle_into(&mut self, r: &mut Request) {
        let n = usize::from(self.n);
        if n > 0 {
            r.tokens.extend_from_slice(&self.buf[..n]);
            r.num_computed += n;
            r.set_last_token(self.last_at);
            self.n = 0;
        }
    }
}

/// Tokens `r` may still sample once it has generated `generated` (max_tokens
/// is bounded by max_seq_len, far below u32::MAX).
fn left(r: &Request, generated: usize) -> u32 {
    u32::try_from(r.max_tokens.saturating_sub(generated)).unwrap_or(u32::MAX)
}

impl Scheduler {
    /// Bring the request running at `pos` up to date with its tail.
    pub(super) fn settle(&mut self, pos: usize) {
        let slab = self.running.at(pos);
        self.running
            .tail_mut(pos)
            .settle_into(self.requests.get_mut(slab));
    }

    /// Tokens of `r` its tail holds (0 unless it is running).
    pub(super) fn unsettled(&self, r: &Request) -> usize {
        match r.place {
            Place::Running(pos) => usize::from(self.running.tails()[pos].n),
            _ => 0,
        }
    }

    /// Everything `r` generated so far, its tail's tokens included.
    /// A token not resolved yet (see overlap.rs) is left out.
    pub(super) fn output_of(&self, r: &Request) -> Vec<i32> {
        let mut out = r.output().to_vec();
        if let Place::Running(pos) = r.place {
            let tail = &self.running.tails()[pos];
            out.extend_from_slice(&tail.buf[..usize::from(tail.n)]);
        }
        out.truncate(overlap::known(&out).len());
        out
    }

    /// Commit `token`, sampled at `now` by the decode at position `pos` (plan
    /// and running set agree: see `RunningSet::version`), from the running
    /// set's arrays alone. Returns how it finished, if it did; the request
    /// catches up then, and whenever its tail fills or it fills a block the
    /// prefix cache names (`filled`).
    #[inline]
    pub(super) fn commit_decode(
        &mut self,
        pos: usize,
        token: i32,
        now: f64,
    ) -> Option<FinishReason> {
        let (h, tail, tid) = self.running.decode_mut(pos);
        debug_assert!(tail.decides() && tail.last_at >= 0.0 && tail.left > 0);
        let before = h.pos;
        h.pos += 1;
        h.token = token;
        self.tenants
            .get_mut(tid)
            .count_inter_token(now - tail.last_at);
        tail.last_at = now;
        tail.buf[usize::from(tail.n)] = token;
        tail.n += 1;
        tail.left -= 1;
        let reason = if tail.stops[..usize::from(tail.num_stops)].contains(&token) {
            Some(FinishReason::Stop)
        } else if tail.left == 0 {
            Some(FinishReason::Length)
        } else {
            None
        };
        let bs = self.shape.block_size;
        let filled = self.kv.caching() && bs.split(before).0 != bs.split(h.pos).0;
        // (One that finished catches up as it leaves: `remove_running`.)
        if filled || usize::from(tail.n) == TAIL_TOKENS {
            self.settle(pos);
        }
        if filled {
            self.filled.push(self.running.at(pos));
        }
        reason
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tail_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Tail>(), 64);
        assert_eq!(std::mem::align_of::<Tail>(), 64);
    }
}
