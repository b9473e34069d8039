//! The step plan as arrays: writing them, padding them, checking them.
//!
//! The scheduler decides which sequences run and how many tokens each gets; this
//! module turns that into the fixed-shape int32 arrays the attention kernel eats
//! (see "The StepPlan contract" in DESIGN.md) and validates the result.
//!
//! Two buffer sets alternate (double buffering): the arrays of step N are written
//! again at step N + 2, so the engine may keep reading them while step N + 1 is
//! planned. Each buffer set remembers which sequence each page-table row holds,
//! so a step rewrites only the rows and pages that changed since that buffer was
//! last written: the cost follows what changed, not S x pages-per-sequence.

use crate::buckets::TokenBuckets;
use crate::error::{KvError, KvResult};
use crate::groups::AttentionKind;
use crate::page::BlockSize;
use crate::pool::BlockPool;

/// Fixed dimensions of every plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanShape {
    /// Largest token bucket: the length of the token-indexed buffers.
    pub max_tokens: usize,
    /// S = max_num_seqs.
    pub max_seqs: usize,
    /// PPS = ceil(max_seq_len / block_size).
    pub pages_per_seq: usize,
    pub block_size: BlockSize,
    /// num_blocks * block_size: out of range, so a padded write is dropped.
    pub pad_slot: i32,
    /// KV-cache groups (crate::groups): one page table and slot mapping each.
    pub num_groups: usize,
}

/// Mutable views of one buffer set; the bindings back these with numpy arrays.
pub struct PlanBuffers<'a> {
    pub token_ids: &'a mut [i32],
    pub positions: &'a mut [i32],
    pub slot_mapping: &'a mut [i32],
    pub cu_q_lens: &'a mut [i32],
    pub kv_lens: &'a mut [i32],
    /// Row-major [S, PPS].
    pub page_indices: &'a mut [i32],
    pub num_seqs: &'a mut [i32],
    pub distribution: &'a mut [i32],
    pub logits_indices: &'a mut [i32],
    /// The KV-cache groups after group 0: row-major [G - 1, S, PPS] (empty
    /// for a model with one group).
    pub group_page_indices: &'a mut [i32],
    /// Row-major [G - 1, T].
    pub group_slot_mapping: &'a mut [i32],
}

impl PlanBuffers<'_> {
    fn check_shape(&self, s: &PlanShape) -> KvResult<()> {
        let extra = s.num_groups.saturating_sub(1);
        let ok = self.group_page_indices.len() == extra * s.max_seqs * s.pages_per_seq
            && self.group_slot_mapping.len() == extra * s.max_tokens
            && self.token_ids.len() == s.max_tokens
            && self.positions.len() == s.max_tokens
            && self.slot_mapping.len() == s.max_tokens
            && self.cu_q_lens.len() == s.max_seqs + 1
            && self.kv_lens.len() == s.max_seqs
            && self.page_indices.len() == s.max_seqs * s.pages_per_seq
            && self.num_seqs.len() == 1
            && self.distribution.len() == 3
            && self.logits_indices.len() == s.max_seqs;
        if ok {
            Ok(())
        } else {
            Err(KvError::Internal(
                "plan buffers do not match the plan shape".into(),
            ))
        }
    }
}

/// Plan buffers owned by Rust (tests, benchmarks, Rust users of the core).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnedPlanBuffers {
    pub token_ids: Vec<i32>,
    pub positions: Vec<i32>,
    pub slot_mapping: Vec<i32>,
    pub cu_q_lens: Vec<i32>,
    pub kv_lens: Vec<i32>,
    pub page_indices: Vec<i32>,
    pub num_seqs: Vec<i32>,
    pub distribution: Vec<i32>,
    pub logits_indices: Vec<i32>,
    pub group_page_indices: Vec<i32>,
    pub group_slot_mapping: Vec<i32>,
}

