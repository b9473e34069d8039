//! The prefix cache's index: a cached page found by its block's name.
//!
//! An open-addressing table of buckets one cache line each: twelve slots, a
//! one-byte tag per slot (7 bits of the name; 0 marks an empty slot) and the
//! slot's page id. The names themselves are stored once, per page, by the
//! cache (`PrefixCache::key`); the index holds 4 bytes per entry.
//!
//! Why not a general hash table: registering the blocks a step filled is a
//! batch of inserts at random places. A table that keeps its tags and its
//! values apart (as SwissTable does) touches two random lines per insert, and
//! the second one, a store, cannot be fetched ahead through its interface.
//! Here a name's tags and pages share one line, so the batch first touches
//! every line it will write (`touch`: independent loads whose misses overlap),
//! then inserts into lines already at hand. A lookup reads one line, then the
//! name of the page whose tag matched.
//!
//! Probing. A name's home bucket comes from its low 64 bits, its tag from its
//! top 7 (names are uniform: they are the output of a keyed PRF). An entry
//! that finds its home full goes to the next bucket with a free slot (wrapping
//! around), and every bucket it passed counts it in `overflow`. A search stops
//! at the first bucket of its probe with nothing passing through it, so a
//! removal leaves no tombstone: it empties its slot and takes its count off the
//! buckets it had passed.
//!
//! Size. One bucket per nine pages the pool holds, so a cache of every page
//! fills at most three quarters of the slots: 64/9 ≈ 7.1 bytes per page, set
//! once, never grown (no rehash, no transient).

use crate::prefix::BlockKey;

/// What a cached page is found by: its block's name and its KV-cache group
/// (crate::groups): the same block holds different layers in each group, so
/// each group caches its own page of it. Group 0's key is the name itself;
/// group g's is the name XOR g times an odd 128-bit constant, distinct per
/// group and, the names being uniform outputs of a keyed PRF, as uniform and
/// as hard to make collide as the names. Every comparison of cached pages'
/// keys and every hash the index takes of one goes through this type. Its
/// bits are uniform, so the index takes them as the hash.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct CacheKey(BlockKey);

impl CacheKey {
    /// The key of the block named `name` (in group 0).
    #[inline]
    pub fn new(name: BlockKey) -> Self {
        CacheKey(name)
    }

    /// The key of the block named `name` in KV-cache group `group`.
    #[inline]
    pub fn of_group(name: BlockKey, group: usize) -> Self {
        /// The fractional bits of the golden ratio, made odd.
        const GROUP_STRIDE: u128 = 0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835;
        CacheKey(name ^ GROUP_STRIDE.wrapping_mul(group as u128))
    }

    /// The name of the block.
    #[inline]
    pub fn name(self) -> BlockKey {
        self.0
    }

    /// The block's id in KV events (`pool::events`): the key's low 64 bits.
    #[inline]
    pub fn wire(self) -> u64 {
        self.0 as u64
    }
}

/// Slots per bucket: 12 one-byte tags, a 4-byte count and 12 4-byte page ids
/// fill one 64-byte line.
const SLOTS: usize = 12;
/// Pages per bucket at most (at full occupancy 9/12 of the slots hold one).
const PAGES_PER_BUCKET: usize = 9;

#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(64))]
struct Bucket {
    /// Bytes 0..12, per slot: 0 when empty, else 0x80 | 7 bits of the
    /// entry's name. Bytes 12..16, little-endian: how many entries stored
    /// past this bucket passed it (their home is here or before); a search
    /// goes on to the next bucket only while this is not 0. One 16-byte
    /// word, so that a tag search is a few word operations.
    ctrl: [u8; 16],
    pages: [u32; SLOTS],
}

/// A byte mask of the slots' tags: 0x80 in each of the low 12 bytes.
const SLOT_HIGH_BITS: u128 = ((1 << (8 * SLOTS)) - 1) & (u128::MAX / 0xff * 0x80);
const LOW_BITS: u128 = u128::MAX / 0xff * 0x7f;

/// The first slot of a byte mask (0x80 in the byte of each slot it holds).
#[inline]
fn slot(mask: u128) -> usize {
    mask.trailing_zeros() as usize / 8
}

impl Bucket {
    /// The slots whose tag byte is `byte`, as 0x80 in their byte of a mask.
    /// Exact (no false positives): a byte of `y` is 0 iff adding 0x7f to its
    /// low 7 bits and or-ing in its high bit leaves the high bit clear, and
    /// no byte carries into the next.
    #[inline]
    fn bytes_equal(&self, byte: u8) -> u128 {
        let y = u128::from_le_bytes(self.ctrl) ^ (u128::MAX / 0xff * u128::from(byte));
        !(((y & LOW_BITS) + LOW_BITS) | y) & SLOT_HIGH_BITS
    }

    /// Slots whose tag is `tag` (never 0), as a byte mask (see `slot`).
    #[inline]
    fn matching(&self, tag: u8) -> u128 {
        self.bytes_equal(tag)
    }

