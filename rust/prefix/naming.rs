//! Block names as one keyed SipHash-1-3-128 stream over a request's tokens.
//!
//! The name of block i (0-based) of a request is
//!
//! ```text
//! key_i = SipHash-1-3-128_K( root || t_0 || t_1 || ... || t_{(i+1)B-1} )
//! ```
//!
//! with K the scheduler's 128-bit secret, `root` the request's namespace root
//! (16 bytes, little-endian), B the block size and each token encoded in
//! little-endian at one width for the scheduler's whole life: int32, or
//! uint16 when the configured vocabulary has at most 65,536 ids (the core
//! refuses any id outside the vocabulary wherever one enters, so the narrow
//! encoding loses nothing and stays injective). A name is exactly what
//! `siphasher::sip128::SipHasher13` returns for that byte string (the tests
//! below check it against the crate). It is a function of the whole prefix,
//! so equal names mean equal roots and equal tokens up to the end of the
//! block, but for a collision of a 128-bit PRF under a key the client does
//! not know.
//!
//! Why a stream rather than `H(key_{i-1} || block_i)`: each block is absorbed
//! once (one compression round per 8 bytes) and its name is the finalization
//! of a copy of the state (4 + 3 rounds), where the chained form re-absorbs
//! the 16-byte parent and pays a whole initialization and finalization per
//! block. The narrow encoding halves the compression rounds (4 instead of 8
//! for a 16-token block), which is most of a name's cost once finalization
//! overlaps the next block's absorption.
//!
//! The state (`BlockChain`) is 48 bytes and `Copy`: a request keeps it
//! instead of the names of all its blocks; the names of cached pages live
//! once, in the prefix cache. This core absorbs tokens as u64 words (no byte
//! view, no `unsafe`, the same on every host) and handles any block size, odd
//! ones too.

use super::BlockKey;

// SipHash's initialization constants ("somepseudorandomlygeneratedbytes").
const C0: u64 = 0x736f_6d65_7073_6575;
const C1: u64 = 0x646f_7261_6e64_6f6d;
const C2: u64 = 0x6c79_6765_6e65_7261;
const C3: u64 = 0x7465_6462_7974_6573;
/// Bytes of the root that every stream starts with.
const ROOT_BYTES: u64 = 16;

#[inline(always)]
fn sip_round(v: &mut [u64; 4]) {
    v[0] = v[0].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(13) ^ v[0];
    v[0] = v[0].rotate_left(32);
    v[2] = v[2].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(16) ^ v[2];
    v[0] = v[0].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(21) ^ v[0];
    v[2] = v[2].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(17) ^ v[2];
    v[2] = v[2].rotate_left(32);
}

/// How token ids are written into the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TokenWidth {
    /// Little-endian int32: any id.
    #[default]
    I32,
    /// Little-endian uint16: ids below 65,536 only (a vocabulary that small).
    U16,
}

impl TokenWidth {
    /// The narrowest encoding every id of a vocabulary of `vocab_size` fits
    /// (int32 when the vocabulary is not known).
    pub fn for_vocab(vocab_size: Option<u32>) -> Self {
        match vocab_size {
            Some(v) if v <= 1 << 16 => TokenWidth::U16,
            _ => TokenWidth::I32,
        }
    }

    fn bytes(self) -> u64 {
        match self {
            TokenWidth::I32 => 4,
            TokenWidth::U16 => 2,
        }
    }
}

/// The keyed stream's starting point: the secret, expanded once, and the
/// token encoding.
#[derive(Clone, Copy)]
pub struct BlockNamer {
    init: [u64; 4],
    width: TokenWidth,
}

impl std::fmt::Debug for BlockNamer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BlockNamer { key: <secret> }")
    }
}

impl BlockNamer {
    /// Tokens as int32.
    pub fn new(key: &[u8; 16]) -> Self {
        Self::with_width(key, TokenWidth::I32)
    }

    pub fn with_width(key: &[u8; 16], width: TokenWidth) -> Self {
        let k0 = u64::from_le_bytes(key[..8].try_into().expect("8 bytes"));
        let k1 = u64::from_le_bytes(key[8..].try_into().expect("8 bytes"));
        // The 128-bit output variant xors 0xee into v1 at initialization.
        BlockNamer {
            init: [k0 ^ C0, k1 ^ C1 ^ 0xee, k0 ^ C2, k1 ^ C3],
            width,
        }
    }

    /// A request's stream before its first block: the root absorbed.
    #[inline]
    pub fn chain(&self, root: BlockKey) -> BlockChain {
        let mut c = BlockChain {
            v: self.init,
            pending: 0,
            tokens: 0,
            width: self.width,
        };
        c.word(root as u64);
        c.word((root >> 64) as u64);
        c
    }
}

