//! The prefix cache's page state: which pages hold a named block, found by
//! name (`index`), and the LRU list of those nobody references. The names
//! come from `prefix`; the reference counts that decide when a cached page
//! becomes evictable are the pool's, and only the pool parks, unparks and
//! evicts (every such call here is private to `pool`).
//!
//! Pages. A cached page stays in the cache while requests reference it and after
//! the last reference goes: it is then *evictable*, parked on an LRU list, and
//! the pool hands it out again (dropping its name) only when no free page is
//! left. A request releases its pages last to first, so a chain's tail is
//! evicted before its head: the head is the part other prompts share.
//!
//! Partitioned by tenant (`partition_by_tenant`), each tenant parks on a list
//! of its own and only its own allocations evict from it, so no tenant can
//! learn another's allocations from which of its own blocks survived; the
//! scheduler keeps each list within the tenant's quota (see
//! `Scheduler::cache_quota`).

use super::events::KvEventLog;
use super::index::{CacheKey, PageIndex};
use crate::page::{resident, PageId};
use crate::prefix::Scope;
use crate::tenant::TenantId;

/// Bytes the prefix cache takes per page, rounded up: a 16-byte name, scope,
/// two LRU links, a flag and its hash-table slot (see `PrefixCache::new`).
pub(super) const PREFIX_CACHE_BYTES_PER_PAGE: usize = 48;

/// Page 0 is never cached, so it terminates the LRU list (a sentinel).
const END: u32 = 0;
const NOT_CACHED: u32 = u32::MAX;
const SHARED: u32 = u32::MAX - 1;

/// The names of cached pages and the LRU list of those nobody references.
/// Reference counts live in the pool, which calls `park`, `unpark` and
/// `evict_lru` as pages change hands.
#[derive(Clone, Debug)]
pub struct PrefixCache {
    /// The cached pages, found by name. A slot holds a page id (4 bytes, not
    /// the 32 of a (u128, u32) pair): the name itself is stored once, in
    /// `key`. Names are uniform and secret, so their bits are the hash.
    /// Sized once for every page, it never grows (see `index`).
    map: PageIndex,
    /// Per page: its key while cached.
    key: Vec<CacheKey>,
    /// Per page: NOT_CACHED, SHARED or the owning tenant's id.
    scope: Vec<u32>,
    /// LRU links among evictable pages; `next[0]` is the oldest, `prev[0]` the newest.
    prev: Vec<u32>,
    next: Vec<u32>,
    parked: Vec<bool>,
    evictable: usize,
    evictions: u64,
    /// Partitioned by tenant (`partition_by_tenant`): per page, the list it is
    /// parked on (END: the shared list; `num_pages + t`: tenant t's); empty
    /// when not partitioned. Tenant t's list has its own head and tail at
    /// `prev`/`next[num_pages + t]`, added when t first parks a page.
    home: Vec<u32>,
    /// Partitioned: evictable pages on each tenant's list.
    parked_by: Vec<usize>,
    /// The changes routers are told of (`BlockPool::enable_kv_events`).
    pub(super) log: Option<Box<KvEventLog>>,
}

/// The LRU list a page is parked on: the shared one (END) or a tenant's.
pub(super) type List = u32;

/// The shared LRU list.
pub(super) const SHARED_LIST: List = END;

impl PrefixCache {
    /// A cache for `num_blocks` pages; 0 for a pool that caches nothing (all
    /// its queries then answer "not cached"). Every array is allocated
    /// fallibly and written through (`resident`): a cache the process cannot
    /// hold is an error here, not an abort.
    pub(super) fn new(num_blocks: usize) -> Result<Self, std::collections::TryReserveError> {
        Ok(PrefixCache {
            map: PageIndex::new(num_blocks)?,
            key: resident(num_blocks, CacheKey::default())?,
            scope: resident(num_blocks, NOT_CACHED)?,
            prev: resident(num_blocks, END)?,
            next: resident(num_blocks, END)?,
            parked: resident(num_blocks, false)?,
            evictable: 0,
            evictions: 0,
            home: Vec::new(),
            parked_by: Vec::new(),
            log: None,
        })
    }

    /// Give every tenant an LRU list of its own (call before anything is
    /// parked): a tenant's evictable pages are then evicted only for its own
    /// allocations (`evict_lru_of`), never by another tenant's. Nothing is
    /// parked on the shared list any more.
    pub(super) fn partition_by_tenant(&mut self) {
        debug_assert_eq!(self.evictable, 0);
        self.home = vec![END; self.parked.len()];
    }