impl OwnedPlanBuffers {
    pub fn new(s: &PlanShape) -> Self {
        let extra = s.num_groups.saturating_sub(1);
        OwnedPlanBuffers {
            group_page_indices: vec![0; extra * s.max_seqs * s.pages_per_seq],
            group_slot_mapping: vec![s.pad_slot; extra * s.max_tokens],
            token_ids: vec![0; s.max_tokens],
            positions: vec![0; s.max_tokens],
            slot_mapping: vec![s.pad_slot; s.max_tokens],
            cu_q_lens: vec![0; s.max_seqs + 1],
            kv_lens: vec![0; s.max_seqs],
            page_indices: vec![0; s.max_seqs * s.pages_per_seq],
            num_seqs: vec![0; 1],
            distribution: vec![0; 3],
            logits_indices: vec![0; s.max_seqs],
        }
    }

    pub fn as_mut(&mut self) -> PlanBuffers<'_> {
        PlanBuffers {
            token_ids: &mut self.token_ids,
            positions: &mut self.positions,
            slot_mapping: &mut self.slot_mapping,
            cu_q_lens: &mut self.cu_q_lens,
            kv_lens: &mut self.kv_lens,
            page_indices: &mut self.page_indices,
            num_seqs: &mut self.num_seqs,
            distribution: &mut self.distribution,
            logits_indices: &mut self.logits_indices,
            group_page_indices: &mut self.group_page_indices,
            group_slot_mapping: &mut self.group_slot_mapping,
        }
    }

    /// Group `g`'s page table, row-major [S, PPS] (group 0: `page_indices`).
    pub fn group_rows(&self, s: &PlanShape, g: usize) -> &[i32] {
        let n = s.max_seqs * s.pages_per_seq;
        match g {
            0 => &self.page_indices,
            _ => &self.group_page_indices[(g - 1) * n..g * n],
        }
    }

    /// Group `g`'s slot mapping, [T] (group 0: `slot_mapping`).
    pub fn group_slots(&self, s: &PlanShape, g: usize) -> &[i32] {
        match g {
            0 => &self.slot_mapping,
            _ => &self.group_slot_mapping[(g - 1) * s.max_tokens..g * s.max_tokens],
        }
    }
}

/// What one buffer set's page table holds, row by row.
#[derive(Clone, Debug)]
pub struct RowCache {
    /// Key of the page list in each row (0: none). A sequence gets a fresh key
    /// whenever its page list is rebuilt (entering the running set).
    keys: Vec<u64>,
    /// Pages written in each row; entries past it are page 0.
    filled: Vec<u32>,
}

impl RowCache {
    pub fn new(max_seqs: usize) -> Self {
        RowCache {
            keys: vec![0; max_seqs],
            filled: vec![0; max_seqs],
        }
    }

    /// Forget every row: the buffer set's page table must be all zeros
    /// (padding) before its next plan, which then writes every row in full.
    pub fn forget(&mut self) {
        self.keys.fill(0);
        self.filled.fill(0);
    }
}

/// A prefill chunk (or any sequence planned from its lists), in plan order.
pub struct SeqSlice<'a> {
    /// Identifies the page list (see `RowCache`).
    pub row_key: u64,
    /// All tokens of the sequence; the scheduled ones are `[start, start + q_len)`.
    pub tokens: &'a [i32],
    pub start: usize,
    pub q_len: usize,
    pub pages: &'a [u32],
}

/// A decode as the plan needs it: its one token (its last) at `pos`, and of
/// its page list only the length and the last page, which holds `pos`. The
/// scheduler keeps one per running sequence, in plan order, so the decodes
/// of a step are planned from one sequential array.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeSeq {
    /// Identifies the page list (see `RowCache`).
    pub row_key: u64,
    /// Tokens whose KV is written: the position of the token it runs.
    pub pos: usize,
    /// The token it runs.
    pub token: i32,
    /// The last page it holds (0 while it holds none).
    pub last_page: u32,
    pub num_pages: usize,
}

/// Where the padding and bucket choice landed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WrittenPlan {
    pub num_seqs: usize,
    pub num_tokens: usize,
    pub bucket: usize,
}

