//! KV events: what the prefix cache named and forgot, in the order it did,
//! for routers that keep a map of which replica holds which prefix (vLLM's
//! KV events, which vllm-router, llm-d and Dynamo read).
//!
//! The log is off until `BlockPool::enable_kv_events`. The KV manager records
//! each block it caches (its name, its parent's, its group, its tokens and
//! its namespace), the cache each name it forgets (eviction, a tenant's
//! parked pages dropped), and `encode` writes what was recorded since the
//! last drain as one batch in vLLM's wire format, msgpack:
//!
//! `[timestamp, [event, ...], data_parallel_rank]`, each event a map with a
//! "type": `BlockStored` (block_hashes, parent_block_hash, token_ids,
//! block_size, lora_id, medium, lora_name, extra_keys; hybrid models add
//! group_idx, kv_cache_spec_kind and kv_cache_spec_sliding_window),
//! `BlockRemoved` (block_hashes, medium; group_idx when hybrid) or
//! `AllBlocksCleared`. A run of blocks one request filled in one step, each
//! the next one's parent, is one `BlockStored`; consecutive removals of a
//! group are one `BlockRemoved`.
//!
//! A block's hash on the wire is the low 64 bits of its cache key (keyed
//! SipHash, see `prefix`): an id, unique within the replica, that the
//! router links parents and removals by; routers hash the token ids
//! themselves to match requests.
//!
//! Bounded: a log nobody drains keeps at most `limit` events; the next one
//! replaces them all with `AllBlocksCleared` (the router forgets this
//! replica's blocks and learns the ones cached from then on: it routes as
//! if they were gone, which costs hits, never correctness).

use std::collections::HashMap;

use rmp::encode::ValueWriteError;

use crate::groups::{AttentionKind, KvGroups};
use crate::tenant::TenantId;

/// The medium vLLM's events name the accelerator's memory by.
const MEDIUM: &str = "GPU";

/// What a router is told a block's namespace is (its `extra_keys`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NamespaceTag {
    /// Blocks named in a namespace of this name (a tenant's, or the shared
    /// namespace it names).
    Name(String),
    /// A request's salted blocks: the namespace and an id of the salted root.
    Salted(String, u64),
}

/// Where a cached block comes from, besides its tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockOrigin {
    /// The wire hash of the block before it in its group (None: the first).
    pub parent: Option<u64>,
    pub group: u8,
    /// The tenant whose request named it, in the namespace rooted at `root`.
    pub tenant: TenantId,
    pub root: u128,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Event {
    /// A block cached: its tokens are the `block`-th block of `tokens`.
    Stored {
        hash: u64,
        parent: Option<u64>,
        group: u8,
        tenant: TenantId,
        root: u128,
        block: u32,
    },
    Removed {
        hash: u64,
        group: u8,
    },
    Cleared,
}

/// The prefix cache's changes since the last drain.
#[derive(Clone, Debug)]
pub struct KvEventLog {
    events: Vec<Event>,
    /// The stored blocks' tokens, `block_size` each, in order.
    tokens: Vec<i32>,
    block_size: usize,
    /// Per page: the group of the block it caches (for its removal).
    group: Vec<u8>,
    limit: usize,
    /// Events replaced by `AllBlocksCleared` because nobody drained them.
    dropped: u64,
}

impl KvEventLog {
    /// A log for a pool of `num_pages` pages of `block_size` tokens; it
    /// starts with `AllBlocksCleared` (a replica that starts publishing holds
    /// nothing a router should still credit it with).
    pub(super) fn new(num_pages: usize, block_size: usize) -> Self {
        KvEventLog {
            events: vec![Event::Cleared],
            tokens: Vec::new(),
            block_size,
            group: vec![0; num_pages],
            limit: (8 * num_pages).max(1 << 16),
            dropped: 0,
        }
    }

    /// Events waiting to be drained.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Events lost to the bound since start (see the module's doc).
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    fn make_room(&mut self) {
        if self.events.len() >= self.limit {
            self.dropped += self.events.len() as u64;
            self.events.clear();
            self.tokens.clear();
            self.events.push(Event::Cleared);
        }
    }

    /// `page` now caches the block `hash` (`tokens`, from `origin`).
    pub(crate) fn stored(&mut self, page: u32, hash: u64, origin: BlockOrigin, tokens: &[i32]) {
        debug_assert_eq!(tokens.len(), self.block_size);
        self.make_room();
        self.group[page as usize] = origin.group;
        let block = (self.tokens.len() / self.block_size) as u32;
        self.tokens.extend_from_slice(tokens);
        self.events.push(Event::Stored {
            hash,
            parent: origin.parent,
            group: origin.group,
            tenant: origin.tenant,
            root: origin.root,
            block,
        });
    }

