//! Paged KV accounting: which physical blocks hold which sequence's pages on which layer.
//!
//! [`KvManager`] ties the [`pool::BlockPool`], the per-sequence [`table::BlockTable`]s and the
//! [`prefix::PrefixCache`] together behind the verbs the scheduler uses. The KV tensors themselves
//! belong to Python (prefill) and the megakernel (decode); this module only hands out block ids,
//! so it is plain Rust, tested with `cargo test kv`.
//!
//! Lifecycle of a sequence: `admit` (attaches the longest cached prefix) → `grow` once per prefill
//! chunk and once per decode step, before the K/V of the new positions is written → `publish`
//! after prefill (or before preempting it) so later prompts can reuse its pages → `release`.

mod check;
pub mod error;
pub mod geometry;
pub mod pool;
pub mod prefix;
pub mod table;

#[cfg(test)]
mod proptests;

use std::collections::HashMap;

/// Tokens per KV page (`MK_PAGE_SIZE` in cuda/abi.h, checked by the ABI probe test).
pub const PAGE_SIZE: usize = 64;

pub use error::KvError;
pub use geometry::KvGeometry;
pub use pool::{blocks_for_budget, bytes_per_block, BlockId, BlockPool};
pub use prefix::PrefixCache;
pub use table::{BlockTable, UNMAPPED};

/// The scheduler's name for a sequence.
pub type SeqId = u64;

/// Shape and size of the KV cache of one model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvConfig {
    /// One entry per layer: true for sliding-window layers, false for full-attention ones.
    pub sliding: Vec<bool>,
    /// Keys a sliding layer keeps, the current token included (4096 for North Mini Code). Widen it
    /// by the attention kernel's tile slack if that kernel reads whole tiles behind the window.
    pub window: usize,
    /// Tokens per page; the megakernel needs 64.
    pub page_size: usize,
    /// Physical blocks in the arena (see [`blocks_for_budget`]).
    pub num_blocks: usize,
    /// Mixed into every prefix key so caches of different models (or weights) never match.
    pub salt: Vec<u8>,
}

impl KvConfig {
    /// `num_layers` layers where layer l is full iff `l % full_every == 0` (North Mini Code: 49
    /// layers, every 4th full) and the rest slide; 64-token pages.
    pub fn periodic(num_layers: usize, full_every: usize, window: usize, num_blocks: usize, salt: &[u8]) -> Self {
        let full_every = full_every.max(1);
        Self {
            sliding: (0..num_layers).map(|l| l % full_every != 0).collect(),
            window,
            page_size: 64,
            num_blocks,
            salt: salt.to_vec(),
        }
    }
}

/// A snapshot of the cache's occupancy and prefix-cache effectiveness.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvStats {
    pub total_blocks: usize,
    /// Blocks on the free list (cached-free ones included).
    pub free_blocks: usize,
    /// Blocks carrying a prefix key, live or free.
    pub cached_blocks: usize,
    /// Free blocks still attachable through the prefix cache.
    pub cached_free_blocks: usize,
    /// Cached pages (prefix-cache entries).
    pub cached_pages: usize,
    pub sequences: usize,
    /// Prompts looked up at admission, and the tokens they held.
    pub lookups: u64,
    pub lookup_tokens: u64,
    /// Lookups that attached at least one page, and the tokens attached.
    pub hits: u64,
    pub hit_tokens: u64,
    /// Cached blocks handed out again (their page forgotten).
    pub evictions: u64,
}

/// Pool + tables + prefix cache, with the scheduler's verbs. Every verb either succeeds or leaves
/// the state as it was.
#[derive(Debug, Clone)]
pub struct KvManager {
    geom: KvGeometry,
    pool: BlockPool,
    prefix: PrefixCache,
    seqs: HashMap<SeqId, BlockTable>,
    lookup_tokens: u64,
}

impl KvManager {
    pub fn new(config: KvConfig) -> Result<Self, KvError> {
        let geom = KvGeometry::new(config.page_size, config.window, config.sliding)?;
        let pool = BlockPool::new(config.num_blocks)?;
        let prefix = PrefixCache::new(&config.salt, geom.num_layers());
        Ok(Self { geom, pool, prefix, seqs: HashMap::new(), lookup_tokens: 0 })
    }

