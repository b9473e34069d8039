//! KV pages of requests: prefix lookup and sharing, growing and dropping pages.

use super::*;

/// Find the longest cached prefix of `tokens`: for each full block, in order
/// and at most `max_blocks`, its key (chained from `root`) and the page the
/// cache holds for it, until the first miss. Appends to `pages` and `keys`.
#[allow(clippy::too_many_arguments)]
pub(super) fn lookup_prefix(
    pool: &BlockPool,
    hasher: &PrefixHasher,
    block_size: usize,
    root: BlockKey,
    tokens: &[i32],
    max_blocks: usize,
    pages: &mut Vec<u32>,
    keys: &mut Vec<BlockKey>,
) {
    let mut parent = root;
    for block in tokens.chunks_exact(block_size).take(max_blocks) {
        let key = hasher.block(parent, block);
        let Some(page) = pool.cache().lookup(key) else {
            return;
        };
        pages.push(page);
        keys.push(key);
        parent = key;
    }
}

impl Scheduler {
    /// Drop a request's references on `pages` (last to first), keeping the
    /// tenant's shared-page count exact.
    pub(super) fn drop_pages(&mut self, tid: TenantId, pages: &[u32]) {
        if self.hasher.is_some() && matches!(self.config.admission, AdmissionMode::Reserve) {
            let dropped = pages
                .iter()
                .filter(|&&p| {
                    self.pool.refcount(p) >= 2
                        && self.pool.cache().scope(p) == Some(Scope::Tenant(tid))
                })
                .count();
            if dropped > 0 {
                self.tenants.share(tid, 0, dropped);
            }
        }
        self.pool
            .free(pages)
            .expect("a request's pages are allocated and its own");
    }

    /// Over-committed, a request shares the cached prefix of its tokens when it
    /// is about to enter the running set (first entry, or back after a
    /// preemption: its own blocks, released tail first, are likely still
    /// cached), so only the rest is computed.
    pub(super) fn acquire_prefix(&mut self, slab: usize) {
        let Some(hasher) = &self.hasher else { return };
        let bs = self.config.block_size;
        let r = self.slab[slab].as_mut().expect("live slab entry");
        debug_assert!(r.pages.is_empty() && r.num_computed == 0);
        let limit = r.tokens.len().saturating_sub(1) / bs;
        let mut pages = Vec::new();
        let mut parent = r.namespace.root;
        for b in 0..limit {
            // Keys named before a preemption are still right: they follow content.
            let key = match r.block_keys.get(b) {
                Some(&k) => k,
                None => {
                    let k = hasher.block(parent, &r.tokens[b * bs..(b + 1) * bs]);
                    r.block_keys.push(k);
                    k
                }
            };
            match self.pool.cache().lookup(key) {
                Some(p) => pages.push(p),
                None => break,
            }
            parent = key;
        }
        r.block_keys.truncate(pages.len());
        let tid = r.tenant;
        // No admission credit for sharing here: over-committed, a preemption
        // would take it back and push the promise past the pool.
        self.pool.retain(&pages).expect("cached pages");
        self.tenants.get_mut(tid).used_blocks += pages.len();
        let r = self.req_mut(slab);
        r.num_computed = pages.len() * bs;
        r.pages = pages;
    }

    /// Undo `acquire_prefix` for a request that did not enter after all.
    pub(super) fn release_prefix(&mut self, slab: usize) {
        let r = self.req_mut(slab);
        if r.pages.is_empty() {
            return;
        }
        let pages = std::mem::take(&mut r.pages);
        r.num_computed = 0;
        let tid = r.tenant;
        self.drop_pages(tid, &pages);
        self.tenants.get_mut(tid).used_blocks -= pages.len();
    }

    /// Over-committed, hit rates count a request's lookup when it first enters.
    pub(super) fn count_first_lookup(&mut self, slab: usize) {
        let bs = self.config.block_size;
        let r = self.req_mut(slab);
        r.cached_tokens = r.num_computed;
        let (tid, prompt_len, hit) = (r.tenant, r.prompt_len, r.num_computed);
        let m = &mut self.tenants.get_mut(tid).metrics;
        m.prefix_query_blocks += (prompt_len.saturating_sub(1) / bs) as u64;
        m.prefix_hit_blocks += (hit / bs) as u64;
        m.prefix_query_tokens += prompt_len as u64;
        m.prefix_hit_tokens += hit as u64;
    }

    /// Pages so that `slab` covers `len` tokens.
    pub(super) fn grow_pages(&mut self, slab: usize, len: usize) -> KvResult<()> {
        let r = self.slab[slab].as_mut().expect("live slab entry");
        let need = self.pool.blocks_for(len).saturating_sub(r.pages.len());
        if need == 0 {
            return Ok(());
        }
        if matches!(self.config.admission, AdmissionMode::Reserve)
            && r.pages.len() + need > r.reserved_blocks
        {
            return Err(KvError::Internal(format!(
                "request {} would exceed its reservation",
                r.id
            )));
        }
        self.pool
            .allocate_into(need, &mut r.pages)
            .map_err(|e| KvError::Internal(format!("a page the plan counted on is gone: {e}")))?;
        self.tenants.get_mut(r.tenant).used_blocks += need;
        Ok(())
    }
}