/// The stream after the root and the tokens absorbed so far.
///
/// Its state is secret: SipHash's rounds are invertible, so anyone who saw
/// it and knows the tokens could walk back to the key. `Debug` shows only how
/// far it has come.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct BlockChain {
    v: [u64; 4],
    /// The tokens not yet in a word (fewer than a word holds), first lowest.
    pending: u64,
    /// Tokens absorbed (after the root). A request holds fewer than 2^31
    /// (its slots are int32), and the stream's byte length is 16 + width x this.
    tokens: u32,
    width: TokenWidth,
}

impl std::fmt::Debug for BlockChain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BlockChain {{ tokens: {}, state: <secret> }}",
            self.tokens()
        )
    }
}

impl Default for BlockChain {
    /// A placeholder for requests that name nothing (prefix caching off).
    fn default() -> Self {
        BlockChain {
            v: [0; 4],
            pending: 0,
            tokens: 0,
            width: TokenWidth::I32,
        }
    }
}

impl BlockChain {
    #[inline(always)]
    fn word(&mut self, m: u64) {
        self.v[3] ^= m;
        sip_round(&mut self.v); // c = 1
        self.v[0] ^= m;
    }

    /// Tokens absorbed so far (a whole number of blocks between calls).
    #[inline]
    pub fn tokens(&self) -> usize {
        self.tokens as usize
    }

    /// Absorb the next block's tokens and return its name.
    #[inline]
    pub fn push(&mut self, tokens: &[i32]) -> BlockKey {
        self.absorb(tokens);
        self.name()
    }

    /// Absorb tokens without naming them.
    #[inline]
    pub fn absorb(&mut self, tokens: &[i32]) {
        match self.width {
            TokenWidth::I32 => self.absorb_lanes::<2>(tokens),
            TokenWidth::U16 => self.absorb_lanes::<4>(tokens),
        }
    }

    /// `absorb` with `L` tokens to a word.
    #[inline(always)]
    fn absorb_lanes<const L: usize>(&mut self, tokens: &[i32]) {
        let bits = 64 / L;
        let mask = u64::MAX >> (64 - bits);
        // Lossless: a narrow stream's ids are checked below its vocabulary.
        let lane = |t: i32| {
            debug_assert!(L == 2 || (0..1 << 16).contains(&t));
            u64::from(t as u32) & mask
        };
        let mut t = tokens;
        // First fill the word a previous call left part-full.
        while self.tokens as usize % L != 0 {
            let Some((&first, rest)) = t.split_first() else {
                return;
            };
            self.pending |= lane(first) << (bits * (self.tokens as usize % L));
            self.tokens += 1;
            t = rest;
            if self.tokens as usize % L == 0 {
                let m = std::mem::take(&mut self.pending);
                self.word(m);
            }
        }
        let mut words = t.chunks_exact(L);
        for w in &mut words {
            let m = w
                .iter()
                .enumerate()
                .fold(0, |m, (i, &x)| m | lane(x) << (bits * i));
            self.word(m);
        }
        for (i, &x) in words.remainder().iter().enumerate() {
            self.pending |= lane(x) << (bits * i);
        }
        self.tokens += t.len() as u32;
    }