    /// The first empty slot.
    #[inline]
    fn free_slot(&self) -> Option<usize> {
        let empty = self.bytes_equal(0);
        (empty != 0).then(|| slot(empty))
    }

    #[inline]
    fn overflow(&self) -> u32 {
        let [.., a, b, c, d] = self.ctrl;
        u32::from_le_bytes([a, b, c, d])
    }

    #[inline]
    fn set_overflow(&mut self, n: u32) {
        self.ctrl[SLOTS..].copy_from_slice(&n.to_le_bytes());
    }
}

/// Cached pages by name (see the module doc).
#[derive(Clone, Debug, Default)]
pub(super) struct PageIndex {
    buckets: Vec<Bucket>,
    len: usize,
}

/// Where a name's probe starts and the tag it looks for.
#[inline]
fn home_and_tag(key: CacheKey, buckets: usize) -> (usize, u8) {
    let bits = key.0;
    // Multiply-shift maps the low 64 bits uniformly onto 0..buckets, any count.
    let home = ((u128::from(bits as u64) * buckets as u128) >> 64) as usize;
    (home, 0x80 | (bits >> 121) as u8)
}

impl PageIndex {
    /// An index for a pool of `num_blocks` pages (0: one that holds nothing),
    /// allocated fallibly and written through (see `page::resident`).
    pub(super) fn new(num_blocks: usize) -> Result<Self, std::collections::TryReserveError> {
        let n = num_blocks.div_ceil(PAGES_PER_BUCKET);
        Ok(PageIndex {
            buckets: crate::page::resident(n, Bucket::default())?,
            len: 0,
        })
    }

    /// Entries held.
    #[inline]
    pub(super) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn next(&self, b: usize) -> usize {
        if b + 1 == self.buckets.len() {
            0
        } else {
            b + 1
        }
    }

    /// The page stored under `key`; `name_of(page)` is the name of a page.
    #[inline]
    pub(super) fn find(&self, key: CacheKey, name_of: impl Fn(u32) -> CacheKey) -> Option<u32> {
        if self.buckets.is_empty() {
            return None;
        }
        let (mut b, tag) = home_and_tag(key, self.buckets.len());
        // Every bucket at most once, however long the chains.
        for _ in 0..self.buckets.len() {
            let bucket = &self.buckets[b];
            let mut m = bucket.matching(tag);
            while m != 0 {
                let page = bucket.pages[slot(m)];
                if name_of(page) == key {
                    return Some(page);
                }
                m &= m - 1;
            }
            if bucket.overflow() == 0 {
                break;
            }
            b = self.next(b);
        }
        None
    }

    /// Store `page` under `key` unless `key` is there already (then false and
    /// nothing changes). There is always room: the index is sized for a name
    /// per page, and `name_of` gives the names of the pages stored.
    pub(super) fn insert(
        &mut self,
        key: CacheKey,
        page: u32,
        name_of: impl Fn(u32) -> CacheKey,
    ) -> bool {
        if self.buckets.is_empty() {
            return false;
        }
        let (home, tag) = home_and_tag(key, self.buckets.len());
        // Look the key up along its probe, noting the first free slot on the way.
        let mut b = home;
        let mut free = None;
        for _ in 0..self.buckets.len() {
            let bucket = &self.buckets[b];
            let mut m = bucket.matching(tag);
            while m != 0 {
                if name_of(bucket.pages[slot(m)]) == key {
                    return false;
                }
                m &= m - 1;
            }
            if free.is_none() {
                free = bucket.free_slot().map(|i| (b, i));
            }
            if bucket.overflow() == 0 {
                break;
            }
            b = self.next(b);
        }
        let (at, slot) = match free {
            Some(f) => f,
            None => loop {
                // Past the end of the key's probe: the next bucket with room.
                b = self.next(b);
                assert!(b != home, "the prefix index is full");
                if let Some(i) = self.buckets[b].free_slot() {
                    break (b, i);
                }
            },
        };
        let mut p = home;
        while p != at {
            let b = &mut self.buckets[p];
            b.set_overflow(b.overflow() + 1);
            p = self.next(p);
        }
        let bucket = &mut self.buckets[at];
        bucket.ctrl[slot] = tag;
        bucket.pages[slot] = page;
        self.len += 1;
        true
    }

    /// Take out `page`, stored under `key`. False when it is not there.
    pub(super) fn remove(&mut self, key: CacheKey, page: u32) -> bool {
        if self.buckets.is_empty() {
            return false;
        }
        let (home, tag) = home_and_tag(key, self.buckets.len());
        let mut b = home;
        let mut probed = 0;
        let slot = loop {
            if probed == self.buckets.len() {
                return false;
            }
            probed += 1;
            let bucket = &self.buckets[b];
            let mut m = bucket.matching(tag);
            while m != 0 {
                if bucket.pages[slot(m)] == page {
                    break;
                }
                m &= m - 1;
            }
            if m != 0 {
                break slot(m);
            }
            if bucket.overflow() == 0 {
                return false;
            }
            b = self.next(b);
        };
        self.buckets[b].ctrl[slot] = 0;
        let mut p = home;
        while p != b {
            let b = &mut self.buckets[p];
            b.set_overflow(b.overflow() - 1);
            p = self.next(p);
        }
        self.len -= 1;
        true
    }