    /// `page` no longer caches the block `hash`.
    pub(super) fn removed(&mut self, page: u32, hash: u64) {
        self.make_room();
        let group = self.group[page as usize];
        self.events.push(Event::Removed { hash, group });
    }

    /// The group of the block `page` caches (meaningful while it is cached).
    pub fn group_of(&self, page: u32) -> u8 {
        self.group[page as usize]
    }

    /// Write the events since the last drain as one batch and forget them
    /// (None, and nothing written, when there are none). `tag` says which
    /// namespace a tenant's root is (called once per distinct pair).
    pub fn drain(
        &mut self,
        timestamp: f64,
        data_parallel_rank: i64,
        groups: &KvGroups,
        mut tag: impl FnMut(TenantId, u128) -> NamespaceTag,
    ) -> Option<Vec<u8>> {
        if self.events.is_empty() {
            return None;
        }
        let mut tags: HashMap<(TenantId, u128), NamespaceTag> = HashMap::new();
        self.group_stores();
        let runs = self.runs();
        let mut out = Vec::with_capacity(64 + 8 * self.tokens.len() + 48 * self.events.len());
        let w = &mut out;
        // Writing into a Vec cannot fail.
        let ok = |r: Written| r.expect("writes to a Vec");
        ok(rmp::encode::write_array_len(w, 3).map(drop));
        ok(rmp::encode::write_f64(w, timestamp));
        ok(rmp::encode::write_array_len(w, runs.len() as u32).map(drop));
        for &(from, to) in &runs {
            match self.events[from] {
                Event::Stored {
                    group,
                    tenant,
                    root,
                    parent,
                    ..
                } => {
                    let t = tags
                        .entry((tenant, root))
                        .or_insert_with(|| tag(tenant, root));
                    ok(write_stored(
                        w,
                        &self.events[from..to],
                        parent,
                        &self.tokens,
                        self.block_size,
                        t,
                        groups,
                        group,
                    ));
                }
                Event::Removed { group, .. } => {
                    ok(write_removed(w, &self.events[from..to], groups, group));
                }
                Event::Cleared => {
                    ok(rmp::encode::write_map_len(w, 1).map(drop));
                    ok(rmp::encode::write_str(w, "type"));
                    ok(rmp::encode::write_str(w, "AllBlocksCleared"));
                }
            }
        }
        ok(rmp::encode::write_sint(w, data_parallel_rank).map(drop));
        self.events.clear();
        self.tokens.clear();
        Some(out)
    }

    /// Within each stretch of stores with no removal or clear between them,
    /// the stores of one group come together, in their order (a stable sort:
    /// a block still follows its parent). A hybrid model names a block's
    /// groups one after the other, and its runs would never merge otherwise.
    /// Nothing a router keeps changes: stores of different blocks commute.
    fn group_stores(&mut self) {
        let key = |e: &Event| match *e {
            Event::Stored { group, .. } => group,
            _ => 0,
        };
        let mut from = 0;
        while from < self.events.len() {
            let stores = self.events[from..]
                .iter()
                .take_while(|e| matches!(e, Event::Stored { .. }))
                .count();
            if stores > 1 {
                self.events[from..from + stores].sort_by_key(key);
            }
            from += stores.max(1);
        }
    }

    /// The events as runs `[from, to)` that are one event on the wire: blocks
    /// stored one after the other, each the next one's parent, in one group
    /// and namespace; removals of one group.
    fn runs(&self) -> Vec<(usize, usize)> {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (i, e) in self.events.iter().enumerate() {
            let joins = match (runs.last().map(|&(_, to)| &self.events[to - 1]), e) {
                (
                    Some(&Event::Stored {
                        hash,
                        group,
                        tenant,
                        root,
                        ..
                    }),
                    &Event::Stored {
                        parent: Some(p),
                        group: g,
                        tenant: t,
                        root: r,
                        ..
                    },
                ) => p == hash && g == group && t == tenant && r == root,
                (Some(&Event::Removed { group, .. }), &Event::Removed { group: g, .. }) => {
                    g == group
                }
                _ => false,
            };
            match runs.last_mut() {
                Some(run) if joins => run.1 = i + 1,
                _ => runs.push((i, i + 1)),
            }
        }
        runs
    }
}

