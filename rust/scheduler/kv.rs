//! The KV manager: the page pool, the prefix cache's block naming and the
//! admission mode, behind one boundary. The scheduler asks it for a request's
//! pages (grow, drop, share a cached prefix, name the blocks a step filled)
//! and never touches a refcount or a hash itself.
//!
//! The two modes that change how pages behave are decided here, once:
//! - prefix caching off: nothing is named, every lookup misses, and sharing
//!   never happens, so the calls below are no-ops or plain page moves;
//! - the admission mode (`AdmissionMode`): reserved requests may hold cache
//!   hits while they wait and count pages shared within a tenant as admission
//!   room; over-committed ones look their prefix up only when they enter the
//!   running set (nothing could preempt a waiting request to take its pages).
//!
//! What a request's pages cost its tenant (`used_blocks`, shared pages) the
//! scheduler applies from what these calls return (the `impl Scheduler`
//! helpers at the end).

use super::*;
use std::cell::RefCell;

use crate::page::NULL_PAGE;
use crate::pool::{BlockOrigin, CacheKey, NamespaceTag};
use crate::prefix::{BlockChain, NameMemo, TokenWidth};

pub(super) struct KvManager {
    pool: BlockPool,
    /// Names full blocks (None: prefix caching off).
    names: Option<PrefixHasher>,
    admission: AdmissionMode,
    block_size: usize,
    /// `block_size` with the shift its hot loops divide by.
    block: BlockSize,
    /// Scratch: the blocks a commit filled, named, to cache together
    /// (page, key, namespace scope), in plan order.
    named: Vec<(u32, CacheKey, Scope)>,
    /// With KV events on: what routers are told of each of `named` (same
    /// order), its tokens in `named_tokens`.
    named_events: Vec<NamedForEvents>,
    named_tokens: Vec<i32>,
    /// Each tenant's evictable blocks are its own (`CachePartition::Tenant`).
    partitioned: bool,
    /// The names of recently looked-up prompts by their tokens: a prompt
    /// that starts like one just before compares instead of hashing.
    memo: RefCell<NameMemo>,
    /// The model's KV-cache groups; group 0's pages are `Request::pages`,
    /// the others' `Request::groups` (see crate::groups).
    groups: KvGroups,
}

/// What a KV event says of a block named this step besides its key.
#[derive(Clone, Copy, Debug)]
struct NamedForEvents {
    origin: BlockOrigin,
    /// Its tokens' start in `named_tokens`.
    at: usize,
}

/// A prefix lookup's hits beyond group 0's pages: the other groups' tables.
pub(super) type GroupHits = Option<Box<GroupPages>>;

/// What `grow_groups` did: pages released behind the windows (`shared` of
/// them shared with another of the tenant's requests, as `drop_pages`
/// counts), pages added.
#[derive(Clone, Copy, Debug, Default)]
struct Growth {
    released: usize,
    shared: usize,
    added: usize,
}

impl KvManager {
    pub(super) fn new(config: &SchedulerConfig) -> KvResult<Self> {
        let mut pool = BlockPool::with_prefix_cache(
            config.num_blocks,
            config.block_size,
            config.prefix_caching,
        )?;
        let partitioned = config.prefix_caching
            && config.prefix_cache_partition == super::config::CachePartition::Tenant;
        if partitioned {
            pool.partition_by_tenant();
        }
        let names = if config.prefix_caching {
            let key = match config.prefix_cache_key {
                Some(SecretKey(k)) => k,
                None => PrefixHasher::random_key().map_err(KvError::Internal)?,
            };
            // Ids are checked below the vocabulary wherever they enter, so a
            // small one is named in two bytes a token: half the hashing.
            let width = TokenWidth::for_vocab(config.vocab_size);
            Some(PrefixHasher::with_width(&key, width))
        } else {
            None
        };
        Ok(KvManager {
            pool,
            names,
            admission: config.admission,
            block_size: config.block_size,
            block: BlockSize::new(config.block_size),
            named: Vec::new(),
            named_events: Vec::new(),
            named_tokens: Vec::new(),
            partitioned,
            memo: RefCell::default(),
            groups: config.kv_cache_groups.clone(),
        })
    }

    /// Whether the model has more than one KV-cache group.
    #[inline]
    pub(super) fn hybrid(&self) -> bool {
        self.groups.is_hybrid()
    }

    pub(super) fn groups(&self) -> &KvGroups {
        &self.groups
    }