    /// The name of everything absorbed so far; the stream goes on unchanged.
    #[inline]
    pub fn name(&self) -> BlockKey {
        let mut v = self.v;
        // SipHash's last word: the length in bytes (mod 256) in its top byte,
        // the bytes not yet in a word below.
        let len = ROOT_BYTES + self.width.bytes() * u64::from(self.tokens);
        let b = ((len & 0xff) << 56) | self.pending;
        v[3] ^= b;
        sip_round(&mut v);
        v[0] ^= b;
        v[2] ^= 0xee;
        sip_round(&mut v);
        sip_round(&mut v);
        sip_round(&mut v); // d = 3
        let h1 = v[0] ^ v[1] ^ v[2] ^ v[3];
        v[1] ^= 0xdd;
        sip_round(&mut v);
        sip_round(&mut v);
        sip_round(&mut v);
        let h2 = v[0] ^ v[1] ^ v[2] ^ v[3];
        u128::from(h1) | (u128::from(h2) << 64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use siphasher::sip128::{Hasher128, SipHasher13};
    use std::hash::Hasher;

    /// The crate's SipHash-1-3-128 of root || tokens (little-endian int32).
    fn reference(key: &[u8; 16], root: u128, tokens: &[i32]) -> u128 {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        reference_bytes(key, root, &bytes)
    }

    fn reference_bytes(key: &[u8; 16], root: u128, bytes: &[u8]) -> u128 {
        let mut h = SipHasher13::new_with_key(key);
        h.write(&root.to_le_bytes());
        h.write(bytes);
        h.finish128().into()
    }

    fn tokens(n: usize, seed: u64) -> Vec<i32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 200_000) as i32 - 1000 // negative ids too: bytes, not values
            })
            .collect()
    }

    #[test]
    fn names_are_siphash13_128_of_the_root_and_the_prefix() {
        let key = *b"an example key!!";
        let namer = BlockNamer::new(&key);
        let root = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210u128;
        let toks = tokens(200, 7);
        for bs in [1, 2, 3, 7, 16, 32] {
            let mut c = namer.chain(root);
            for (i, block) in toks.chunks_exact(bs).enumerate() {
                let got = c.push(block);
                assert_eq!(
                    got,
                    reference(&key, root, &toks[..(i + 1) * bs]),
                    "bs {bs} block {i}"
                );
                assert_eq!(c.tokens(), (i + 1) * bs);
            }
        }
        assert_eq!(namer.chain(root).name(), reference(&key, root, &[]));
    }

    #[test]
    fn narrow_names_are_siphash13_128_of_the_root_and_uint16_tokens() {
        let key = *b"another key, too";
        let namer = BlockNamer::with_width(&key, TokenWidth::U16);
        let root = 0xfeed_u128 << 70 | 0xbeef;
        let toks: Vec<i32> = tokens(300, 11)
            .iter()
            .map(|t| t.rem_euclid(1 << 16))
            .collect();
        let le = |t: &[i32]| {
            t.iter()
                .flat_map(|&x| (x as u16).to_le_bytes())
                .collect::<Vec<_>>()
        };
        for bs in [1, 2, 3, 5, 7, 16, 32, 33] {
            let mut c = namer.chain(root);
            for (i, block) in toks.chunks_exact(bs).enumerate() {
                // Split each block in two calls too, at every alignment.
                let (a, b) = block.split_at((i * 3) % bs);
                c.absorb(a);
                c.absorb(b);
                let want = reference_bytes(&key, root, &le(&toks[..(i + 1) * bs]));
                assert_eq!(c.name(), want, "bs {bs} block {i}");
            }
        }
        // Another encoding of the same ids is another name.
        let wide = BlockNamer::new(&key).chain(root).push(&toks[..16]);
        assert_ne!(namer.chain(root).push(&toks[..16]), wide);
        assert_eq!(TokenWidth::for_vocab(Some(65_536)), TokenWidth::U16);
        assert_eq!(TokenWidth::for_vocab(Some(65_537)), TokenWidth::I32);
        assert_eq!(TokenWidth::for_vocab(None), TokenWidth::I32);
    }

    #[test]
    fn equal_prefixes_give_equal_names_and_a_change_renames_the_rest() {
        let namer = BlockNamer::new(&[9; 16]);
        let a = tokens(320, 1);
        let names = |t: &[i32]| -> Vec<u128> {
            let mut c = namer.chain(5);
            t.chunks_exact(32).map(|b| c.push(b)).collect()
        };
        let base = names(&a);
        for pos in [0, 31, 32, 100, 319] {
            let mut b = a.clone();
            b[pos] ^= 1;
            for (i, (x, y)) in base.iter().zip(&names(&b)).enumerate() {
                if i < pos / 32 {
                    assert_eq!(x, y, "token {pos}: block {i} comes before it");
                } else {
                    assert_ne!(x, y, "token {pos}: block {i}");
                }
            }
        }
    }

    #[test]
    fn the_key_the_root_and_the_length_are_all_named() {
        let toks = tokens(64, 3);
        let names = |key: [u8; 16], root: u128| {
            let mut c = BlockNamer::new(&key).chain(root);
            toks.chunks_exact(16).map(|b| c.push(b)).collect::<Vec<_>>()
        };
        let a = names([1; 16], 0);
        let mut k = [1; 16];
        k[15] = 2;
        for (x, y) in a.iter().zip(&names(k, 0)) {
            assert_ne!(x, y, "one key bit");
        }
        for (x, y) in a.iter().zip(&names([1; 16], 1)) {
            assert_ne!(x, y, "another root");
        }
        // A block boundary is not a token: a zero token appended renames.
        let mut c = BlockNamer::new(&[1; 16]).chain(0);
        c.absorb(&toks[..16]);
        let short = c.name();
        c.absorb(&[0]);
        assert_ne!(short, c.name());
    }

    #[test]
    fn the_state_is_48_bytes() {
        // Every request holds one; what it needs is 32 bytes of state, the
        // pending tokens, the token count and the encoding.
        assert_eq!(std::mem::size_of::<BlockChain>(), 48);
    }

    #[test]
    fn debug_output_shows_no_state() {
        let key = [0xab; 16];
        let mut c = BlockNamer::new(&key).chain(0);
        c.push(&[1, 2, 3, 4]);
        assert_eq!(
            format!("{c:?}"),
            "BlockChain { tokens: 4, state: <secret> }"
        );
        assert_eq!(
            format!("{:?}", BlockNamer::new(&key)),
            "BlockNamer { key: <secret> }"
        );
    }
}