    /// Whether each tenant has its own LRU list.
    #[inline]
    pub fn partitioned(&self) -> bool {
        !self.home.is_empty()
    }

    /// The list `tenant`'s releases park on: its own when partitioned (made
    /// on first use), else the shared one.
    pub(super) fn list_of(&mut self, tenant: TenantId) -> List {
        if !self.partitioned() {
            return SHARED_LIST;
        }
        let head = self.parked.len() + tenant;
        if head >= self.next.len() {
            self.next.resize(head + 1, 0);
            self.prev.resize(head + 1, 0);
            for h in self.parked.len() + self.parked_by.len()..=head {
                // An empty list: its head is its own newest and oldest.
                self.next[h] = h as u32;
                self.prev[h] = h as u32;
            }
            self.parked_by.resize(tenant + 1, 0);
        }
        head as List
    }

    /// Evictable pages on `tenant`'s own list (0 when not partitioned).
    #[inline]
    pub fn parked_by(&self, tenant: TenantId) -> usize {
        self.parked_by.get(tenant).copied().unwrap_or(0)
    }

    /// The page cached under `key`.
    #[inline]
    pub fn lookup(&self, key: CacheKey) -> Option<u32> {
        let names = &self.key;
        self.map.find(key, |p| names[p as usize])
    }

    #[inline]
    pub fn is_cached(&self, page: u32) -> bool {
        self.scope
            .get(page as usize)
            .is_some_and(|&s| s != NOT_CACHED)
    }

    /// Whose namespace named `page` (None: not cached).
    #[inline]
    pub fn scope(&self, page: u32) -> Option<Scope> {
        match self.scope.get(page as usize).copied().unwrap_or(NOT_CACHED) {
            NOT_CACHED => None,
            SHARED => Some(Scope::Shared),
            t => Some(Scope::Tenant(t as TenantId)),
        }
    }

    pub fn key_of(&self, page: u32) -> Option<CacheKey> {
        self.is_cached(page).then(|| self.key[page as usize])
    }

    #[inline]
    pub fn is_parked(&self, page: u32) -> bool {
        self.parked.get(page as usize).copied().unwrap_or(false)
    }

    /// Pages the cache can name (0: caching off).
    pub fn capacity(&self) -> usize {
        self.key.len()
    }

    /// Pages cached (referenced or evictable).
    pub fn cached(&self) -> usize {
        self.map.len()
    }

    /// Cached pages nobody references.
    pub fn evictable(&self) -> usize {
        self.evictable
    }

    /// Pages taken back from the cache to be reused since start.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Name a (referenced, uncached) page. False, and nothing changes, when the
    /// key already names another page: the first copy stays the cached one.
    pub(super) fn register(&mut self, page: u32, key: CacheKey, scope: Scope) -> bool {
        if page as usize >= self.key.len() {
            return false; // a cache of no pages (caching off) names nothing
        }
        debug_assert!(page != END && !self.is_cached(page) && !self.is_parked(page));
        // One probe finds the key or the slot it goes in.
        let names = &self.key;
        if !self.map.insert(key, page, |p| names[p as usize]) {
            return false;
        }
        self.key[page as usize] = key;
        self.scope[page as usize] = match scope {
            Scope::Shared => SHARED,
            Scope::Tenant(t) => {
                debug_assert!((t as u64) < SHARED as u64);
                t as u32
            }
        };
        true
    }

    /// Touch the index lines `keys` would probe, so that registering them
    /// next finds those lines in the cache: the loads are independent, so
    /// their misses overlap here instead of stalling one register each. It
    /// changes nothing.
    pub fn prefetch(&self, keys: impl Iterator<Item = CacheKey>) {
        self.map.touch(keys);
    }

    /// A cached page lost its last reference: it becomes the newest evictable
    /// one of `list` (`SHARED_LIST`, or a tenant's from `list_of`).
    #[cfg(test)]
    pub(super) fn park(&mut self, page: u32, list: List) {
        debug_assert!(self.is_cached(page) && !self.is_parked(page));
        debug_assert_eq!(list == SHARED_LIST, !self.partitioned());
        let p = page as usize;
        let newest = self.prev[list as usize];
        self.next[newest as usize] = page;
        self.prev[p] = newest;
        self.next[p] = list;
        self.prev[list as usize] = page;
        self.parked[p] = true;
        self.evictable += 1;
        if list != SHARED_LIST {
            self.home[p] = list;
            self.parked_by[list as usize - self.parked.len()] += 1;
        }
    }