    /// Empty tables for a new request of a hybrid model (None with one group),
    /// for a reservation that assumed steps of at most `chunk` tokens.
    pub(super) fn new_group_pages(&self, chunk: usize) -> GroupHits {
        self.hybrid()
            .then(|| Box::new(GroupPages::new(self.groups.len() - 1, chunk)))
    }

    /// Pages a request of final length `len` reserves over the groups, with
    /// steps of at most `chunk` of its tokens.
    #[inline]
    pub(super) fn reserve_for(&self, len: usize, chunk: usize) -> usize {
        if self.hybrid() {
            self.groups.reserve(len, self.block, chunk)
        } else {
            self.block.blocks_for(len)
        }
    }

    #[inline]
    pub(super) fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Whether prefix caching is on.
    pub(super) fn caching(&self) -> bool {
        self.names.is_some()
    }

    /// Whether admission looks the prompt up and shares its cached prefix at
    /// submit (reserve mode with caching on); over-committed, the lookup waits
    /// for entry (`acquire_prefix`).
    pub(super) fn shares_at_submit(&self) -> bool {
        self.caching() && !self.admission.preempts_for_pages()
    }

    /// Free pages, evictable cached ones included.
    #[inline]
    pub(super) fn available(&self) -> usize {
        self.pool.available()
    }

    #[inline]
    pub(super) fn blocks_for(&self, tokens: usize) -> usize {
        self.pool.blocks_for(tokens)
    }

    /// Forget a removed tenant's evictable cached pages.
    pub(super) fn forget_tenant(&mut self, tid: TenantId) {
        self.pool.forget_tenant(tid);
    }

    /// The namespace a request of `tid` names its blocks in (a fixed one when
    /// caching is off: nothing is named in it).
    pub(super) fn namespace(
        &self,
        tid: TenantId,
        tenant: &crate::tenant::Tenant,
        salt: Option<&[u8]>,
    ) -> Namespace {
        match &self.names {
            Some(h) => h.namespace(
                tid,
                &tenant.config.name,
                tenant.config.prefix_namespace.as_deref(),
                salt,
            ),
            None => Namespace {
                root: 0,
                scope: Scope::Tenant(tid),
            },
        }
    }

    /// A request's naming stream at its namespace `root`, before its first
    /// block (a placeholder that names nothing when caching is off).
    pub(super) fn chain(&self, root: BlockKey) -> BlockChain {
        match &self.names {
            Some(h) => h.chain(root),
            None => BlockChain::default(),
        }
    }

    /// The longest cached prefix of `tokens`, at most `max_blocks` full blocks:
    /// appends the page of each hit to `pages` (empty on entry) until the first
    /// miss. `chain` is the stream at the start of `tokens`; on return it has
    /// absorbed the hits (a miss's block is named, then forgotten). Returns how
    /// many hits are pages that someone references, named in `scope`'s
    /// namespace (0 when `scope` is None), counted while each page is at hand.
    fn match_prefix(
        &self,
        chain: &mut BlockChain,
        tokens: &[i32],
        max_blocks: usize,
        pages: &mut Vec<u32>,
        scope: Option<Scope>,
    ) -> usize {
        debug_assert!(pages.is_empty() && chain.tokens() == 0);
        if self.names.is_none() {
            return 0;
        }
        let cache = self.pool.cache();
        let mut memo = self.memo.borrow_mut();
        // Software-pipelined by one block: the lookup of a block's name is
        // issued before the next block is named, so its loads overlap that
        // work instead of stalling the loop. One block past the first miss is
        // named in vain (the miss itself was named in vain before, too).
        let mut blocks = memo.names(*chain, tokens, self.block_size, max_blocks);
        let Some((mut name, mut after)) = blocks.next() else {
            return 0;
        };
        let mut held = 0;
        loop {
            let found = cache.lookup(CacheKey::new(name));
            let next = blocks.next();
            let Some(p) = found else {
                return held;
            };
            pages.push(p);
            *chain = after;
            if scope.is_some() && self.pool.refcount(p) > 0 && cache.scope(p) == scope {
                held += 1;
            }
            match next {
                Some(n) => (name, after) = n,
                None => return held,
            }
        }
    }

