//! KV-cache groups: the attention kinds a model's layers mix, and what each
//! kind keeps of a sequence.
//!
//! Layers of one kind form groups of equal size (the engine chooses how many
//! layers a page holds), and every group draws its pages from the one pool:
//! a page holds one group's layers for `block_size` tokens. Each request has
//! one page table per group. The split of the pool between kinds therefore
//! follows the workload (vLLM v1's layout), where per-kind pools fix a ratio
//! at start (SGLang's). Group 0 is always full attention; a model with one
//! group is today's contract, at today's cost.
//!
//! What a kind keeps, for a query at position p:
//! - full: every position, [0, p];
//! - sliding window W: [max(0, p - W + 1), p], W positions;
//! - chunked local C: [floor(p / C) * C, p], its own chunk of C.
//!
//! A page entirely before what the step's first query reads goes back (to
//! the pool, or to the prefix cache's LRU when named) and page 0 takes its
//! place in the table. Pages go back when a group takes a new one (a decode
//! every `block_size` tokens, a prefill chunk), so what a window group holds
//! at once is bounded by `AttentionKind::reserve`, which admission reserves.

use crate::error::{KvError, KvResult};
use crate::page::BlockSize;

/// What one group's layers attend to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// Every earlier position.
    Full,
    /// The last `W` positions, the query's own included.
    SlidingWindow(usize),
    /// The query's own chunk of `C` positions (chunks start at multiples of C).
    ChunkedLocal(usize),
}

impl AttentionKind {
    /// Parse "full", "sliding_window:W" or "chunked_local:C" (W, C >= 1).
    pub fn parse(text: &str) -> KvResult<Self> {
        let bad = |why: &str| {
            KvError::InvalidConfig(format!(
                "KV-cache group {text:?}: {why} (one of \"full\", \"sliding_window:W\", \
                 \"chunked_local:C\", with W and C positive integers)"
            ))
        };
        let (kind, given) = match text.split_once(':') {
            None => (text, None),
            Some((k, n)) => (k, Some(n)),
        };
        let size = || -> KvResult<usize> {
            let n = given.ok_or_else(|| bad("no size"))?;
            let digits = !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit());
            match n.parse::<usize>() {
                Ok(v) if digits && v >= 1 && v <= i32::MAX as usize => Ok(v),
                _ => Err(bad("the size is not a positive integer")),
            }
        };
        match kind {
            "full" if given.is_none() => Ok(AttentionKind::Full),
            "sliding_window" => Ok(AttentionKind::SlidingWindow(size()?)),
            "chunked_local" => Ok(AttentionKind::ChunkedLocal(size()?)),
            _ => Err(bad("unknown kind")),
        }
    }

    /// The name `parse` reads back.
    pub fn name(self) -> String {
        match self {
            AttentionKind::Full => "full".into(),
            AttentionKind::SlidingWindow(w) => format!("sliding_window:{w}"),
            AttentionKind::ChunkedLocal(c) => format!("chunked_local:{c}"),
        }
    }

    /// The first position a query at `pos` reads.
    #[inline]
    pub fn visible_from(self, pos: usize) -> usize {
        match self {
            AttentionKind::Full => 0,
            AttentionKind::SlidingWindow(w) => (pos + 1).saturating_sub(w),
            AttentionKind::ChunkedLocal(c) => pos - pos % c,
        }
    }

    /// Pages a request of final length `len` holds at most at once in a group
    /// of this kind, when no step runs more than `chunk` of its tokens.
    ///
    /// A step whose queries are [a, a + q) reads from `visible_from(a)`, and
    /// the group holds the pages from there to a + q - 1: for a window (or a
    /// chunk) of W that is at most W - 1 + q positions, which touch at most
    /// ceil((W + q - 2) / B) + 1 pages of B (one more than the span needs
    /// when it starts inside a page). Pages go back only when the group takes
    /// a new one, and a step that takes none holds what the last one that did
    /// left, so the bound holds between those steps too; a decode (q = 1)
    /// holds at most ceil((W - 1) / B) + 1. Never more than the full length's
    /// pages.
    pub fn reserve(self, len: usize, block: BlockSize, chunk: usize) -> usize {
        let full = block.blocks_for(len);
        let span = match self {
            AttentionKind::Full => return full,
            AttentionKind::SlidingWindow(w) | AttentionKind::ChunkedLocal(w) => w,
        };
        let held = block.blocks_for((span + chunk.max(1)).saturating_sub(2)) + 1;
        full.min(held)
    }
}

/// A model's KV-cache groups, group 0 first (always full attention).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvGroups {
    kinds: Vec<AttentionKind>,
}

impl Default for KvGroups {
    fn default() -> Self {
        KvGroups::single()
    }
}

impl KvGroups {
    /// One full-attention group: every layer keeps every token.
    pub fn single() -> Self {
        KvGroups {
            kinds: vec![AttentionKind::Full],
        }
    }