/// Write a plan into `bufs`: first the `decodes`, then the `chunks`, in plan
/// order. Rows are updated incrementally against `rows`; a decode's row that
/// must be rewritten whole reads its page list from `pages_of(i)`.
///
/// The cheap checks run here, on every plan, as the arrays are written: each
/// sequence runs at least one token, within its tokens; its pages cover exactly
/// its kv_len and fit a row; the tokens fit a bucket; and the pages it writes are
/// its own (refcount 1, looked up only while the pool shares any page at all),
/// so no slot is written twice. `validate` re-reads the written arrays in full.
#[allow(clippy::too_many_arguments)]
pub fn write_plan<'s>(
    shape: &PlanShape,
    buckets: &TokenBuckets,
    bufs: &mut PlanBuffers<'_>,
    rows: &mut RowCache,
    pool: &BlockPool,
    decodes: &[DecodeSeq],
    chunks: impl ExactSizeIterator<Item = SeqSlice<'s>>,
    pages_of: impl Fn(usize) -> &'s [u32],
) -> KvResult<WrittenPlan> {
    bufs.check_shape(shape)?;
    let num_decode = decodes.len();
    let n = num_decode + chunks.len();
    if n > shape.max_seqs {
        return Err(KvError::Internal(format!(
            "{n} sequences in a plan of {}",
            shape.max_seqs
        )));
    }
    let bs = shape.block_size;
    let pps = shape.pages_per_seq;
    bufs.cu_q_lens[0] = 0;
    let check_owner = pool.shared() > 0;
    write_decodes(shape, bufs, rows, pool, check_owner, decodes, pages_of)?;
    let mut off = num_decode;
    for (i, seq) in (num_decode..).zip(chunks) {
        let end = off + seq.q_len;
        let kv_len = seq.start + seq.q_len;
        if seq.q_len == 0 || end > shape.max_tokens || kv_len > seq.tokens.len() {
            return Err(KvError::Internal(format!(
                "invalid step plan: sequence {i} runs {} tokens from {} (plan at {off})",
                seq.q_len, seq.start
            )));
        }
        if seq.pages.len() != bs.blocks_for(kv_len) || seq.pages.len() > pps {
            return Err(KvError::Internal(format!(
                "invalid step plan: sequence {i} has {} pages for kv_len {kv_len}",
                seq.pages.len()
            )));
        }
        if seq.q_len == 1 {
            // One token, no copy loop.
            let pos = seq.start;
            let (idx, in_page) = bs.split(pos);
            let page = seq.pages[idx];
            if check_owner && pool.refcount(page) != 1 {
                return Err(not_own(i, page));
            }
            bufs.token_ids[off] = seq.tokens[pos];
            bufs.positions[off] = pos as i32;
            bufs.slot_mapping[off] = (page as usize * bs.get() + in_page) as i32;
        } else {
            bufs.token_ids[off..end].copy_from_slice(&seq.tokens[seq.start..kv_len]);
            // Page by page: within a page, positions and slots both count up.
            let (mut pos, mut at) = (seq.start, off);
            while pos < kv_len {
                let (idx, in_page) = bs.split(pos);
                let page = seq.pages[idx];
                if check_owner && pool.refcount(page) != 1 {
                    return Err(not_own(i, page));
                }
                let run = (bs.get() - in_page).min(kv_len - pos);
                let slot = (page as usize * bs.get() + in_page) as i32;
                let positions = &mut bufs.positions[at..at + run];
                let slots = &mut bufs.slot_mapping[at..at + run];
                for (k, (p, s)) in positions.iter_mut().zip(slots).enumerate() {
                    *p = (pos + k) as i32;
                    *s = slot + k as i32;
                }
                pos += run;
                at += run;
            }
        }
        bufs.cu_q_lens[i + 1] = end as i32;
        bufs.kv_lens[i] = kv_len as i32;
        bufs.logits_indices[i] = end as i32 - 1;
        // kv_len >= 1, so it holds a page (checked above).
        let last = seq.pages[seq.pages.len() - 1];
        let row = Row {
            key: seq.row_key,
            num_pages: seq.pages.len(),
            last_page: last,
        };
        write_row(bufs.page_indices, rows, i, pps, row, || seq.pages);
        off = end;
    }
    let bucket = buckets
        .fit(off)
        .ok_or_else(|| KvError::Internal(format!("{off} tokens fit no bucket")))?;
    // Padding, exactly as the contract says.
    bufs.token_ids[off..bucket].fill(0);
    bufs.positions[off..bucket].fill(0);
    bufs.slot_mapping[off..bucket].fill(shape.pad_slot);
    bufs.cu_q_lens[n + 1..].fill(off as i32);
    bufs.kv_lens[n..].fill(0);
    bufs.logits_indices[n..].fill((off as i32 - 1).max(0));
    for i in n..shape.max_seqs {
        clear_row(bufs.page_indices, rows, i, pps);
    }
    bufs.num_seqs[0] = n as i32;
    bufs.distribution
        .copy_from_slice(&[num_decode as i32, num_decode as i32, n as i32]);
    Ok(WrittenPlan {
        num_seqs: n,
        num_tokens: off,
        bucket,
    })
}