    pub fn geometry(&self) -> &KvGeometry {
        &self.geom
    }

    /// Read-only view of the pool (refcounts, tags, free-list order) for diagnostics and tests.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn prefix_cache(&self) -> &PrefixCache {
        &self.prefix
    }

    /// Registers `seq` and attaches the longest cached prefix of `prompt`. Returns the tokens
    /// attached (a multiple of the page size, always less than `prompt.len()`): the caller
    /// prefills from there. Never allocates, so never runs out of blocks.
    pub fn admit(&mut self, seq: SeqId, prompt: &[u32]) -> Result<usize, KvError> {
        if self.seqs.contains_key(&seq) {
            return Err(KvError::DuplicateSequence(seq));
        }
        let attached = self.prefix.attach_longest(&mut self.pool, &self.geom, prompt)?;
        let table = BlockTable::attached(&self.geom, attached.pages, attached.rows);
        let len = table.len();
        self.seqs.insert(seq, table);
        self.lookup_tokens += prompt.len() as u64;
        Ok(len)
    }

    /// Tokens of `prompt` that `admit` would attach now.
    pub fn cached_len(&self, prompt: &[u32]) -> usize {
        self.prefix.peek(&self.geom, prompt)
    }

    /// Maps pages for positions [len, new_len) on every layer, about to be computed (one decode
    /// step, or one prefill chunk). Sliding layers first let go of pages that the earliest new
    /// query (at `len`) can no longer see. Fails with `OutOfBlocks`, changing nothing, when the
    /// free list (plus what the release frees) cannot cover the new pages. Returns whether the
    /// table's mapping changed (the GPU copy of its rows needs refreshing).
    pub fn grow(&mut self, seq: SeqId, new_len: usize) -> Result<bool, KvError> {
        let Self { geom, pool, prefix, seqs, .. } = self;
        let table = seqs.get_mut(&seq).ok_or(KvError::UnknownSequence(seq))?;
        let len = table.len();
        if new_len < len {
            return Err(KvError::Shrink { seq, len, new_len });
        }
        // Nothing new: the pages out of the window of a query at `len` are not out of reach yet
        // (launch-ahead grows a row before its step lands, and the fallback asks again).
        if new_len == len {
            return Ok(false);
        }
        if table.extend_in_place(geom, new_len) {
            return Ok(false);
        }
        let keep = geom.keep_from(len);
        let needed = table.pages_to_map(geom, new_len);
        if needed > pool.free_count() {
            let freed = table.out_of_window(geom, keep).filter(|&b| pool.refcount(b) == Ok(1)).count();
            if needed > pool.free_count() + freed {
                return Err(KvError::OutOfBlocks { needed, free: pool.free_count() + freed });
            }
        }
        let mut changed = needed > 0;
        table.release_out_of_window(geom, keep, |b| {
            changed = true;
            pool.release(b).map(drop)
        })?;
        table.map_through(geom, new_len, |_| {
            let a = pool.allocate()?;
            if let Some(tag) = a.evicted {
                prefix.forget(tag, a.block);
            }
            Ok(a.block)
        })?;
        Ok(changed)
    }

    /// Takes `seq` back to `new_len` tokens after a call mapped more than it kept (a
    /// verification step's rejected draft): pages past the new length go back to the pool.
    /// `new_len` must not be below the first position that call wrote. Returns whether the table's
    /// mapping changed.
    pub fn rewind(&mut self, seq: SeqId, new_len: usize) -> Result<bool, KvError> {
        let Self { geom, pool, seqs, .. } = self;
        let table = seqs.get_mut(&seq).ok_or(KvError::UnknownSequence(seq))?;
        let mapped = geom.pages_for(table.len());
        table.truncate(geom, new_len, |b| pool.release(b).map(drop))?;
        Ok(geom.pages_for(new_len) < mapped)
    }

    /// Frees every block of `seq`, last page first so its prefix pages stay cached longest.
    pub fn release(&mut self, seq: SeqId) -> Result<(), KvError> {
        let table = self.seqs.remove(&seq).ok_or(KvError::UnknownSequence(seq))?;
        for b in table.release_order(&self.geom) {
            self.pool.release(b)?;
        }
        Ok(())
    }

    /// Makes the full pages of `seq` reusable by later prompts. `tokens` must be the sequence's
    /// tokens (prompt, then generated ones) whose K/V is written; pages past the mapped length and
    /// the page of the last token are skipped. Returns the pages that became (more) attachable.
    pub fn publish(&mut self, seq: SeqId, tokens: &[u32]) -> Result<usize, KvError> {
        let table = self.seqs.get(&seq).ok_or(KvError::UnknownSequence(seq))?;
        self.prefix.publish(&mut self.pool, &self.geom, tokens, table)
    }

    /// Blocks that can be handed out now (cached-free ones included).
    pub fn free_blocks(&self) -> usize {
        self.pool.free_count()
    }

    pub fn total_blocks(&self) -> usize {
        self.pool.len()
    }

    /// Blocks one sequence of `len` tokens holds at most while decoding.
    pub fn blocks_needed(&self, len: usize) -> usize {
        self.geom.blocks_needed(len)
    }

    /// Peak blocks while prefilling `len` tokens in chunks of `chunk` (0: one chunk).
    pub fn prefill_blocks_needed(&self, len: usize, chunk: usize) -> usize {
        self.geom.prefill_blocks_needed(len, chunk)
    }

    /// Whether a `prompt_len`-token prompt can be prefilled in chunks of `chunk` from the free
    /// blocks now (conservative: cache hits would need fewer).
    pub fn can_admit(&self, prompt_len: usize, chunk: usize) -> bool {
        self.prefill_blocks_needed(prompt_len, chunk) <= self.free_blocks()
    }

    /// Whether a sequence of `len` tokens could ever fit the arena (reject it at submit if not).
    pub fn fits(&self, len: usize) -> bool {
        self.blocks_needed(len) <= self.total_blocks()
    }

    /// Tokens mapped for `seq`.
    pub fn len(&self, seq: SeqId) -> Result<usize, KvError> {
        self.seqs.get(&seq).map(BlockTable::len).ok_or(KvError::UnknownSequence(seq))
    }

    /// Admitted sequences.
    pub fn sequences(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    pub fn block_table(&self, seq: SeqId) -> Result<&BlockTable, KvError> {
        self.seqs.get(&seq).ok_or(KvError::UnknownSequence(seq))
    }

    /// Layer `layer`'s row of `seq` (one `i32` per page through the last mapped one, −1 unmapped).
    pub fn table(&self, seq: SeqId, layer: usize) -> Result<&[i32], KvError> {
        self.block_table(seq)?.row(layer)
    }

    /// Fills the dense `[layer][row][page]` `i32` page table the GPU reads: `rows[r]` is the
    /// sequence in batch row r (None: an empty row, all −1), each row `max_pages` wide.
    pub fn write_page_table(&self, rows: &[Option<SeqId>], max_pages: usize, out: &mut [i32]) -> Result<(), KvError> {
        let expected = self.geom.num_layers() * rows.len() * max_pages;
        if out.len() != expected {
            return Err(KvError::BufferSize { expected, got: out.len() });
        }
        let tables = rows.iter().map(|r| r.map(|s| self.block_table(s)).transpose()).collect::<Result<Vec<_>, _>>()?;
        for l in 0..self.geom.num_layers() {
            for (r, t) in tables.iter().enumerate() {
                let start = (l * rows.len() + r) * max_pages;
                let row_out = &mut out[start..start + max_pages];
                match t {
                    Some(t) => t.write_row(l, row_out)?,
                    None => row_out.fill(UNMAPPED),
                }
            }
        }
        Ok(())
    }

    pub fn stats(&self) -> KvStats {
        let p = self.prefix.stats();
        KvStats {
            total_blocks: self.pool.len(),
            free_blocks: self.pool.free_count(),
            cached_blocks: self.pool.tagged_count(),
            cached_free_blocks: self.pool.cached_free_count(),
            cached_pages: self.prefix.entries(),
            sequences: self.seqs.len(),
            lookups: p.lookups,
            lookup_tokens: self.lookup_tokens,
            hits: p.hits,
            hit_tokens: p.hit_tokens,
            evictions: p.evictions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 3 layers (full, sliding, sliding), pages of 4, window 8.
    fn small(num_blocks: usize) -> KvManager {
        KvManager::new(KvConfig {
            sliding: vec![false, true, true],
            window: 8,
            page_size: 4,
            num_blocks,
            salt: b"test".to_vec(),
        })
        .unwrap()
    }

    fn toks(n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| i * 7 + 1).collect()
    }

    #[test]
    fn config_errors_are_values() {
        let mut c = KvConfig::periodic(49, 4, 4096, 100, b"nmc");
        assert_eq!(c.sliding.iter().filter(|s| !**s).count(), 13);
        assert!(KvManager::new(c.clone()).is_ok());
        c.page_size = 0;
        assert!(matches!(KvManager::new(c), Err(KvError::Config(_))));
    }

    #[test]
    fn admit_grow_release_round_trip() {
        let mut kv = small(30);
        assert_eq!(kv.admit(1, &toks(10)).unwrap(), 0);
        assert_eq!(kv.admit(1, &toks(10)), Err(KvError::DuplicateSequence(1)));
        assert_eq!(kv.grow(1, 10), Ok(true));
        assert_eq!(kv.len(1), Ok(10));
        assert_eq!(kv.free_blocks(), 30 - 9);
        assert_eq!(kv.table(1, 0).unwrap(), &[0, 1, 2]);
        assert!(matches!(kv.table(1, 3), Err(KvError::NoSuchLayer { .. })));
        assert_eq!(kv.grow(1, 9), Err(KvError::Shrink { seq: 1, len: 10, new_len: 9 }));
        assert_eq!(kv.grow(1, 10), Ok(false));
        assert_eq!(kv.grow(1, 12), Ok(false));
        assert_eq!(kv.grow(1, 13), Ok(true));
        kv.check().unwrap();
        kv.release(1).unwrap();
        assert_eq!(kv.release(1), Err(KvError::UnknownSequence(1)));
        assert_eq!(kv.grow(1, 11), Err(KvError::UnknownSequence(1)));
        assert_eq!(kv.free_blocks(), 30);
        kv.check().unwrap();
    }

    #[test]
    fn out_of_blocks_changes_nothing() {
        let mut kv = small(8);
        kv.admit(1, &[]).unwrap();
        kv.grow(1, 8).unwrap(); // 2 pages × 3 layers
        let before = kv.clone();
        assert_eq!(kv.grow(1, 13), Err(KvError::OutOfBlocks { needed: 6, free: 2 }));
        assert_eq!(kv.block_table(1), before.block_table(1));
        assert_eq!((kv.free_blocks(), kv.stats()), (before.free_blocks(), before.stats()));
        kv.check().unwrap();
    }

    #[test]
    fn window_release_makes_room_for_its_own_growth() {
        // 5 blocks: page 0 on 3 layers, then page 1 needs 3 more; sliding layers hold page 0
        // until the query at 11 (window 8 → [4, 11]) stops seeing it.
        let mut kv = small(9);
        kv.admit(1, &[]).unwrap();
        kv.grow(1, 11).unwrap(); // 3 pages × 3 layers: pool exhausted
        assert_eq!(kv.free_blocks(), 0);
        // The step for position 11 frees page 0 on both sliding layers and needs nothing new.
        kv.grow(1, 12).unwrap();
        assert_eq!(kv.free_blocks(), 2);
        assert_eq!(kv.table(1, 1).unwrap(), &[-1, 4, 5]);
        // Position 12 needs page 3 on 3 layers; releasing nothing more (query 12 sees [5, 12]),
        // 2 free: refused.
        assert!(matches!(kv.grow(1, 13), Err(KvError::OutOfBlocks { needed: 3, free: 2 })));
        kv.check().unwrap();
    }

    #[test]
    fn out_of_window_blocks_count_toward_a_grow() {
        // A 16-token chunk fills the pool; the next step needs 3 blocks with none free, but its
        // first query (16, window 8 → [9, 16]) frees pages 0 and 1 on both sliding layers.
        let mut kv = small(12);
        kv.admit(1, &[]).unwrap();
        kv.grow(1, 16).unwrap();
        assert_eq!(kv.free_blocks(), 0);
        kv.grow(1, 17).unwrap();
        assert_eq!(kv.free_blocks(), 1);
        kv.check().unwrap();
    }

    #[test]
    fn prefix_hit_shares_blocks_and_release_keeps_them_cached() {
        let mut kv = small(64);
        let prompt = toks(14);
        kv.admit(1, &prompt).unwrap();
        kv.grow(1, 14).unwrap();
        assert_eq!(kv.publish(1, &prompt).unwrap(), 3);
        // Same prompt: 12 tokens attach; sliding layers only from the page the query at 12 sees
        // (window 8: [5, 12] → page 1).
        assert_eq!(kv.cached_len(&prompt), 12);
        assert_eq!(kv.admit(2, &prompt).unwrap(), 12);
        assert_eq!(kv.table(2, 0).unwrap(), &kv.table(1, 0).unwrap()[..3]);
        assert_eq!(kv.table(2, 1).unwrap()[..1], [-1]);
        assert_eq!(kv.table(2, 1).unwrap()[1..], kv.table(1, 1).unwrap()[1..3]);
        let shared = kv.table(1, 0).unwrap()[0] as BlockId;
        assert_eq!(kv.pool().refcount(shared), Ok(2));
        kv.check().unwrap();
        kv.release(1).unwrap();
        kv.release(2).unwrap();
        assert_eq!(kv.free_blocks(), 64);
        assert_eq!(kv.stats().cached_free_blocks, 9);
        // Still attachable after both are gone.
        assert_eq!(kv.admit(3, &prompt).unwrap(), 12);
        let s = kv.stats();
        assert_eq!((s.lookups, s.hits, s.hit_tokens, s.lookup_tokens), (3, 2, 24, 42));
        kv.release(3).unwrap();
        kv.check().unwrap();
    }

    #[test]
    fn reuse_order_evicts_suffix_pages_first() {
        let mut kv = small(18);
        let prompt = toks(17);
        kv.admit(1, &prompt).unwrap();
        kv.grow(1, 17).unwrap(); // one chunk: 5 pages on all 3 layers, 3 blocks left unused
        assert_eq!(kv.publish(1, &prompt).unwrap(), 4);
        assert_eq!(kv.cached_len(&prompt), 16);
        kv.release(1).unwrap();
        // A stranger needs 3 pages × 3 layers: the 3 never-used blocks, then page 4 (never
        // cached), then page 3: only that page is forgotten.
        kv.admit(2, &[9; 5]).unwrap();
        kv.grow(2, 12).unwrap();
        assert_eq!(kv.stats().evictions, 3);
        assert_eq!(kv.cached_len(&prompt), 12);
        kv.check().unwrap();
    }

    #[test]
    fn dense_page_table_layout() {
        let mut kv = small(30);
        kv.admit(1, &[]).unwrap();
        kv.grow(1, 5).unwrap();
        kv.admit(2, &[]).unwrap();
        kv.grow(2, 1).unwrap();
        let mut out = vec![0; 3 * 3 * 2];
        kv.write_page_table(&[Some(2), None, Some(1)], 2, &mut out).unwrap();
        let t = |s, l| kv.table(s, l).unwrap().to_vec();
        let mut expect = Vec::new();
        for l in 0..3 {
            expect.extend([t(2, l)[0], -1, -1, -1]);
            expect.extend(t(1, l));
        }
        assert_eq!(out, expect);
        assert!(matches!(kv.write_page_table(&[Some(1)], 1, &mut [0; 3]), Err(KvError::RowTooShort { .. })));
        assert!(matches!(kv.write_page_table(&[Some(1)], 2, &mut [0; 5]), Err(KvError::BufferSize { .. })));
        assert!(matches!(kv.write_page_table(&[Some(7)], 2, &mut [0; 6]), Err(KvError::UnknownSequence(7))));
    }

    #[test]
    fn admission_accounting() {
        let kv = KvManager::new(KvConfig::periodic(49, 4, 4096, 13 * 512 + 36 * 65, b"nmc")).unwrap();
        assert!(kv.fits(32768));
        assert!(!kv.fits(32769 + 64));
        assert!(kv.can_admit(4096, 1024));
        assert!(!kv.can_admit(32768, 1024));
        assert!(kv.can_admit(20000, 1024));
    }
}