    /// Admission's prefix lookup for a prompt of tenant `tid` (see
    /// `shares_at_submit`; nothing otherwise): the pages of its cached prefix
    /// (all but its last token at most, so there are logits to sample) into
    /// `hits`, and `chain` (at the namespace root on entry) past them. Returns
    /// how many of the hits are pages of the tenant's own namespace that
    /// another of its requests holds: they are shared, so admission does not
    /// charge them twice.
    pub(super) fn lookup_at_submit(
        &self,
        tid: TenantId,
        prompt: &[i32],
        hits: &mut Vec<u32>,
        chain: &mut BlockChain,
        groups: &mut GroupHits,
    ) -> usize {
        if !self.shares_at_submit() {
            return 0;
        }
        let max_blocks = prompt.len().saturating_sub(1) / self.block_size;
        let scope = Some(Scope::Tenant(tid));
        if let Some(g) = groups {
            return self.match_prefix_groups(chain, prompt, max_blocks, hits, g, scope);
        }
        hits.reserve_exact(max_blocks);
        self.match_prefix(chain, prompt, max_blocks, hits, scope)
    }

    /// `match_prefix` for a hybrid model: the longest prefix every group
    /// can resume from. Group 0 (and any other full group) must hold all of
    /// its blocks, a window group the blocks a query right after it reads
    /// (`AttentionKind::visible_from`); the hit is the longest length all
    /// groups accept, at most group 0's own. `pages` receives group 0's hits,
    /// `groups` (empty on entry) the other groups' tables, with the null page
    /// before each one's first block read. Returns how many of all those
    /// pages someone references, named in `scope`'s namespace.
    fn match_prefix_groups(
        &self,
        chain: &mut BlockChain,
        tokens: &[i32],
        max_blocks: usize,
        pages: &mut Vec<u32>,
        groups: &mut GroupPages,
        scope: Option<Scope>,
    ) -> usize {
        debug_assert!(pages.is_empty() && chain.tokens() == 0 && groups.held() == 0);
        if self.names.is_none() {
            return 0;
        }
        let cache = self.pool.cache();
        // Group 0's hits, with each block's name and the stream after it.
        let mut named = Vec::new();
        {
            let mut memo = self.memo.borrow_mut();
            for (name, after) in memo.names(*chain, tokens, self.block_size, max_blocks) {
                match cache.lookup(CacheKey::new(name)) {
                    Some(p) => named.push((name, after, p)),
                    None => break,
                }
            }
        }
        // Per extra group, the page of each of those blocks it holds, and the
        // run of consecutive blocks it holds ending at each.
        let extra = self.groups.extra();
        let found: Vec<Vec<Option<u32>>> = (1..=extra.len())
            .map(|g| {
                named
                    .iter()
                    .map(|&(name, _, _)| cache.lookup(CacheKey::of_group(name, g)))
                    .collect()
            })
            .collect();
        let runs: Vec<Vec<usize>> = found
            .iter()
            .map(|f| {
                let mut run = 0;
                f.iter()
                    .map(|p| {
                        run = if p.is_some() { run + 1 } else { 0 };
                        run
                    })
                    .collect()
            })
            .collect();
        let first_read = |kind: AttentionKind, h: usize| {
            kind.visible_from(h * self.block_size) / self.block_size
        };
        let accepts = |h: usize| {
            h == 0
                || extra
                    .iter()
                    .zip(&runs)
                    .all(|(&kind, run)| run[h - 1] >= h - first_read(kind, h))
        };
        let h = (0..=named.len()).rev().find(|&h| accepts(h)).unwrap_or(0);
        if h == 0 {
            return 0;
        }
        *chain = named[h - 1].1;
        pages.extend(named[..h].iter().map(|&(_, _, p)| p));
        for ((table, from), (&kind, f)) in groups
            .tables
            .iter_mut()
            .zip(&mut groups.live_from)
            .zip(extra.iter().zip(&found))
        {
            *from = first_read(kind, h);
            table.clear();
            table.resize(*from, NULL_PAGE);
            table.extend(
                f[*from..h]
                    .iter()
                    .map(|p| p.expect("within the accepted run")),
            );
        }
        // Only group 0's pages earn admission room (see `drop_pages_counting`).
        let held = |p: u32| self.pool.refcount(p) > 0 && cache.scope(p) == scope;
        if scope.is_none() {
            return 0;
        }
        pages.iter().filter(|&&p| held(p)).count()
    }

