//! BlockPool: the physical KV pages, a free list and a refcount per page.
//!
//! Page 0 is the null page: the step plan pads page tables with it, so it must be
//! a real page, but it is never handed out and never freed.
//!
//! Allocation pops from a stack of free ids and freeing pushes back, both O(1) per
//! page. A page shared by several owners (prefix reuse, a forked sequence) carries
//! one reference per owner; freeing it only drops one reference. Every batch call
//! is all-or-nothing: on a bad id nothing changes.
//!
//! A page is in one of three states: free (on the stack), referenced, or
//! evictable: named by the prefix cache, unreferenced, parked on its LRU list.
//! Allocation takes free pages first and evicts only when none is left, so an
//! evictable page is as available as a free one but keeps its content for a
//! cache hit as long as possible.
//!
//! The prefix cache's page state is the pool's too, since it changes with the
//! refcounts: `cache` holds which pages hold a named block and the LRU lists
//! of evictable ones, `index` finds a cached page by its block's name. The
//! pool is the only caller of their park, unpark and evict. The names
//! themselves come from `prefix`, which knows nothing of pages.

use crate::error::{KvError, KvResult};
use crate::page::{validate_shape, BlockSize, PageId, NULL_PAGE};
use crate::prefix::Scope;
use crate::tenant::TenantId;

mod cache;
mod events;
mod index;

pub use cache::PrefixCache;
use cache::{List, PREFIX_CACHE_BYTES_PER_PAGE, SHARED_LIST};
pub(crate) use events::BlockOrigin;
pub use events::{KvEventLog, NamespaceTag};
pub use index::CacheKey;

#[derive(Clone, Debug)]
pub struct BlockPool {
    block_size: BlockSize,
    /// References held on each page; index = page id. refcount[0] stays 0.
    refcount: Vec<u32>,
    /// Free page ids, used as a stack (allocate pops from the end).
    free: Vec<u32>,
    /// Pages with two or more references.
    shared: usize,
    /// Names of cached pages and the LRU list of evictable ones.
    cache: PrefixCache,
}

impl BlockPool {
    /// `num_blocks` pages (page 0 included) of `block_size` tokens, any of
    /// which the prefix cache may name.
    pub fn new(num_blocks: usize, block_size: usize) -> KvResult<Self> {
        Self::with_prefix_cache(num_blocks, block_size, true)
    }