/// The decodes lead the plan: sequence i runs one token at plan offset i. One
/// pass over their records, the arrays sliced to them up front.
fn write_decodes<'s>(
    shape: &PlanShape,
    bufs: &mut PlanBuffers<'_>,
    rows: &mut RowCache,
    pool: &BlockPool,
    check_owner: bool,
    decodes: &[DecodeSeq],
    pages_of: impl Fn(usize) -> &'s [u32],
) -> KvResult<()> {
    let nd = decodes.len();
    let (bs, pps) = (shape.block_size, shape.pages_per_seq);
    if nd > shape.max_tokens {
        let pos = decodes[shape.max_tokens].pos;
        return Err(KvError::Internal(format!(
            "invalid step plan: sequence {} runs 1 tokens from {pos} (plan at {})",
            shape.max_tokens, shape.max_tokens
        )));
    }
    // First the checks and the page-table rows, then each array in a pass
    // of its own (plain loops over two slices, which the compiler unrolls
    // and vectorizes).
    for (i, d) in decodes.iter().enumerate() {
        let kv_len = d.pos + 1;
        if d.num_pages != bs.blocks_for(kv_len) || d.num_pages > pps {
            return Err(KvError::Internal(format!(
                "invalid step plan: sequence {i} has {} pages for kv_len {kv_len}",
                d.num_pages
            )));
        }
        debug_assert!({
            let pages = pages_of(i);
            pages.len() == d.num_pages && pages.last() == Some(&d.last_page)
        });
        // Its token is in its last page (the page count is checked).
        if check_owner && pool.refcount(d.last_page) != 1 {
            return Err(not_own(i, d.last_page));
        }
        let row = Row {
            key: d.row_key,
            num_pages: d.num_pages,
            last_page: d.last_page,
        };
        write_row(bufs.page_indices, rows, i, pps, row, || pages_of(i));
    }
    for (t, d) in bufs.token_ids[..nd].iter_mut().zip(decodes) {
        *t = d.token;
    }
    for (p, d) in bufs.positions[..nd].iter_mut().zip(decodes) {
        *p = d.pos as i32;
    }
    for (s, d) in bufs.slot_mapping[..nd].iter_mut().zip(decodes) {
        let (_, in_page) = bs.split(d.pos);
        *s = (d.last_page as usize * bs.get() + in_page) as i32;
    }
    for (k, d) in bufs.kv_lens[..nd].iter_mut().zip(decodes) {
        *k = d.pos as i32 + 1;
    }
    // One token each: sequence i ends at token i + 1.
    for (i, (c, l)) in bufs.cu_q_lens[1..=nd]
        .iter_mut()
        .zip(&mut bufs.logits_indices[..nd])
        .enumerate()
    {
        *c = i as i32 + 1;
        *l = i as i32;
    }
    Ok(())
}

fn not_own(i: usize, page: u32) -> KvError {
    KvError::Internal(format!(
        "invalid step plan: sequence {i} writes into page {page}, which it does not hold alone"
    ))
}

/// What the row cache needs of a sequence's page list to update its row.
struct Row {
    key: u64,
    num_pages: usize,
    last_page: u32,
}

/// Bring row `i` up to the sequence's page list; `pages()` gives the whole
/// list, read only when the row must be rewritten (a new key, or more than
/// one page added).
#[inline]
fn write_row<'p>(
    table: &mut [i32],
    rows: &mut RowCache,
    i: usize,
    pps: usize,
    row: Row,
    pages: impl FnOnce() -> &'p [u32],
) {
    let filled = rows.filled[i] as usize;
    if rows.keys[i] == row.key {
        // The common cases: a running sequence whose row is as it was, or has
        // grown by the one page this step's tokens opened (its last).
        if filled == row.num_pages {
            return;
        }
        if filled + 1 == row.num_pages {
            table[i * pps + filled] = row.last_page as i32;
            rows.filled[i] += 1;
            return;
        }
    }
    write_row_slow(table, rows, i, pps, row.key, pages());
}