    /// Take a reference on each of `hits` (cached pages `lookup_at_submit`
    /// found), and on the other groups' hits.
    pub(super) fn share_hits(&mut self, hits: &[u32], groups: &GroupHits) -> KvResult<()> {
        let not_cached = |e| KvError::Internal(format!("a cache hit is not a cached page: {e}"));
        self.pool.retain_cached(hits).map_err(not_cached)?;
        if let Some(g) = groups {
            let extra: Vec<u32> = g.live_pages().collect();
            self.pool.retain_cached(&extra).map_err(not_cached)?;
        }
        Ok(())
    }

    /// Drop a request of `tid`'s references on `pages` (last to first).
    /// Returns how many of them were shared with another of its requests in
    /// its own namespace (reserve mode only: sharing earns admission room there).
    fn drop_pages(&mut self, tid: TenantId, pages: &[u32]) -> usize {
        self.drop_pages_counting(tid, pages, true)
    }

    /// `drop_pages`, counting the shared pages only when `counted`: pages
    /// of the groups after group 0 never earn admission room (a window group
    /// gives its hits back as its window moves, and then takes pages of its
    /// own, up to what it reserved), so their release changes no credit.
    #[inline]
    fn drop_pages_counting(&mut self, tid: TenantId, pages: &[u32], counted: bool) -> usize {
        let scope = (counted && self.shares_at_submit()).then_some(Scope::Tenant(tid));
        let freed = if self.partitioned {
            self.pool.free_counting_by(tid, pages, scope)
        } else {
            self.pool.free_counting(pages, scope)
        };
        freed.expect("a request's pages are allocated and its own")
    }

    /// Partitioned: free `tid`'s oldest evictable blocks beyond `keep`.
    fn trim_parked(&mut self, tid: TenantId, keep: usize) {
        if self.partitioned {
            self.pool.trim_parked(tid, keep);
        }
    }

    /// Over-committed, a request shares the cached prefix of its tokens when it
    /// is about to enter the running set (first entry, or back after a
    /// preemption: its own blocks, released tail first, are likely still
    /// cached), so only the rest is computed. Returns the pages it took.
    fn acquire_prefix(&mut self, r: &mut Request) -> usize {
        if !self.caching() {
            return 0;
        }
        debug_assert!(r.held_pages() == 0 && r.num_computed == 0);
        let limit = r.tokens.len().saturating_sub(1) / self.block_size;
        let mut pages = Vec::new();
        // Names follow content: the blocks named before a preemption are named
        // alike again, from the root.
        r.chain = self.chain(r.namespace.root);
        match &mut r.groups {
            Some(g) => {
                self.match_prefix_groups(&mut r.chain, &r.tokens, limit, &mut pages, g, None);
                let extra: Vec<u32> = g.live_pages().collect();
                self.pool.retain_cached(&extra).expect("cached pages");
            }
            None => {
                self.match_prefix(&mut r.chain, &r.tokens, limit, &mut pages, None);
            }
        }
        self.pool.retain_cached(&pages).expect("cached pages");
        r.num_computed = pages.len() * self.block_size;
        r.pages = pages;
        r.held_pages()
    }

    /// Pages so that `r` covers `len` tokens; returns how many were added.
    fn grow(&mut self, r: &mut Request, len: usize) -> KvResult<usize> {
        let need = self.pool.blocks_for(len).saturating_sub(r.pages.len());
        if need == 0 {
            return Ok(0);
        }
        // (A model of one group reads none of `groups`: `held_pages` would
        // load a line of the request its growth does not otherwise touch.)
        let held = if self.hybrid() {
            r.held_pages()
        } else {
            r.pages.len()
        };
        if !self.admission.preempts_for_pages() && held + need > r.reserved_blocks {
            return Err(KvError::Internal(format!(
                "request {} would exceed its reservation",
                r.id
            )));
        }
        if r.pages.capacity() < r.pages.len() + need {
            // Room for every page it can ever hold, once, rather than doubling
            // (half of a long request's page list would be slack).
            let most = self.pool.blocks_for(r.prompt_len + r.max_tokens);
            r.pages
                .reserve_exact(need.max(most.saturating_sub(r.pages.len())));
        }
        self.pool
            .allocate_into_for(r.tenant, need, &mut r.pages)
            .map_err(|e| KvError::Internal(format!("a page the plan counted on is gone: {e}")))?;
        Ok(need)
    }