    /// `new`, with the prefix cache's per-page arrays and index allocated only
    /// when `caching` (about 37 bytes a page otherwise spent on names nobody
    /// gives). Without, no page is ever cached: `register` must not be called.
    pub fn with_prefix_cache(
        num_blocks: usize,
        block_size: usize,
        caching: bool,
    ) -> KvResult<Self> {
        validate_shape(num_blocks, block_size)?;
        // Fallible: a pool the process cannot hold is an InvalidConfig, not
        // an abort (the global allocator aborts on failure).
        let cannot = |what: &str| {
            KvError::InvalidConfig(format!(
                "num_blocks={num_blocks}: cannot allocate the pool's {what} (about \
                 {} bytes a page); lower num_blocks",
                if caching {
                    8 + PREFIX_CACHE_BYTES_PER_PAGE
                } else {
                    8
                }
            ))
        };
        let mut refcount: Vec<u32> = Vec::new();
        refcount
            .try_reserve_exact(num_blocks)
            .map_err(|_| cannot("refcounts"))?;
        refcount.resize(num_blocks, 0);
        let mut free: Vec<u32> = Vec::new();
        free.try_reserve_exact(num_blocks - 1)
            .map_err(|_| cannot("free list"))?;
        // Reverse order so that pages come out 1, 2, 3, ... from a fresh pool.
        free.extend((1..num_blocks as u32).rev());
        let cache = PrefixCache::new(if caching { num_blocks } else { 0 })
            .map_err(|_| cannot("prefix cache"))?;
        Ok(BlockPool {
            block_size: BlockSize::new(block_size),
            refcount,
            free,
            shared: 0,
            cache,
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size.get()
    }

    /// All pages, the null page included.
    pub fn num_blocks(&self) -> usize {
        self.refcount.len()
    }

    /// Pages that can ever be handed out (all but the null page).
    pub fn total(&self) -> usize {
        self.refcount.len() - 1
    }

    /// Pages on the free list (evictable cached pages not included).
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Pages an allocation can take now: free plus evictable.
    #[inline]
    pub fn available(&self) -> usize {
        self.free.len() + self.cache.evictable()
    }

    /// Pages with at least one reference.
    pub fn used(&self) -> usize {
        self.total() - self.available()
    }

    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }

    /// Record the prefix cache's changes from now on for routers (see
    /// `events`); nothing when the pool caches nothing.
    pub fn enable_kv_events(&mut self) {
        if self.cache.log.is_none() && self.cache.capacity() > 0 {
            let log = KvEventLog::new(self.num_blocks(), self.block_size());
            self.cache.log = Some(Box::new(log));
        }
    }

    /// The prefix cache's changes not yet drained (None: not recording).
    pub fn kv_events(&self) -> Option<&KvEventLog> {
        self.cache.log.as_deref()
    }

    pub fn kv_events_mut(&mut self) -> Option<&mut KvEventLog> {
        self.cache.log.as_deref_mut()
    }

    /// Each cached block as the events name it: (group, wire hash), by page.
    pub fn cached_blocks_on_wire(&self) -> Vec<(u8, u64)> {
        let log = self.cache.log.as_deref();
        (0..self.cache.capacity() as u32)
            .filter_map(|p| {
                let key = self.cache.key_of(p)?;
                Some((log.map_or(0, |l| l.group_of(p)), key.wire()))
            })
            .collect()
    }

    /// Name a referenced page in the prefix cache (see `PrefixCache::register`).
    pub fn register(&mut self, page: u32, key: CacheKey, scope: Scope) -> bool {
        debug_assert!(self.refcount(page) > 0, "only a held page is named");
        self.cache.register(page, key, scope)
    }

    /// Forget the evictable pages of `tenant`'s namespace and free them
    /// (partitioned: every page on its own list).
    pub fn forget_tenant(&mut self, tenant: TenantId) -> usize {
        let pages = self.cache.parked_of(tenant);
        for &p in &pages {
            self.cache.drop_parked(p);
            self.free.push(p);
        }
        pages.len()
    }

    /// Partition the evictable pages by tenant (see
    /// `PrefixCache::partition_by_tenant`); call on a fresh pool. A tenant's
    /// releases then park on its own list (`free_counting_by`), its
    /// allocations evict from that list only (`allocate_into_for`), and
    /// `trim_parked` keeps each list within the quota its owner is given.
    pub fn partition_by_tenant(&mut self) {
        self.cache.partition_by_tenant();
    }

    /// Free `tenant`'s oldest evictable pages until at most `keep` remain on
    /// its own list (partitioned; nothing otherwise). Returns how many went.
    pub fn trim_parked(&mut self, tenant: TenantId, keep: usize) -> usize {
        let mut n = 0;
        while self.cache.parked_by(tenant) > keep {
            let page = self.cache.evict_lru_of(tenant).expect("counted as parked");
            self.free.push(page);
            n += 1;
        }
        n
    }

    pub fn shared(&self) -> usize {
        self.shared
    }

    /// References held on `page` (0 for a free page or the null page).
    pub fn refcount(&self, page: u32) -> u32 {
        self.refcount.get(page as usize).copied().unwrap_or(0)
    }

    /// References held on `page`, for a caller-supplied id: out of range is an
    /// error (0 for a free page or the null page).
    pub fn refcount_checked(&self, page: i64) -> KvResult<u32> {
        if page < 0 || page >= self.refcount.len() as i64 {
            return Err(KvError::InvalidPage {
                page,
                why: "out of range",
            });
        }
        Ok(self.refcount[page as usize])
    }

    /// Blocks needed to hold `tokens` tokens.
    #[inline]
    pub fn blocks_for(&self, tokens: usize) -> usize {
        self.block_size.blocks_for(tokens)
    }

    /// Take one page (free, else the least recently released evictable one)
    /// with one reference.
    pub fn allocate_one(&mut self) -> KvResult<u32> {
        let page = match self.free.pop() {
            Some(p) => p,
            None => self.cache.evict_lru().ok_or(KvError::OutOfPages {
                requested: 1,
                free: 0,
            })?,
        };
        self.refcount[page as usize] = 1;
        Ok(page)
    }

    /// Take `n` pages, each with one reference, appending their ids to `out`:
    /// free pages first, then evictable ones, least recently released first.
    /// All or nothing: with fewer than `n` available nothing is taken.
    pub fn allocate_into<T: PageId>(&mut self, n: usize, out: &mut Vec<T>) -> KvResult<()> {
        let available = self.available();
        if n > available {
            return Err(KvError::OutOfPages {
                requested: n,
                free: available,
            });
        }
        self.take_into(n, out, None);
        Ok(())
    }

    /// `allocate_into` for a request of `tenant`: partitioned, it evicts from
    /// `tenant`'s own list only (free pages first, as always); otherwise the
    /// same as `allocate_into`.
    #[inline]
    pub fn allocate_into_for<T: PageId>(
        &mut self,
        tenant: TenantId,
        n: usize,
        out: &mut Vec<T>,
    ) -> KvResult<()> {
        if !self.cache.partitioned() {
            return self.allocate_into(n, out);
        }
        let available = self.free.len() + self.cache.parked_by(tenant);
        if n > available {
            return Err(KvError::OutOfPages {
                requested: n,
                free: available,
            });
        }
        self.take_into(n, out, Some(tenant));
        Ok(())
    }

    /// Take `n` pages counted as available: free ones, then the oldest
    /// evictable (of `tenant`'s own list when given).
    #[inline]
    fn take_into<T: PageId>(&mut self, n: usize, out: &mut Vec<T>, tenant: Option<TenantId>) {
        out.reserve(n);
        let have = self.free.len();
        let from_free = n.min(have);
        for &page in self.free[have - from_free..].iter().rev() {
            self.refcount[page as usize] = 1;
            out.push(T::from_page(page));
        }
        self.free.truncate(have - from_free);
        for _ in from_free..n {
            let page = match tenant {
                None => self.cache.evict_lru(),
                Some(t) => self.cache.evict_lru_of(t),
            };
            let page = page.expect("counted as available");
            self.refcount[page as usize] = 1;
            out.push(T::from_page(page));
        }
    }

    /// Drop one reference on each listed page, last to first; a page left with
    /// none goes back to the free list, or, when the prefix cache names it, to
    /// the newest end of the evictable list (so a released chain's tail is
    /// evicted before its head). A page may appear several times (one reference
    /// each). All or nothing: the null page, an out-of-range id or a page
    /// without a reference left to drop is an error and changes nothing.
    pub fn free<P: PageId>(&mut self, pages: &[P]) -> KvResult<()> {
        self.free_counting(pages, None).map(|_| ())
    }

    /// `free`, and how many of `pages` had another reference besides this
    /// one and are named in `scope`'s namespace (0 when `scope` is None), in
    /// the same pass.
    pub fn free_counting<P: PageId>(
        &mut self,
        pages: &[P],
        scope: Option<Scope>,
    ) -> KvResult<usize> {
        self.release(pages, scope, SHARED_LIST)
    }

    /// `free_counting` for a request of `tenant`: partitioned, the pages left
    /// without a reference park on `tenant`'s own list (pages of a shared
    /// namespace too: the tenant that released one last is charged for
    /// keeping it); otherwise the same as `free_counting`.
    pub fn free_counting_by<P: PageId>(
        &mut self,
        tenant: TenantId,
        pages: &[P],
        scope: Option<Scope>,
    ) -> KvResult<usize> {
        let list = self.cache.list_of(tenant);
        self.release(pages, scope, list)
    }

    #[inline]
    fn release<P: PageId>(
        &mut self,
        pages: &[P],
        scope: Option<Scope>,
        list: List,
    ) -> KvResult<usize> {
        debug_assert!(list != SHARED_LIST || !self.cache.partitioned());
        let mut counted = 0;
        let mut to_park = 0usize;
        let free_len = self.free.len();
        let shared = self.shared;
        for (i, &page) in pages.iter().enumerate().rev() {
            let id = match self.check_held(page.to_i64()) {
                Ok(id) => id,
                Err(e) => {
                    // Undo the references already dropped by this call.
                    for &done in &pages[i + 1..] {
                        let d = done.to_i64() as usize;
                        self.refcount[d] += 1;
                        if self.cache.is_parked(d as u32) {
                            self.cache.unpark(d as u32);
                        }
                    }
                    self.free.truncate(free_len);
                    self.shared = shared;
                    return Err(e);
                }
            };
            let rc = &mut self.refcount[id];
            if *rc >= 2 && scope.is_some() && self.cache.scope(id as u32) == scope {
                counted += 1;
            }
            *rc -= 1;
            match *rc {
                0 if self.cache.is_cached(id as u32) => to_park += 1,
                0 => self.free.push(id as u32),
                1 => self.shared -= 1,
                _ => {}
            }
        }
        if to_park > 0 {
            // Cached pages left without a reference become evictable, newest
            // last released: in the order of the pass above, as one run.
            self.cache.park_released(pages, &self.refcount, list);
        }
        Ok(counted)
    }

    /// Add one reference to each listed page: an allocated page, or an
    /// evictable cached one (a cache hit takes it off the evictable list).
    /// All or nothing.
    pub fn retain<P: PageId>(&mut self, pages: &[P]) -> KvResult<()> {
        for &page in pages {
            let p = page.to_i64();
            if !(p > 0 && p < self.refcount.len() as i64 && self.cache.is_parked(p as u32)) {
                self.check_held(p)?;
            }
        }
        // Cache hits come back off the evictable list first, a run at a time.
        self.cache.unpark_all(pages);
        for &page in pages {
            let id = page.to_i64() as usize;
            let rc = &mut self.refcount[id];
            *rc += 1;
            if *rc == 2 {
                self.shared += 1;
            }
        }
        Ok(())
    }

    /// `retain` for pages the prefix cache names (the hits of a lookup), which
    /// are valid ids by construction: one check that each is cached, then one
    /// pass. All or nothing.
    pub fn retain_cached(&mut self, pages: &[u32]) -> KvResult<()> {
        if let Some(&p) = pages.iter().find(|&&p| !self.cache.is_cached(p)) {
            return Err(KvError::InvalidPage {
                page: p as i64,
                why: "not a cached page",
            });
        }
        self.cache.unpark_all(pages);
        for &page in pages {
            let rc = &mut self.refcount[page as usize];
            *rc += 1;
            if *rc == 2 {
                self.shared += 1;
            }
        }
        Ok(())
    }

    fn check_held(&self, page: i64) -> KvResult<usize> {
        if page == NULL_PAGE as i64 {
            return Err(KvError::InvalidPage {
                page,
                why: "the null page is never allocated or freed",
            });
        }
        if page < 0 || page >= self.refcount.len() as i64 {
            return Err(KvError::InvalidPage {
                page,
                why: "out of range",
            });
        }
        if self.refcount[page as usize] == 0 {
            return Err(KvError::InvalidPage {
                page,
                why: "not allocated (double free?)",
            });
        }
        Ok(page as usize)
    }

    /// Full consistency check, for tests: every page is free, referenced or
    /// evictable (exactly one), the free list has no duplicates, the shared
    /// count matches, the prefix cache agrees.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut on_free_list = vec![false; self.refcount.len()];
        for &p in &self.free {
            let p = p as usize;
            if p == 0 || p >= self.refcount.len() {
                return Err(format!("free list holds invalid page {p}"));
            }
            if on_free_list[p] {
                return Err(format!("page {p} is on the free list twice"));
            }
            if self.refcount[p] != 0 {
                return Err(format!("free page {p} has refcount {}", self.refcount[p]));
            }
            if self.cache.is_cached(p as u32) {
                return Err(format!("free page {p} is still named by the prefix cache"));
            }
            on_free_list[p] = true;
        }
        for (p, &rc) in self.refcount.iter().enumerate().skip(1) {
            if rc == 0 && !on_free_list[p] && !self.cache.is_parked(p as u32) {
                return Err(format!(
                    "page {p} is neither free, referenced nor evictable (leaked)"
                ));
            }
        }
        self.cache.check_invariants(&self.refcount)?;
        if self.refcount[0] != 0 {
            return Err("the null page has references".into());
        }
        let shared = self.refcount.iter().filter(|&&rc| rc >= 2).count();
        if shared != self.shared {
            return Err(format!("shared count {} != actual {shared}", self.shared));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
