//! Prefix-cache naming: full KV blocks named by a keyed 128-bit hash of
//! everything before their end, so a prompt that starts like an earlier one
//! finds the pages that hold those blocks instead of recomputing them. This
//! module only names; the pages, the map from names to them and the LRU list
//! of evictable ones are the pool's (`pool::cache`).
//!
//! Naming. Block i of a sequence (blocks of B tokens) is named
//! `key_i = SipHash-1-3-128_K(root || t_0 || ... || t_{(i+1)B-1})`: one keyed
//! stream over the request's namespace root (16 bytes) and its token ids (each
//! a little-endian int32), block i's name being the finalization of the stream
//! after its last token (see `naming`). The root is `SipHash-1-3-128_K(namespace,
//! salt)`. Every key therefore depends on the namespace, the salt and every
//! token up to the end of its block: equal keys mean equal content at equal
//! positions. K is a 128-bit secret (random per scheduler unless configured):
//! without it nobody can construct two prompts whose blocks collide, so a
//! 2^-128 chance per pair is what an adversary gets too.
//!
//! Namespaces. By default a request's namespace is its tenant: one tenant's
//! blocks never serve another, so a cache hit (and the time it saves) can reveal
//! nothing across tenants. Tenants that trust each other may name a shared
//! namespace; a request may add a salt to keep its blocks to itself.
//!
//! Memo. `NameMemo` keeps the names of recently named prompts by their tokens,
//! so a prompt that starts like one just before compares instead of hashing.

mod memo;
mod naming;

use std::hash::Hasher;

use siphasher::sip128::{Hasher128, SipHasher13};

use crate::tenant::TenantId;

pub use memo::NameMemo;
pub use naming::{BlockChain, BlockNamer, TokenWidth};

/// A block's name.
pub type BlockKey = u128;

/// Who a cached block belongs to, for accounting: the tenant whose private
/// namespace named it, or a shared namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    Tenant(TenantId),
    Shared,
}

/// Where a request's chain starts and who owns the blocks it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Namespace {
    pub root: BlockKey,
    pub scope: Scope,
}

/// The keyed hash. Equal inputs give equal keys on every host that shares the
/// secret and the token encoding (little-endian whatever the host; see
/// `naming`).
#[derive(Clone)]
pub struct PrefixHasher {
    /// Names namespaces (their roots).
    base: SipHasher13,
    /// Names blocks, streaming from a root.
    namer: BlockNamer,
}

impl std::fmt::Debug for PrefixHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PrefixHasher { key: <secret> }")
    }
}

/// Domain tags: a namespace root can never equal a block key of the same bytes.
const TAG_TENANT: u8 = 1;
const TAG_SHARED: u8 = 2;

impl PrefixHasher {
    /// Tokens named as int32.
    pub fn new(key: &[u8; 16]) -> Self {
        Self::with_width(key, TokenWidth::I32)
    }

    /// Tokens named at `width` (see `naming::TokenWidth`).
    pub fn with_width(key: &[u8; 16], width: TokenWidth) -> Self {
        PrefixHasher {
            base: SipHasher13::new_with_key(key),
            namer: BlockNamer::with_width(key, width),
        }
    }

    /// A fresh random secret from the operating system.
    pub fn random_key() -> Result<[u8; 16], String> {
        let mut key = [0u8; 16];
        getrandom::fill(&mut key).map_err(|e| format!("no randomness for the prefix key: {e}"))?;
        Ok(key)
    }

    /// The namespace of a request: its tenant's own (`shared` None) or the named
    /// shared one, with an optional salt. Lengths are hashed before contents, so
    /// no two (kind, name, salt) triples run together into the same bytes.
    pub fn namespace(
        &self,
        tenant: TenantId,
        tenant_name: &str,
        shared: Option<&str>,
        salt: Option<&[u8]>,
    ) -> Namespace {
        let mut h = self.base;
        let (tag, name, scope) = match shared {
            None => (TAG_TENANT, tenant_name, Scope::Tenant(tenant)),
            Some(ns) => (TAG_SHARED, ns, Scope::Shared),
        };
        h.write_u8(tag);
        h.write_u64(name.len() as u64);
        h.write(name.as_bytes());
        match salt {
            None => h.write_u8(0),
            Some(s) => {
                h.write_u8(1);
                h.write_u64(s.len() as u64);
                h.write(s);
            }
        }
        Namespace {
            root: h.finish128().into(),
            scope,
        }
    }

    /// A request's naming stream, started at its namespace root: push its
    /// blocks in order to get their names.
    #[inline]
    pub fn chain(&self, root: BlockKey) -> BlockChain {
        self.namer.chain(root)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_depend_on_the_secret_the_chain_and_the_namespace() {
        let a = PrefixHasher::new(&[1; 16]);
        let b = PrefixHasher::new(&[2; 16]);
        let toks = [5, 6, 7, 8];
        // The name of the first block of `toks` in the stream from `root`.
        let block = |h: &PrefixHasher, root: BlockKey, toks: &[i32]| h.chain(root).push(toks);
        let ns = a.namespace(0, "t", None, None);
        assert_eq!(block(&a, ns.root, &toks), block(&a, ns.root, &toks));
        assert_ne!(
            block(&a, ns.root, &toks),
            block(&b, ns.root, &toks),
            "secret"
        );
        assert_ne!(
            block(&a, ns.root, &toks),
            block(&a, ns.root + 1, &toks),
            "parent"
        );
        assert_ne!(block(&a, ns.root, &toks), block(&a, ns.root, &[5, 6, 7, 9]));
        // And a later block depends on the one before it (the chain).
        let mut c = a.chain(ns.root);
        c.push(&toks);
        let mut d = a.chain(ns.root);
        d.push(&[5, 6, 7, 9]);
        assert_ne!(c.push(&toks), d.push(&toks), "earlier block");
        let other = a.namespace(0, "u", None, None);
        assert_ne!(ns.root, other.root, "tenant name");
        let shared = a.namespace(0, "t", Some("t"), None);
        assert_ne!(
            ns.root, shared.root,
            "a shared namespace is not the tenant's"
        );
        assert_eq!(shared.scope, Scope::Shared);
        let salted = a.namespace(0, "t", None, Some(b""));
        assert_ne!(ns.root, salted.root, "an empty salt is still a salt");
        // Length prefixes: ("ab", salt "c") and ("a", salt "bc") differ.
        assert_ne!(
            a.namespace(0, "ab", None, Some(b"c")).root,
            a.namespace(0, "a", None, Some(b"bc")).root
        );
        // The same name in another tenant slot is the same namespace (names, not
        // slots, are hashed); only the accounting scope differs.
        assert_eq!(a.namespace(3, "t", None, None).root, ns.root);
    }
}