    /// Groups of these kinds, in order; group 0 must be full attention.
    pub fn new(kinds: Vec<AttentionKind>) -> KvResult<Self> {
        match kinds.first() {
            None => Err(KvError::InvalidConfig(
                "kv_cache_groups must name at least one group".into(),
            )),
            Some(AttentionKind::Full) => Ok(KvGroups { kinds }),
            Some(k) => Err(KvError::InvalidConfig(format!(
                "kv_cache_groups: group 0 must be \"full\", not {:?} (the groups of a model \
                 with no full-attention layer are not supported)",
                k.name()
            ))),
        }
    }

    /// Parse each name (see `AttentionKind::parse`).
    pub fn parse<S: AsRef<str>>(names: &[S]) -> KvResult<Self> {
        let kinds = names
            .iter()
            .map(|n| AttentionKind::parse(n.as_ref()))
            .collect::<KvResult<Vec<_>>>()?;
        Self::new(kinds)
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    /// Never: group 0 always exists.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether there is more than one group (a table per group per request).
    #[inline]
    pub fn is_hybrid(&self) -> bool {
        self.kinds.len() > 1
    }

    pub fn kinds(&self) -> &[AttentionKind] {
        &self.kinds
    }

    /// The groups after group 0.
    pub fn extra(&self) -> &[AttentionKind] {
        &self.kinds[1..]
    }

    /// Pages a request of final length `len` reserves: the sum over groups of
    /// `AttentionKind::reserve` (one group: ceil(len / B), as always).
    pub fn reserve(&self, len: usize, block: BlockSize, chunk: usize) -> usize {
        self.kinds
            .iter()
            .map(|k| k.reserve(len, block, chunk))
            .fold(0usize, usize::saturating_add)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_and_print_back() {
        for name in [
            "full",
            "sliding_window:512",
            "chunked_local:8192",
            "sliding_window:1",
        ] {
            assert_eq!(AttentionKind::parse(name).unwrap().name(), name);
        }
        for bad in [
            "",
            "full:3",
            "sliding_window",
            "sliding_window:",
            "sliding_window:0",
            "sliding_window:-4",
            "sliding_window:1.5",
            "chunked_local:x",
            "swa:512",
            "sliding_window:99999999999",
            "sliding_window:+4",
            "sliding_window: 4",
        ] {
            let e = AttentionKind::parse(bad).unwrap_err();
            assert!(matches!(e, KvError::InvalidConfig(_)), "{bad:?}: {e}");
        }
        assert!(KvGroups::parse(&["sliding_window:4", "full"]).is_err());
        assert!(KvGroups::parse::<&str>(&[]).is_err());
        assert!(!KvGroups::parse(&["full"]).unwrap().is_hybrid());
    }

    #[test]
    fn what_a_query_reads() {
        let w = AttentionKind::SlidingWindow(4);
        assert_eq!(
            (0..8).map(|p| w.visible_from(p)).collect::<Vec<_>>(),
            [0, 0, 0, 0, 1, 2, 3, 4]
        );
        let c = AttentionKind::ChunkedLocal(4);
        assert_eq!(
            (0..9).map(|p| c.visible_from(p)).collect::<Vec<_>>(),
            [0, 0, 0, 0, 4, 4, 4, 4, 8]
        );
        assert_eq!(AttentionKind::Full.visible_from(1000), 0);
    }

    /// The reservation bound is the most pages any step can make a window
    /// group hold: brute force over every start position, chunk and block
    /// alignment of a small case.
    #[test]
    fn the_reservation_covers_every_step_a_window_can_take() {
        for bs in [1usize, 2, 3, 4, 16] {
            let block = BlockSize::new(bs);
            for w in 1..=20 {
                for chunk in 1..=12 {
                    for kind in [
                        AttentionKind::SlidingWindow(w),
                        AttentionKind::ChunkedLocal(w),
                    ] {
                        for len in 1..=60 {
                            let bound = kind.reserve(len, block, chunk);
                            // Queries [a, a + q) with a + q <= len: pages from
                            // the first one read to the last one written.
                            let mut most = 0;
                            for a in 0..len {
                                for q in 1..=chunk.min(len - a) {
                                    let first = kind.visible_from(a) / bs;
                                    let last = (a + q - 1) / bs;
                                    most = most.max(last + 1 - first);
                                }
                            }
                            assert!(
                                most <= bound,
                                "{kind:?} bs={bs} chunk={chunk} len={len}: {most} > {bound}"
                            );
                            assert!(bound <= len.div_ceil(bs));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_single_group_reserves_the_final_length() {
        let g = KvGroups::single();
        assert_eq!(g.reserve(100, BlockSize::new(16), 512), 7);
        let h = KvGroups::parse(&["full", "sliding_window:512", "sliding_window:512"]).unwrap();
        // 8k tokens, block 16, chunk 512: 512 full + 2 x (ceil(1022 / 16) + 1 = 65).
        assert_eq!(h.reserve(8192, BlockSize::new(16), 512), 512 + 2 * 65);
        // Shorter than the window: the window group holds it all.
        assert_eq!(h.reserve(100, BlockSize::new(16), 512), 3 * 7);
    }
}