#[cold]
fn write_row_slow(
    table: &mut [i32],
    rows: &mut RowCache,
    i: usize,
    pps: usize,
    key: u64,
    pages: &[u32],
) {
    let row = &mut table[i * pps..(i + 1) * pps];
    let filled = rows.filled[i] as usize;
    let from = if rows.keys[i] == key {
        filled.min(pages.len())
    } else {
        0
    };
    for (dst, &p) in row[from..pages.len()].iter_mut().zip(&pages[from..]) {
        *dst = p as i32;
    }
    if filled > pages.len() {
        row[pages.len()..filled].fill(0);
    }
    rows.keys[i] = key;
    rows.filled[i] = pages.len() as u32;
}

fn clear_row(table: &mut [i32], rows: &mut RowCache, i: usize, pps: usize) {
    let filled = rows.filled[i] as usize;
    if filled > 0 {
        table[i * pps..i * pps + filled].fill(0);
    }
    rows.keys[i] = 0;
    rows.filled[i] = 0;
}

/// A full re-read of a written plan, independent of how it was written: every
/// slot agrees with its sequence's page row, rows cover kv_len exactly, pages
/// written are held alone, padding is in contract. It reads each used row, so it
/// costs about S page-table cache lines: the scheduler runs it in debug builds
/// (the Rust tests) and on request (`SchedulerConfig.full_validation`).
pub fn validate(
    shape: &PlanShape,
    bufs: &PlanBuffers<'_>,
    written: &WrittenPlan,
    pool: &BlockPool,
) -> KvResult<()> {
    let bad = |m: String| Err(KvError::Internal(format!("invalid step plan: {m}")));
    let bs = shape.block_size.get();
    let pps = shape.pages_per_seq;
    let n = written.num_seqs;
    if written.num_tokens > written.bucket || written.bucket > shape.max_tokens {
        return bad(format!(
            "{} tokens in bucket {}",
            written.num_tokens, written.bucket
        ));
    }
    if bufs.cu_q_lens[n] as usize != written.num_tokens {
        return bad("cu_q_lens does not end at the token count".into());
    }
    for i in 0..n {
        let (lo, hi) = (bufs.cu_q_lens[i] as usize, bufs.cu_q_lens[i + 1] as usize);
        let kv = bufs.kv_lens[i] as usize;
        if hi <= lo || hi - lo > kv {
            return bad(format!(
                "sequence {i}: q_len {} and kv_len {kv}",
                hi as i64 - lo as i64
            ));
        }
        if kv > pps * bs {
            return bad(format!("sequence {i}: kv_len {kv} exceeds a page row"));
        }
        let row = &bufs.page_indices[i * pps..(i + 1) * pps];
        let used = kv.div_ceil(bs);
        if row[..used].contains(&0) || row[used..].iter().any(|&p| p != 0) {
            return bad(format!(
                "sequence {i}: row does not cover kv_len {kv} exactly"
            ));
        }
        let mut last_page = -1;
        for t in lo..hi {
            let pos = bufs.positions[t] as usize;
            if pos != kv - (hi - t) {
                return bad(format!("sequence {i}: token {t} at position {pos}"));
            }
            let page = row[pos / bs];
            if bufs.slot_mapping[t] as i64 != page as i64 * bs as i64 + (pos % bs) as i64 {
                return bad(format!(
                    "sequence {i}: slot of token {t} disagrees with its row"
                ));
            }
            if page != last_page && pool.refcount(page as u32) != 1 {
                return bad(format!(
                    "sequence {i}: writes into page {page}, not its own"
                ));
            }
            last_page = page;
        }
    }
    let pad_ok = bufs.slot_mapping[written.num_tokens..written.bucket]
        .iter()
        .all(|&s| s == shape.pad_slot)
        && bufs.page_indices[n * pps..].iter().all(|&p| p == 0)
        && bufs.kv_lens[n..].iter().all(|&k| k == 0)
        && bufs.cu_q_lens[n..]
            .iter()
            .all(|&c| c as usize == written.num_tokens);
    if !pad_ok {
        return bad("padding out of contract".into());
    }
    Ok(())
}