    /// Name the full blocks of `r` that its committed tokens filled since it
    /// last named one, into the step's batch (`register_named` caches them):
    /// each group's page of the block, under the group's key (a window
    /// group's block that already went back is not cached).
    #[inline]
    pub(super) fn name_filled_blocks(&mut self, r: &mut Request) {
        if self.names.is_none() {
            return;
        }
        let (full, _) = self.block.split(r.num_computed);
        let (mut named, _) = self.block.split(r.chain.tokens());
        let events = self.pool.kv_events().is_some();
        // The chain stands at a block's end: its name is the last block's.
        let mut parent = (events && named > 0).then(|| r.chain.name());
        while named < full {
            let start = named * self.block_size;
            let key = r.chain.push(&r.tokens[start..start + self.block_size]);
            self.named
                .push((r.pages[named], CacheKey::new(key), r.namespace.scope));
            let at = self.named_tokens.len();
            let note = |group: usize, named_events: &mut Vec<NamedForEvents>| {
                named_events.push(NamedForEvents {
                    origin: BlockOrigin {
                        parent: parent.map(|p| CacheKey::of_group(p, group).wire()),
                        group: group as u8,
                        tenant: r.tenant,
                        root: r.namespace.root,
                    },
                    at,
                })
            };
            if events {
                note(0, &mut self.named_events);
            }
            if let Some(g) = &r.groups {
                for (i, t) in g.tables.iter().enumerate() {
                    if named >= g.live_from[i] {
                        let k = CacheKey::of_group(key, i + 1);
                        self.named.push((t[named], k, r.namespace.scope));
                        if events {
                            note(i + 1, &mut self.named_events);
                        }
                    }
                }
            }
            if events {
                self.named_tokens
                    .extend_from_slice(&r.tokens[start..start + self.block_size]);
            }
            parent = events.then_some(key);
            named += 1;
        }
    }

    /// Hybrid: the other groups' tables of `r` for a step whose first query
    /// is at `start` and whose last token is `len - 1`: first the blocks no
    /// query from `start` on reads go back to the pool (or its LRU, named),
    /// then each table grows to cover `len` tokens, as group 0's does.
    fn grow_groups(&mut self, r: &mut Request, start: usize, len: usize) -> KvResult<Growth> {
        let Some(g) = r.groups.as_mut() else {
            return Ok(Growth::default());
        };
        let blocks = self.block.blocks_for(len);
        let mut released = Vec::new();
        for (i, &kind) in self.groups.extra().iter().enumerate() {
            let (table, from) = (&mut g.tables[i], &mut g.live_from[i]);
            let keep = (kind.visible_from(start) / self.block_size).min(table.len());
            if keep > *from {
                released.extend_from_slice(&table[*from..keep]);
                table[*from..keep].fill(NULL_PAGE);
                *from = keep;
            }
        }
        let mut growth = Growth {
            released: released.len(),
            shared: if released.is_empty() {
                0
            } else {
                self.drop_pages_counting(r.tenant, &released, false)
            },
            added: 0,
        };
        for (i, &kind) in self.groups.extra().iter().enumerate() {
            let (table, from) = (&mut g.tables[i], &mut g.live_from[i]);
            if table.len() < blocks {
                if *from == table.len() {
                    // Nothing held: the table starts where the group reads.
                    let first = (kind.visible_from(start) / self.block_size).min(blocks);
                    table.resize(first, NULL_PAGE);
                    *from = first;
                }
                let need = blocks - table.len();
                growth.added += need;
                table.reserve_exact(need);
                self.pool
                    .allocate_into_for(r.tenant, need, table)
                    .map_err(|e| {
                        KvError::Internal(format!("a page the plan counted on is gone: {e}"))
                    })?;
            }
        }
        Ok(growth)
    }

    /// Cache the blocks `name_filled_blocks` named this step, in the order
    /// they were named; the first copy of a block stays the cached one. The
    /// index buckets of the whole batch are touched first (one random line
    /// each, likely a miss, and the only line an insert writes in the index):
    /// in a tight loop the misses overlap, so the batch costs a few misses,
    /// not one per block. (Touching each bucket as its block is named instead
    /// measured much slower: the load stalls the hashing that follows it.)
    pub(super) fn register_named(&mut self) {
        if self.named.is_empty() {
            return;
        }
        self.pool
            .cache()
            .prefetch(self.named.iter().map(|&(_, key, _)| key));
        for (i, &(page, key, scope)) in self.named.iter().enumerate() {
            if !self.pool.cache().is_cached(page) && self.pool.register(page, key, scope) {
                if let (Some(n), Some(log)) = (self.named_events.get(i), self.pool.kv_events_mut())
                {
                    let tokens = &self.named_tokens[n.at..n.at + self.block_size];
                    log.stored(page, key.wire(), n.origin, tokens);
                }
            }
        }
        self.named.clear();
        self.named_events.clear();
        self.named_tokens.clear();
    }
}

