//! The names of recently named prompts, by their tokens: a prompt that starts
//! like one named just before (the same system prompt, a resubmitted
//! conversation) takes its names by comparing tokens instead of hashing them.
//!
//! A name is a function of the stream's start (the namespace root under the
//! secret) and the tokens up to the end of its block, so an entry that
//! started from the same state and holds the same tokens holds exactly the
//! names the hash would give: equal bytes, not equal hashes, decide. Comparing
//! a 16-token block is a 64-byte compare; naming it is about 15 SipHash
//! rounds. An entry is a cache of the hash function only: which pages hold
//! those names is still the pool's prefix cache's to say.
//!
//! A few entries (`SLOTS`), each following the latest prompt named from its
//! start: the blocks after the first that differs are replaced by the new
//! prompt's as they are named. Each holds at most `MAX_TOKENS` tokens.

use super::{BlockChain, BlockKey};

/// Starting states remembered at once (namespaces, in effect).
const SLOTS: usize = 8;
/// Tokens an entry holds at most; blocks past them are named by hashing.
const MAX_TOKENS: usize = 16 * 1024;

#[derive(Clone)]
struct Entry {
    start: BlockChain,
    block_size: usize,
    /// Whole blocks, in order.
    tokens: Vec<i32>,
    /// Block i's name, and the stream after it.
    names: Vec<(BlockKey, BlockChain)>,
}

impl Entry {
    fn empty(start: BlockChain, block_size: usize) -> Self {
        Entry {
            start,
            block_size,
            tokens: Vec::new(),
            names: Vec::new(),
        }
    }
}

#[derive(Clone, Default)]
pub struct NameMemo {
    entries: Vec<Entry>,
    /// The entry a new start replaces next (round robin).
    next: usize,
}

impl NameMemo {
    /// The names of the whole blocks of `tokens` (`block_size` each, at most
    /// `max_blocks`), in order, each with the stream after it, for a stream at
    /// `start` (no token absorbed yet): remembered ones while the tokens agree
    /// with the entry of `start`, hashed (and remembered) from the first that
    /// does not. Lazy: a caller that stops early names nothing more.
    #[inline]
    pub fn names<'a>(
        &'a mut self,
        start: BlockChain,
        tokens: &'a [i32],
        block_size: usize,
        max_blocks: usize,
    ) -> Names<'a> {
        debug_assert!(start.tokens() == 0 && block_size > 0);
        let blocks = (tokens.len() / block_size).min(max_blocks);
        let mine = |e: &Entry| e.start == start && e.block_size == block_size;
        let at = match self.entries.iter().position(mine) {
            Some(i) => i,
            None if self.entries.len() < SLOTS => {
                self.entries.push(Entry::empty(start, block_size));
                self.entries.len() - 1
            }
            None => {
                let i = self.next;
                self.next = (i + 1) % SLOTS;
                self.entries[i] = Entry::empty(start, block_size);
                i
            }
        };
        let entry = &mut self.entries[at];
        // How many leading blocks the entry already holds: all of them at
        // one compare when the prompt repeats, else found block by block.
        let common = blocks.min(entry.names.len());
        let n = common * block_size;
        let known = if entry.tokens[..n] == tokens[..n] {
            common
        } else {
            (0..common)
                .find(|&i| {
                    let r = i * block_size..(i + 1) * block_size;
                    entry.tokens[r.clone()] != tokens[r]
                })
                .unwrap_or(common)
        };
        Names {
            entry,
            tokens,
            block_size,
            blocks,
            known,
            next: 0,
            at: start,
        }
    }
}

/// See `NameMemo::names`.
pub struct Names<'a> {
    entry: &'a mut Entry,
    tokens: &'a [i32],
    block_size: usize,
    blocks: usize,
    /// Blocks the entry holds for these tokens.
    known: usize,
    next: usize,
    /// The stream after block `next - 1`.
    at: BlockChain,
}

impl Iterator for Names<'_> {
    type Item = (BlockKey, BlockChain);

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        let i = self.next;
        if i >= self.blocks {
            return None;
        }
        self.next += 1;
        if i < self.known {
            let (name, after) = self.entry.names[i];
            self.at = after;
            return Some((name, after));
        }
        let bs = self.block_size;
        let block = &self.tokens[i * bs..(i + 1) * bs];
        let name = self.at.push(block);
        let e = &mut *self.entry;
        if e.names.len() > i {
            // The entry's blocks from here are another prompt's.
            e.names.truncate(i);
            e.tokens.truncate(i * bs);
        }
        if e.tokens.len() + bs <= MAX_TOKENS {
            e.tokens.extend_from_slice(block);
            e.names.push((name, self.at));
        }
        Some((name, self.at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::BlockNamer;

    fn hashed(start: BlockChain, tokens: &[i32], bs: usize) -> Vec<(BlockKey, BlockChain)> {
        let mut at = start;
        tokens.chunks_exact(bs).map(|b| (at.push(b), at)).collect()
    }

    #[test]
    fn remembered_names_are_the_hashed_ones_whatever_came_before() {
        let namer = BlockNamer::new(&[3; 16]);
        let (a, b) = (namer.chain(1), namer.chain(2));
        let mut memo = NameMemo::default();
        let mut seed = 11u64;
        let mut rnd = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n) as i32
        };
        let base: Vec<i32> = (0..400).map(|_| rnd(50_000)).collect();
        for round in 0..300 {
            // Prompts that share a prefix of random length with the base,
            // from one of two starts, block sizes that do and do not divide.
            let start = if rnd(2) == 0 { a } else { b };
            let bs = [1, 3, 16][rnd(3) as usize] as usize;
            let keep = rnd(400) as usize;
            let len = rnd(400) as usize;
            let mut p: Vec<i32> = base[..keep.min(len)].to_vec();
            p.extend((p.len()..len).map(|_| rnd(50_000)));
            let max_blocks = rnd(30) as usize;
            let take = rnd(40) as usize; // a caller that stops early
            let got: Vec<_> = memo.names(start, &p, bs, max_blocks).take(take).collect();
            let mut want = hashed(start, &p, bs);
            want.truncate(max_blocks.min(take));
            assert!(got == want, "round {round}: bs {bs}, {} tokens", p.len());
        }
        // Repeats are served from memory, past the first 8 starts too.
        for i in 0..(SLOTS as u128 + 3) {
            let s = namer.chain(100 + i);
            let first: Vec<_> = memo.names(s, &base, 16, 8).collect();
            assert_eq!(first, hashed(s, &base[..128], 16));
        }
        assert_eq!(memo.entries.len(), SLOTS);
    }

    #[test]
    fn an_entry_holds_at_most_max_tokens() {
        let namer = BlockNamer::new(&[4; 16]);
        let s = namer.chain(0);
        let long: Vec<i32> = (0..(MAX_TOKENS as i32 + 64)).collect();
        let mut memo = NameMemo::default();
        let all: Vec<_> = memo.names(s, &long, 16, usize::MAX).collect();
        assert_eq!(all.len(), long.len() / 16);
        assert_eq!(memo.entries[0].tokens.len(), MAX_TOKENS);
        let again: Vec<_> = memo.names(s, &long, 16, usize::MAX).collect();
        assert_eq!(again, all);
    }
}