/// What one page-table row of a KV-cache group after group 0 holds, per
/// buffer set: as `RowCache`, plus the first block the row holds (the null
/// page before it).
#[derive(Clone, Debug)]
pub struct GroupRowCache {
    keys: Vec<u64>,
    filled: Vec<u32>,
    from: Vec<u32>,
}

impl GroupRowCache {
    pub fn new(max_seqs: usize) -> Self {
        GroupRowCache {
            keys: vec![0; max_seqs],
            filled: vec![0; max_seqs],
            from: vec![0; max_seqs],
        }
    }

    /// See `RowCache::forget`.
    pub fn forget(&mut self) {
        self.keys.fill(0);
        self.filled.fill(0);
        self.from.fill(0);
    }
}

/// A sequence of a plan as the KV-cache groups after group 0 see it: its
/// queries are positions [start, start + q_len); `tables[g]` is group g + 1's
/// page table, holding the null page before `live_from[g]`.
pub struct GroupSeq<'a> {
    pub row_key: u64,
    pub start: usize,
    pub q_len: usize,
    pub tables: &'a [Vec<u32>],
    pub live_from: &'a [usize],
}

/// Write the KV-cache groups after group 0 of a plan that `write_plan` wrote:
/// each group's page-table row and slot of every token, padding as group 0's.
/// `seqs` are the plan's sequences in plan order. Checked as they are
/// written: a table covers the same blocks as the sequence's kv_len, every
/// block a query reads (`AttentionKind::visible_from` its first query) is a
/// page, and a page written is held alone.
pub fn write_groups(
    shape: &PlanShape,
    bufs: &mut PlanBuffers<'_>,
    rows: &mut [GroupRowCache],
    pool: &BlockPool,
    kinds: &[AttentionKind],
    seqs: &[GroupSeq<'_>],
    written: &WrittenPlan,
) -> KvResult<()> {
    let (bs, pps, s, t) = (
        shape.block_size,
        shape.pages_per_seq,
        shape.max_seqs,
        shape.max_tokens,
    );
    debug_assert_eq!(rows.len(), kinds.len());
    let check_owner = pool.shared() > 0;
    for (g, (&kind, rows)) in kinds.iter().zip(rows.iter_mut()).enumerate() {
        let table = &mut bufs.group_page_indices[g * s * pps..(g + 1) * s * pps];
        let slots = &mut bufs.group_slot_mapping[g * t..(g + 1) * t];
        let mut off = 0;
        for (i, seq) in seqs.iter().enumerate() {
            let (pages, from) = (&seq.tables[g], seq.live_from[g]);
            let kv_len = seq.start + seq.q_len;
            let read_from = kind.visible_from(seq.start) / bs.get();
            if pages.len() != bs.blocks_for(kv_len) || pages.len() > pps || from > read_from {
                return Err(KvError::Internal(format!(
                    "invalid step plan: sequence {i} has {} pages of group {} from block \
                     {from} for kv_len {kv_len}",
                    pages.len(),
                    g + 1
                )));
            }
            let mut last = u32::MAX;
            for (k, pos) in (seq.start..kv_len).enumerate() {
                let (idx, in_page) = bs.split(pos);
                let page = pages[idx];
                if page != last {
                    if check_owner && pool.refcount(page) != 1 {
                        return Err(not_own(i, page));
                    }
                    last = page;
                }
                slots[off + k] = (page as usize * bs.get() + in_page) as i32;
            }
            off += seq.q_len;
            let row = &mut table[i * pps..(i + 1) * pps];
            let filled = rows.filled[i] as usize;
            let was_from = rows.from[i] as usize;
            if rows.keys[i] == seq.row_key && was_from <= from && filled <= pages.len() {
                // Tables only grow at the end and give back at the front.
                row[was_from..from].fill(0);
                for (dst, &p) in row[filled..pages.len()].iter_mut().zip(&pages[filled..]) {
                    *dst = p as i32;
                }
            } else {
                row[..filled.max(pages.len())].fill(0);
                for (dst, &p) in row[from..pages.len()].iter_mut().zip(&pages[from..]) {
                    *dst = p as i32;
                }
            }
            rows.keys[i] = seq.row_key;
            rows.filled[i] = pages.len() as u32;
            rows.from[i] = from as u32;
        }
        debug_assert_eq!(off, written.num_tokens);
        slots[off..written.bucket].fill(shape.pad_slot);
        for i in seqs.len()..s {
            let filled = rows.filled[i] as usize;
            table[i * pps..i * pps + filled].fill(0);
            rows.keys[i] = 0;
            rows.filled[i] = 0;
            rows.from[i] = 0;
        }
    }
    Ok(())
}

/// `validate` for the KV-cache groups after group 0, against the plan's
/// shared arrays: each row holds the null page past kv_len, a page for every
/// block its first query reads from, and the slots its rows say; pages
/// written are held alone; padding is in contract.
pub fn validate_groups(
    shape: &PlanShape,
    bufs: &PlanBuffers<'_>,
    written: &WrittenPlan,
    pool: &BlockPool,
    kinds: &[AttentionKind],
) -> KvResult<()> {
    let bad = |m: String| Err(KvError::Internal(format!("invalid step plan: {m}")));
    let (bs, pps, s, t) = (
        shape.block_size.get(),
        shape.pages_per_seq,
        shape.max_seqs,
        shape.max_tokens,
    );
    let n = written.num_seqs;
    for (g, &kind) in kinds.iter().enumerate() {
        let table = &bufs.group_page_indices[g * s * pps..(g + 1) * s * pps];
        let slots = &bufs.group_slot_mapping[g * t..(g + 1) * t];
        for i in 0..n {
            let (lo, hi) = (bufs.cu_q_lens[i] as usize, bufs.cu_q_lens[i + 1] as usize);
            let kv = bufs.kv_lens[i] as usize;
            let first = kv - (hi - lo);
            let row = &table[i * pps..(i + 1) * pps];
            let used = kv.div_ceil(bs);
            let read_from = kind.visible_from(first) / bs;
            if row[read_from..used].contains(&0) || row[used..].iter().any(|&p| p != 0) {
                return bad(format!(
                    "sequence {i}: group {} row does not cover what it reads of kv_len {kv}",
                    g + 1
                ));
            }
            for (tok, pos) in (lo..hi).zip(first..kv) {
                let page = row[pos / bs];
                if slots[tok] as i64 != page as i64 * bs as i64 + (pos % bs) as i64 {
                    return bad(format!(
                        "sequence {i}: group {} slot of token {tok} disagrees with its row",
                        g + 1
                    ));
                }
                if pool.refcount(page as u32) != 1 {
                    return bad(format!(
                        "sequence {i}: group {} writes into page {page}, not its own",
                        g + 1
                    ));
                }
            }
        }
        let pad_ok = slots[written.num_tokens..written.bucket]
            .iter()
            .all(|&x| x == shape.pad_slot)
            && table[n * pps..].iter().all(|&p| p == 0);
        if !pad_ok {
            return bad(format!("group {} padding out of contract", g + 1));
        }
    }
    Ok(())
}

/// Prefill tokens a step still has room for, of `budget` with `scheduled`
/// tokens placed (`num_decode` of them decodes). When decodes alone fill a
/// (capped) step, the first prefill still moves by up to the cap: a cap below
/// the number of running decodes must not stall prefill, and with it the entry
/// of new requests, until those decodes finish. `max_batched_tokens` still bounds it.
#[inline]
pub fn prefill_room(
    budget: usize,
    scheduled: usize,
    num_decode: usize,
    max_batched_tokens: usize,
) -> usize {
    let room = budget.saturating_sub(scheduled);
    if room == 0 && scheduled == num_decode {
        budget.min(max_batched_tokens.saturating_sub(scheduled))
    } else {
        room
    }
}

/// Tokens of one prefill chunk: what the sequence still `need`s, at most
/// `long_prefill_chunk`, the step's `room` and, where pages are not promised
/// in advance (over-commit), the `coverable` tokens its pages and the free
/// ones can hold.
#[inline]
pub fn prefill_chunk(
    need: usize,
    long_prefill_chunk: usize,
    room: usize,
    coverable: Option<usize>,
) -> usize {
    let chunk = need.min(long_prefill_chunk).min(room);
    coverable.map_or(chunk, |c| chunk.min(c))
}

#[cfg(test)]
mod tests;