    /// `park` for each cached page of `pages` that `refcount` says lost its
    /// last reference, as a release that walks `pages` last to first parks
    /// them (each the newest so far; a page listed twice parks where its last
    /// reference went, its first listing). The run is linked in one forward
    /// walk, newest first, and spliced onto the list once, where `park` per
    /// page reloads and rewrites the list's newest end.
    pub(super) fn park_released<P: PageId>(&mut self, pages: &[P], refcount: &[u32], list: List) {
        debug_assert_eq!(list == SHARED_LIST, !self.partitioned());
        let tenant_list = list != SHARED_LIST;
        let (mut newest, mut oldest) = (END, END);
        let mut n = 0;
        for page in pages {
            let p = page.to_i64() as usize;
            if refcount[p] != 0 || !self.is_cached(p as u32) || self.parked[p] {
                continue;
            }
            self.parked[p] = true;
            if tenant_list {
                self.home[p] = list;
            }
            if n == 0 {
                newest = p as u32;
            } else {
                // `p` is older than the page linked before it.
                self.prev[oldest as usize] = p as u32;
                self.next[p] = oldest;
            }
            oldest = p as u32;
            n += 1;
        }
        if n == 0 {
            return;
        }
        let before = self.prev[list as usize];
        self.next[before as usize] = oldest;
        self.prev[oldest as usize] = before;
        self.next[newest as usize] = list;
        self.prev[list as usize] = newest;
        self.evictable += n;
        if tenant_list {
            self.parked_by[list as usize - self.parked.len()] += n;
        }
    }

    /// An evictable page is referenced again (a cache hit).
    pub(super) fn unpark(&mut self, page: u32) {
        debug_assert!(self.is_parked(page));
        let p = page as usize;
        let (prev, next) = (self.prev[p], self.next[p]);
        self.next[prev as usize] = next;
        self.prev[next as usize] = prev;
        self.parked[p] = false;
        self.evictable -= 1;
        self.left_home(p, 1);
    }

    /// Partitioned: `n` pages left the list page `p` was parked on.
    #[inline]
    fn left_home(&mut self, p: usize, n: usize) {
        if let Some(&list) = self.home.get(p) {
            self.parked_by[list as usize - self.parked.len()] -= n;
        }
    }

    /// Each evictable page of `pages` is referenced again (cache hits; the
    /// others are skipped): `unpark` for each, with a run of pages that lie
    /// next to each other on the LRU list, newest first, as a prompt's blocks
    /// do once its request released them last to first, cut out in one splice.
    pub(super) fn unpark_all<P: PageId>(&mut self, pages: &[P]) {
        let page = |i: usize| pages[i].to_i64() as u32;
        let mut i = 0;
        while i < pages.len() {
            let newest = page(i);
            if !self.is_parked(newest) {
                i += 1;
                continue;
            }
            // Extend the run while the next listed page is the one just older.
            let mut oldest = newest;
            let mut j = i + 1;
            while j < pages.len() && page(j) != END && self.prev[oldest as usize] == page(j) {
                self.parked[oldest as usize] = false;
                oldest = page(j);
                j += 1;
            }
            self.parked[oldest as usize] = false;
            let (before, after) = (self.prev[oldest as usize], self.next[newest as usize]);
            self.next[before as usize] = after;
            self.prev[after as usize] = before;
            self.evictable -= j - i;
            self.left_home(oldest as usize, j - i);
            i = j;
        }
    }

    /// The least recently released evictable page (END: none; a cache of no
    /// pages has no list at all).
    #[inline]
    fn oldest(&self) -> u32 {
        self.next.first().copied().unwrap_or(END)
    }

    /// Take the least recently released evictable page out of the cache.
    pub(super) fn evict_lru(&mut self) -> Option<u32> {
        let page = self.oldest();
        if page == END {
            return None;
        }
        self.unpark(page);
        self.forget(page);
        self.evictions += 1;
        Some(page)
    }