    /// Read the home bucket of each of `keys`: registering them next finds
    /// those lines in the cache, their misses overlapped here instead of each
    /// stalling its insert. It changes nothing.
    pub(super) fn touch(&self, keys: impl Iterator<Item = CacheKey>) {
        if self.buckets.is_empty() {
            return;
        }
        for key in keys {
            let (home, _) = home_and_tag(key, self.buckets.len());
            std::hint::black_box(self.buckets[home].ctrl[0]);
        }
    }

    /// Every page stored, in no particular order.
    pub(super) fn pages(&self) -> impl Iterator<Item = u32> + '_ {
        self.buckets.iter().flat_map(|b| {
            b.ctrl[..SLOTS]
                .iter()
                .zip(&b.pages)
                .filter(|&(&t, _)| t != 0)
                .map(|(_, &p)| p)
        })
    }

    /// The overflow counts agree with where the entries sit, for tests.
    pub(super) fn check(&self, name_of: impl Fn(u32) -> CacheKey) -> Result<(), String> {
        let n = self.buckets.len();
        let mut passing = vec![0u32; n];
        let mut count = 0;
        for (b, bucket) in self.buckets.iter().enumerate() {
            for (&t, &page) in bucket.ctrl[..SLOTS].iter().zip(&bucket.pages) {
                if t == 0 {
                    continue;
                }
                count += 1;
                let (home, tag) = home_and_tag(name_of(page), n);
                if t != tag {
                    return Err(format!("page {page} sits under another name's tag"));
                }
                let mut p = home;
                while p != b {
                    passing[p] += 1;
                    p = self.next(p);
                }
            }
        }
        if count != self.len {
            return Err(format!("{count} entries, the count says {}", self.len));
        }
        for (b, (bucket, &want)) in self.buckets.iter().zip(&passing).enumerate() {
            if bucket.overflow() != want {
                return Err(format!(
                    "bucket {b} counts {} entries passing, {want} do",
                    bucket.overflow()
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn a_bucket_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Bucket>(), 64);
        assert_eq!(std::mem::align_of::<Bucket>(), 64);
    }

    /// Random inserts and removals in a small, crowded index agree with a map,
    /// and the overflow counts stay exact, also where probes wrap around.
    #[test]
    fn agrees_with_a_map_under_crowding_and_wrap_around() {
        for (num_pages, spread) in [(18usize, 3u64), (90, 1), (400, 2), (1000, 7)] {
            let mut index = PageIndex::new(num_pages).unwrap();
            let mut name = vec![0 as BlockKey; num_pages];
            let mut model: HashMap<BlockKey, u32> = HashMap::new();
            let mut s = 0x9e37_79b9_7f4a_7c15u64 ^ num_pages as u64;
            let mut rand = || {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s
            };
            for step in 0..20_000 {
                let page = (rand() % num_pages as u64) as u32;
                if name[page as usize] != 0 {
                    let key = name[page as usize];
                    assert!(index.remove(CacheKey::new(key), page));
                    assert!(!index.remove(CacheKey::new(key), page), "removed twice");
                    model.remove(&key);
                    name[page as usize] = 0;
                } else {
                    // Few distinct low halves: many names share a home bucket.
                    let lo = rand() % (spread * 4);
                    let lo = lo.wrapping_mul(0x9e37_79b9_7f4a_7c15);
                    let key = (u128::from(rand() | 1) << 64) | u128::from(lo);
                    let names = &name;
                    let fresh = !model.contains_key(&key);
                    let name_of = |p: u32| CacheKey::new(names[p as usize]);
                    assert_eq!(index.insert(CacheKey::new(key), page, name_of), fresh);
                    if fresh {
                        model.insert(key, page);
                        name[page as usize] = key;
                    }
                }
                if step % 97 == 0 {
                    let names = &name;
                    let name_of = |p: u32| CacheKey::new(names[p as usize]);
                    index.check(name_of).unwrap();
                    assert_eq!(index.len(), model.len());
                    for (&k, &p) in &model {
                        assert_eq!(index.find(CacheKey::new(k), name_of), Some(p));
                    }
                    assert_eq!(index.find(CacheKey::new(1), name_of), None);
                    let mut stored: Vec<u32> = index.pages().collect();
                    stored.sort_unstable();
                    let mut want: Vec<u32> = model.values().copied().collect();
                    want.sort_unstable();
                    assert_eq!(stored, want);
                }
            }
        }
    }

    #[test]
    fn an_index_of_no_pages_holds_nothing() {
        let mut index = PageIndex::new(0).unwrap();
        let five = CacheKey::new(5);
        assert!(!index.insert(five, 1, |_| five));
        assert_eq!(index.find(five, |_| five), None);
        assert!(!index.remove(five, 1));
        index.touch([five].into_iter());
        assert_eq!(index.len(), 0);
        assert_eq!(index.pages().count(), 0);
    }
}