impl Scheduler {
    /// Record the prefix cache's changes from now on for routers (KV events,
    /// see `pool::events`); nothing when prefix caching is off. The first
    /// batch drained starts with `AllBlocksCleared`.
    pub fn enable_kv_events(&mut self) {
        self.kv.pool.enable_kv_events();
    }

    /// The prefix cache's changes since the last drain as one msgpack batch
    /// in vLLM's KV-event format (None: nothing happened, or events are off).
    pub fn drain_kv_events(&mut self, timestamp: f64, data_parallel_rank: i64) -> Option<Vec<u8>> {
        let (kv, tenants) = (&mut self.kv, &self.tenants);
        let names = kv.names.as_ref()?;
        let log = kv.pool.kv_events_mut()?;
        log.drain(timestamp, data_parallel_rank, &kv.groups, |tid, root| {
            let Some(t) = tenants.try_get(tid) else {
                // Removed since: an opaque id of the namespace.
                return NamespaceTag::Salted(String::new(), root as u64);
            };
            let name = t
                .config
                .prefix_namespace
                .as_deref()
                .unwrap_or(&t.config.name);
            let plain = names.namespace(
                tid,
                &t.config.name,
                t.config.prefix_namespace.as_deref(),
                None,
            );
            if plain.root == root {
                NamespaceTag::Name(name.to_owned())
            } else {
                NamespaceTag::Salted(name.to_owned(), root as u64)
            }
        })
    }

    /// Events waiting to be drained (0 when off) and events lost because
    /// nobody drained them (see `pool::events`).
    pub fn kv_events_pending(&self) -> (usize, u64) {
        self.kv
            .pool
            .kv_events()
            .map_or((0, 0), |l| (l.len(), l.dropped()))
    }

    /// The blocks the prefix cache holds as KV events name them: (group,
    /// hash), one per cached page, in page order.
    pub fn cached_blocks_on_wire(&self) -> Vec<(u8, u64)> {
        self.kv.pool.cached_blocks_on_wire()
    }

    /// Partitioned (`CachePartition::Tenant`): the evictable blocks `tid` may
    /// keep, its unused floor: kv_floor_blocks less what its live requests
    /// reserve (pages its own requests share counted once). The reserve
    /// guarantee holds because they come out of room already promised to it:
    /// with every tenant's parked blocks within this quota, the free list
    /// alone holds every page admission promised and no request holds yet,
    /// so no allocation ever needs another tenant's cached block (see
    /// `check_invariants`). 0 when not partitioned (nothing to keep apart).
    pub(crate) fn cache_quota(&self, tid: TenantId) -> usize {
        let t = self.tenants.get(tid);
        t.config
            .kv_floor_blocks
            .saturating_sub(t.reserved_blocks.saturating_sub(t.shared_blocks))
    }

    /// Partitioned: bring `tid`'s evictable blocks within its quota (its
    /// oldest go first); called wherever its reservations, shared pages or
    /// floor change, or its requests release pages.
    pub(super) fn trim_cache(&mut self, tid: TenantId) {
        if self.kv.partitioned {
            let keep = self.cache_quota(tid);
            self.kv.trim_parked(tid, keep);
        }
    }

    /// Whether each tenant's evictable blocks are its own.
    pub(crate) fn cache_partitioned(&self) -> bool {
        self.kv.partitioned
    }

    /// Give back `pages` of a request of `tid`, with the tenant's usage.
    pub(super) fn drop_pages(&mut self, tid: TenantId, pages: &[u32]) {
        let shared = self.kv.drop_pages(tid, pages);
        self.count_dropped(tid, pages.len(), shared);
    }

    /// The tenant's usage after `n` of its pages went back, `shared` of them
    /// shared with another of its requests.
    fn count_dropped(&mut self, tid: TenantId, n: usize, shared: usize) {
        if shared > 0 {
            self.tenants.share(tid, 0, shared);
        }
        self.tenants.get_mut(tid).drop_pages(n);
    }