    /// Partitioned: take the least recently released page of `tenant`'s own
    /// list out of the cache (None: it has none parked).
    pub(super) fn evict_lru_of(&mut self, tenant: TenantId) -> Option<u32> {
        if self.parked_by(tenant) == 0 {
            return None;
        }
        let page = self.next[self.parked.len() + tenant];
        self.unpark(page);
        self.forget(page);
        self.evictions += 1;
        Some(page)
    }

    fn forget(&mut self, page: u32) {
        let p = page as usize;
        if let Some(log) = &mut self.log {
            log.removed(page, self.key[p].wire());
        }
        self.map.remove(self.key[p], page);
        self.scope[p] = NOT_CACHED;
    }

    /// Evictable pages of `tenant`'s namespace, oldest first (they are forgotten
    /// when the tenant is removed). Partitioned: every page on its own list
    /// (pages of shared namespaces it released too: its quota goes with it).
    pub(super) fn parked_of(&self, tenant: TenantId) -> Vec<u32> {
        let mut out = Vec::new();
        if self.partitioned() {
            if self.parked_by(tenant) > 0 {
                let head = (self.parked.len() + tenant) as u32;
                let mut p = self.next[head as usize];
                while p != head {
                    out.push(p);
                    p = self.next[p as usize];
                }
            }
            return out;
        }
        let mut p = self.oldest();
        while p != END {
            if self.scope[p as usize] == tenant as u32 {
                out.push(p);
            }
            p = self.next[p as usize];
        }
        out
    }

    /// Drop an evictable page's name; the caller frees it.
    pub(super) fn drop_parked(&mut self, page: u32) {
        self.unpark(page);
        self.forget(page);
    }