type Written = Result<(), ValueWriteError>;

fn write_hashes(w: &mut Vec<u8>, events: &[Event]) -> Written {
    rmp::encode::write_array_len(w, events.len() as u32)?;
    for e in events {
        let (Event::Stored { hash, .. } | Event::Removed { hash, .. }) = *e else {
            unreachable!("a run holds stored or removed blocks")
        };
        rmp::encode::write_uint(w, hash)?;
    }
    Ok(())
}

/// group_idx, kv_cache_spec_kind and kv_cache_spec_sliding_window (hybrid
/// models only: a model of one group sends what vLLM's full-attention
/// models do).
fn write_group(w: &mut Vec<u8>, groups: &KvGroups, group: u8) -> Written {
    rmp::encode::write_str(w, "group_idx")?;
    rmp::encode::write_uint(w, u64::from(group))?;
    let (kind, window) = match groups.kinds()[group as usize] {
        AttentionKind::Full => ("full_attention", None),
        AttentionKind::SlidingWindow(n) => ("sliding_window", Some(n)),
        AttentionKind::ChunkedLocal(n) => ("chunked_local_attention", Some(n)),
    };
    rmp::encode::write_str(w, "kv_cache_spec_kind")?;
    rmp::encode::write_str(w, kind)?;
    rmp::encode::write_str(w, "kv_cache_spec_sliding_window")?;
    match window {
        Some(n) => rmp::encode::write_uint(w, n as u64).map(drop)?,
        None => rmp::encode::write_nil(w).map_err(ValueWriteError::InvalidMarkerWrite)?,
    }
    Ok(())
}

/// A run's `BlockStored`; each block's tokens are its `block`-th of `tokens`.
#[allow(clippy::too_many_arguments)]
fn write_stored(
    w: &mut Vec<u8>,
    run: &[Event],
    parent: Option<u64>,
    tokens: &[i32],
    block_size: usize,
    tag: &NamespaceTag,
    groups: &KvGroups,
    group: u8,
) -> Written {
    use rmp::encode::*;
    write_map_len(w, if groups.is_hybrid() { 12 } else { 9 })?;
    write_str(w, "type")?;
    write_str(w, "BlockStored")?;
    write_str(w, "block_hashes")?;
    write_hashes(w, run)?;
    write_str(w, "parent_block_hash")?;
    match parent {
        Some(p) => write_uint(w, p).map(drop)?,
        None => write_nil(w).map_err(ValueWriteError::InvalidMarkerWrite)?,
    }
    write_str(w, "token_ids")?;
    write_array_len(w, (run.len() * block_size) as u32)?;
    for e in run {
        let Event::Stored { block, .. } = *e else {
            unreachable!("a stored run holds stored blocks")
        };
        for &t in &tokens[block as usize * block_size..][..block_size] {
            write_uint(w, t as u64)?;
        }
    }
    write_str(w, "block_size")?;
    write_uint(w, block_size as u64)?;
    write_str(w, "lora_id")?;
    write_nil(w).map_err(ValueWriteError::InvalidMarkerWrite)?;
    write_str(w, "medium")?;
    write_str(w, MEDIUM)?;
    write_str(w, "lora_name")?;
    write_nil(w).map_err(ValueWriteError::InvalidMarkerWrite)?;
    // One tuple of keys per block: its namespace.
    write_str(w, "extra_keys")?;
    write_array_len(w, run.len() as u32)?;
    for _ in run {
        match tag {
            NamespaceTag::Name(name) => {
                write_array_len(w, 1)?;
                write_str(w, name)?;
            }
            NamespaceTag::Salted(name, id) => {
                write_array_len(w, 2)?;
                write_str(w, name)?;
                write_uint(w, *id)?;
            }
        }
    }
    if groups.is_hybrid() {
        write_group(w, groups, group)?;
    }
    Ok(())
}

fn write_removed(w: &mut Vec<u8>, run: &[Event], groups: &KvGroups, group: u8) -> Written {
    use rmp::encode::*;
    write_map_len(w, if groups.is_hybrid() { 6 } else { 3 })?;
    write_str(w, "type")?;
    write_str(w, "BlockRemoved")?;
    write_str(w, "block_hashes")?;
    write_hashes(w, run)?;
    write_str(w, "medium")?;
    write_str(w, MEDIUM)?;
    if groups.is_hybrid() {
        write_group(w, groups, group)?;
    }
    Ok(())
}