    /// Give back every page `slab` holds, in every group (group 0's, then
    /// the others'); its computed KV goes with them. Returns whether it held
    /// any.
    pub(super) fn drop_all_pages(&mut self, slab: usize) -> bool {
        let r = self.requests.get_mut(slab);
        let tid = r.tenant;
        let pages = std::mem::take(&mut r.pages);
        if !self.kv.hybrid() {
            if !pages.is_empty() {
                self.drop_pages(tid, &pages);
            }
            return !pages.is_empty();
        }
        let extra = r
            .groups
            .as_mut()
            .map(|g| g.take_pages())
            .unwrap_or_default();
        if !pages.is_empty() {
            self.drop_pages(tid, &pages);
        }
        if !extra.is_empty() {
            let shared = self.kv.drop_pages_counting(tid, &extra, false);
            self.count_dropped(tid, extra.len(), shared);
        }
        !(pages.is_empty() && extra.is_empty())
    }

    /// `slab` is about to enter the running set. Over-committed, it shares its
    /// cached prefix now (it held no page while it waited); reserved, it got
    /// its hits at submit and keeps its KV across a preemption: nothing to do.
    pub(super) fn prepare_entry(&mut self, slab: usize) {
        if self.kv.admission.preempts_for_pages() && self.requests.get(slab).pages.is_empty() {
            self.acquire_prefix(slab);
        }
    }

    /// `slab` did not enter after all (no room for a chunk): undo `prepare_entry`.
    pub(super) fn abandon_entry(&mut self, slab: usize) {
        if self.kv.admission.preempts_for_pages() {
            self.release_prefix(slab);
        }
    }

    /// `slab` enters: over-committed, with caching on, its first entry is
    /// when its prefix lookup counts (hit rates, `cached_tokens`); reserved,
    /// it counted at submit.
    pub(super) fn count_entry_lookup(&mut self, slab: usize) {
        let r = self.requests.get_mut(slab);
        if !(self.kv.admission.preempts_for_pages()
            && self.kv.caching()
            && r.first_scheduled.is_none())
        {
            return;
        }
        r.cached_tokens = r.num_computed;
        let (tid, prompt_len, hit) = (r.tenant, r.prompt_len, r.num_computed);
        self.tenants
            .get_mut(tid)
            .count_prefix_lookup(prompt_len, hit, self.kv.block_size);
    }

    /// Over-committed entry: `slab` shares its cached prefix (see
    /// `KvManager::acquire_prefix`). No admission credit for sharing here:
    /// over-committed, a preemption would take it back and push the promise
    /// past the pool.
    fn acquire_prefix(&mut self, slab: usize) {
        let r = self.requests.get_mut(slab);
        let taken = self.kv.acquire_prefix(r);
        let tid = r.tenant;
        self.tenants.get_mut(tid).hold_pages(taken);
    }

    /// Undo `acquire_prefix` for a request that did not enter after all.
    fn release_prefix(&mut self, slab: usize) {
        if self.drop_all_pages(slab) {
            self.requests.get_mut(slab).num_computed = 0;
        }
    }

    /// Pages so that `slab` covers `len` tokens, for a step whose first query
    /// is at `start` (a hybrid model's window groups give back what no query
    /// from there reads).
    #[inline]
    pub(super) fn grow_pages(&mut self, slab: usize, start: usize, len: usize) -> KvResult<()> {
        if self.kv.hybrid() {
            self.grow_group_pages(slab, start, len)?;
        }
        let r = self.requests.get_mut(slab);
        let added = self.kv.grow(r, len)?;
        if added > 0 {
            let tid = r.tenant;
            self.tenants.get_mut(tid).hold_pages(added);
        }
        Ok(())
    }

    /// Hybrid: the groups after group 0 of `slab` for a step from `start` to
    /// `len` (see `KvManager::grow_groups`), with the tenant's usage. Out of
    /// line: a model of one group never runs it, and its code would crowd
    /// the decode loop that calls `grow_pages`.
    #[cold]
    #[inline(never)]
    fn grow_group_pages(&mut self, slab: usize, start: usize, len: usize) -> KvResult<()> {
        let r = self.requests.get_mut(slab);
        if self.kv.blocks_for(len) <= r.pages.len() {
            return Ok(());
        }
        let tid = r.tenant;
        let g = self.kv.grow_groups(r, start, len)?;
        if g.released > 0 {
            self.count_dropped(tid, g.released, g.shared);
            self.trim_cache(tid);
        }
        self.tenants.get_mut(tid).hold_pages(g.added);
        Ok(())
    }
}