    /// Consistency of names, scopes and the LRU list, for tests.
    pub(super) fn check_invariants(&self, refcount: &[u32]) -> Result<(), String> {
        if self.key.is_empty() {
            // Caching off: nothing may be named or parked.
            return match (self.map.len(), self.evictable) {
                (0, 0) => Ok(()),
                (n, e) => Err(format!("a cache of no pages holds {n} names, {e} parked")),
            };
        }
        let names = &self.key;
        self.map
            .check(|p| names.get(p as usize).copied().unwrap_or_default())?;
        for page in self.map.pages() {
            if self
                .scope
                .get(page as usize)
                .is_none_or(|&s| s == NOT_CACHED)
                || self.lookup(self.key[page as usize]) != Some(page)
            {
                return Err(format!("map entry for page {page} disagrees with the page"));
            }
        }
        let named = self.scope.iter().filter(|&&s| s != NOT_CACHED).count();
        if named != self.map.len() {
            return Err(format!(
                "{named} pages carry a name, the map holds {}",
                self.map.len()
            ));
        }
        let mut walked = 0;
        // The shared list, then (partitioned) each tenant's.
        let heads = std::iter::once(END)
            .chain((0..self.parked_by.len()).map(|t| (self.parked.len() + t) as u32));
        for head in heads {
            let mut on_list = 0;
            let mut p = self.next[head as usize];
            let mut last = head;
            while p != head {
                walked += 1;
                on_list += 1;
                if walked > self.parked.len() {
                    return Err("the LRU list has a cycle".into());
                }
                let i = p as usize;
                if i >= self.parked.len() || !self.parked[i] || self.prev[i] != last {
                    return Err(format!("LRU links broken at page {p}"));
                }
                if self.scope[i] == NOT_CACHED || refcount[i] != 0 {
                    return Err(format!(
                        "evictable page {p} is uncached or referenced ({} refs)",
                        refcount[i]
                    ));
                }
                if self.home.get(i).is_some_and(|&h| h != head) {
                    return Err(format!("page {p} is on list {head}, its home is another"));
                }
                last = p;
                p = self.next[i];
            }
            if self.prev[head as usize] != last {
                return Err("the LRU tail pointer is stale".into());
            }
            if head != END {
                let t = head as usize - self.parked.len();
                if on_list != self.parked_by[t] {
                    return Err(format!(
                        "tenant {t} parks {on_list} pages, its count says {}",
                        self.parked_by[t]
                    ));
                }
            } else if self.partitioned() && on_list > 0 {
                return Err("a partitioned cache parked a page on the shared list".into());
            }
        }
        let parked = self.parked.iter().filter(|&&b| b).count();
        if walked != parked || parked != self.evictable {
            return Err(format!(
                "evictable count {} vs {parked} marked vs {walked} listed",
                self.evictable
            ));
        }
        for (i, (&rc, &s)) in refcount.iter().zip(&self.scope).enumerate() {
            if s != NOT_CACHED && rc == 0 && !self.parked[i] {
                return Err(format!(
                    "cached page {i} is neither referenced nor evictable"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_oldest_first_and_unpark_removes_from_the_middle() {
        let mut c = PrefixCache::new(8).unwrap();
        for (p, k) in [(1u32, 10u128), (2, 20), (3, 30), (4, 40)] {
            assert!(c.register(p, CacheKey::new(k), Scope::Tenant(0)));
        }
        assert!(
            !c.register(5, CacheKey::new(10), Scope::Tenant(0)),
            "a key names one page"
        );
        for p in [3, 1, 4, 2] {
            c.park(p, SHARED_LIST);
        }
        let mut rc = vec![0u32; 8];
        rc[5] = 1;
        c.check_invariants(&rc).unwrap();
        c.unpark(4);
        rc[4] = 1;
        c.check_invariants(&rc).unwrap();
        assert_eq!(c.evict_lru(), Some(3));
        assert_eq!(c.lookup(CacheKey::new(30)), None);
        assert_eq!(c.evict_lru(), Some(1));
        assert_eq!(c.evict_lru(), Some(2));
        assert_eq!(c.evict_lru(), None);
        assert_eq!((c.evictions(), c.cached(), c.evictable()), (3, 1, 0));
        assert_eq!(c.lookup(CacheKey::new(40)), Some(4));
        assert_eq!(c.scope(4), Some(Scope::Tenant(0)));
        c.check_invariants(&rc).unwrap();
    }

    #[test]
    fn park_released_is_park_for_each_unreferenced_cached_page_last_first() {
        let fill = |c: &mut PrefixCache| {
            for p in 1..9u32 {
                if p != 6 {
                    assert!(c.register(p, CacheKey::new(100 + p as u128), Scope::Shared));
                }
            }
        };
        let (mut one, mut run) = (PrefixCache::new(10).unwrap(), PrefixCache::new(10).unwrap());
        fill(&mut one);
        fill(&mut run);
        // Already parked before: 8, which stays the oldest.
        one.park(8, SHARED_LIST);
        run.park(8, SHARED_LIST);
        // Released: 1..7 and 8 again; 3 is still referenced, 6 is not cached,
        // 8 is parked already: each of those is skipped. 2 is listed twice: it
        // parks where a last-to-first walk drops its last reference, at its
        // first listing.
        let mut rc = vec![0u32; 10];
        rc[3] = 1;
        for p in [7, 5, 4, 2, 1] {
            one.park(p, SHARED_LIST);
        }
        run.park_released(&[1u32, 2, 3, 4, 2, 5, 6, 7, 8], &rc, SHARED_LIST);
        one.check_invariants(&rc).unwrap();
        run.check_invariants(&rc).unwrap();
        assert_eq!(run.evictable(), 6);
        let order = |c: &mut PrefixCache| std::iter::from_fn(|| c.evict_lru()).collect::<Vec<_>>();
        assert_eq!(order(&mut run), order(&mut one));
    }

    #[test]
    fn unpark_all_cuts_runs_out_of_the_lru_list_and_keeps_the_rest_in_order() {
        let mut c = PrefixCache::new(12).unwrap();
        for p in 1..12u32 {
            assert!(c.register(p, CacheKey::new(100 + p as u128), Scope::Shared));
        }
        // Released last to first, as a request does: 5 4 3 2 1, then 10 9 8 7 6,
        // then 11.
        for p in [5, 4, 3, 2, 1, 10, 9, 8, 7, 6, 11] {
            c.park(p, SHARED_LIST);
        }
        let mut rc = vec![0u32; 12];
        // Hits in prompt order: a run (1 2 3), a page not parked (3 again), a
        // lone page (8), a run broken by order (7 after 8 is older: its own run).
        c.unpark_all(&[1u32, 2, 3, 3, 8, 7]);
        for p in [1, 2, 3, 8, 7] {
            rc[p] = 1;
            assert!(!c.is_parked(p as u32));
        }
        c.check_invariants(&rc).unwrap();
        assert_eq!(c.evictable(), 6);
        let order: Vec<u32> = std::iter::from_fn(|| c.evict_lru()).collect();
        assert_eq!(
            order,
            vec![5, 4, 10, 9, 6, 11],
            "the rest keeps its LRU order"
        );
        c.check_invariants(&rc).unwrap();
    }
}
