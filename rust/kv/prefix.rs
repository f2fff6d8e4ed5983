//! Prefix cache: full pages of token ids, keyed by a content chain, mapped to the blocks that hold
//! their K/V on every layer.
//!
//! key_i = SHA-256(key_{i−1} ‖ page i's token ids as u32 little-endian), key_{−1} = SHA-256 of a
//! per-model salt, so a key names the whole prefix through page i and two models never share.
//! Only full pages strictly before the page of the last token are keyed: the last token is always
//! recomputed, since its logits start decoding. A cryptographic hash because a collision would
//! silently hand one prompt another prompt's KV.
//!
//! An entry holds one block per layer (or none where the block was reused or had already slid out
//! of the window). A block carries the entry's id as its pool tag for as long as the entry points at
//! it; the tag goes only when the pool hands the block out again ([`PrefixCache::forget`]), and an
//! entry with no blocks left is dropped. So a block held by two sequences is always a tagged one.

use std::collections::HashMap;

use sha2::{Digest, Sha256};

use super::geometry::KvGeometry;
use super::pool::{BlockId, BlockPool, Tag};
use super::table::{BlockTable, UNMAPPED};
use super::KvError;

/// Content key of a prefix that ends at a page boundary.
pub type PageKey = [u8; 32];

/// The parent of page 0's key: the salt, domain-separated so no page key can equal it.
pub fn root_key(salt: &[u8]) -> PageKey {
    Sha256::new().chain_update(b"mk/kv/prefix/v1 salt\0").chain_update(salt).finalize().into()
}

/// Key of the prefix `parent` extended by one page of `tokens`.
pub fn chain_key(parent: &PageKey, tokens: &[u32]) -> PageKey {
    let mut h = Sha256::new();
    h.update(parent);
    let mut buf = [0u8; 256];
    for chunk in tokens.chunks(buf.len() / 4) {
        for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..chunk.len() * 4]);
    }
    h.finalize().into()
}

/// Pages of a `len`-token prompt that may be cached: full pages before the last token's page.
pub fn cacheable_pages(len: usize, page: usize) -> usize {
    len.saturating_sub(1) / page
}

/// Keys of the cacheable pages of `tokens`, computed lazily (a lookup stops at the first miss).
pub fn page_keys<'a>(root: &PageKey, tokens: &'a [u32], page: usize) -> impl Iterator<Item = PageKey> + 'a {
    let n = cacheable_pages(tokens.len(), page);
    tokens[..n * page].chunks_exact(page).scan(*root, |key, chunk| {
        *key = chain_key(key, chunk);
        Some(*key)
    })
}

/// Blocks attached for a new sequence: `pages` full pages, and per layer its table row
/// (sliding layers −1 below the window that the first recomputed token needs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attached {
    pub pages: usize,
    pub rows: Vec<Vec<i32>>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Prompts looked up.
    pub lookups: u64,
    /// Lookups that attached at least one page.
    pub hits: u64,
    /// Tokens attached instead of recomputed.
    pub hit_tokens: u64,
    /// Cached blocks handed out again (their page forgotten).
    pub evictions: u64,
}

#[derive(Debug, Clone)]
struct Entry {
    key: PageKey,
    blocks: Vec<i32>,
    count: usize,
}

impl Entry {
    fn full_ok(&self, geom: &KvGeometry) -> bool {
        self.blocks.iter().enumerate().all(|(l, &b)| geom.is_sliding(l) || b != UNMAPPED)
    }

    fn sliding_ok(&self, geom: &KvGeometry) -> bool {
        self.blocks.iter().enumerate().all(|(l, &b)| !geom.is_sliding(l) || b != UNMAPPED)
    }
}

#[derive(Debug, Clone)]
pub struct PrefixCache {
    root: PageKey,
    num_layers: usize,
    index: HashMap<PageKey, Tag>,
    entries: Vec<Option<Entry>>,
    vacant: Vec<Tag>,
    stats: PrefixStats,
}

impl PrefixCache {
    pub fn new(salt: &[u8], num_layers: usize) -> Self {
        Self {
            root: root_key(salt),
            num_layers,
            index: HashMap::new(),
            entries: Vec::new(),
            vacant: Vec::new(),
            stats: PrefixStats::default(),
        }
    }

    pub fn root(&self) -> &PageKey {
        &self.root
    }

    pub fn stats(&self) -> PrefixStats {
        self.stats
    }

    /// Cached pages (entries with at least one block).
    pub fn entries(&self) -> usize {
        self.index.len()
    }

    /// Whether `key` is cached, with its per-layer blocks (−1 where gone).
    pub fn get(&self, key: &PageKey) -> Option<&[i32]> {
        self.index.get(key).and_then(|&id| self.entries[id as usize].as_ref()).map(|e| e.blocks.as_slice())
    }

    /// The longest attachable prefix of `tokens`: entry ids of its pages. A prefix of n pages is
    /// attachable when every page has all its full-layer blocks and, on sliding layers, the pages
    /// the first recomputed query (position n·page) can see are present; older ones may be gone.
    fn longest(&self, geom: &KvGeometry, tokens: &[u32]) -> Vec<Tag> {
        let mut ids = Vec::new();
        for key in page_keys(&self.root, tokens, geom.page()) {
            match self.index.get(&key) {
                Some(&id) if self.entries[id as usize].as_ref().is_some_and(|e| e.full_ok(geom)) => ids.push(id),
                _ => break,
            }
        }
        let (mut best, mut last_gap) = (0, None);
        for n in 1..=ids.len() {
            if !self.entries[ids[n - 1] as usize].as_ref().is_some_and(|e| e.sliding_ok(geom)) {
                last_gap = Some(n - 1);
            }
            if last_gap.is_none_or(|gap| gap < geom.keep_from(n * geom.page())) {
                best = n;
            }
        }
        ids.truncate(best);
        ids
    }

    /// Tokens of `tokens` that `attach_longest` would attach now, without attaching them.
    pub fn peek(&self, geom: &KvGeometry, tokens: &[u32]) -> usize {
        self.longest(geom, tokens).len() * geom.page()
    }

    /// Attaches the longest cached prefix of `tokens`: retains its blocks (taking cached-free
    /// ones off the free list) and returns the rows of the new sequence's table.
    pub fn attach_longest(
        &mut self,
        pool: &mut BlockPool,
        geom: &KvGeometry,
        tokens: &[u32],
    ) -> Result<Attached, KvError> {
        let ids = self.longest(geom, tokens);
        let pages = ids.len();
        let keep = geom.keep_from(pages * geom.page());
        let mut rows = vec![Vec::with_capacity(pages); self.num_layers];
        for (j, &id) in ids.iter().enumerate() {
            let Some(entry) = self.entries[id as usize].as_ref() else { continue };
            for (l, row) in rows.iter_mut().enumerate() {
                let b = if geom.is_sliding(l) && j < keep { UNMAPPED } else { entry.blocks[l] };
                if b != UNMAPPED {
                    pool.retain(b as BlockId)?;
                }
                row.push(b);
            }
        }
        self.stats.lookups += 1;
        if pages > 0 {
            self.stats.hits += 1;
            self.stats.hit_tokens += (pages * geom.page()) as u64;
        }
        Ok(Attached { pages, rows })
    }

    /// Records the cacheable full pages of a sequence whose K/V for `tokens` is written: new pages
    /// get an entry, known pages get blocks for the layers they lack (one that was reused, or had
    /// slid out of the window when first published). Blocks that already carry a key stay as they
    /// are. Returns the pages that gained blocks.
    pub fn publish(
        &mut self,
        pool: &mut BlockPool,
        geom: &KvGeometry,
        tokens: &[u32],
        table: &BlockTable,
    ) -> Result<usize, KvError> {
        let n = table.len() / geom.page();
        let mut recorded = 0;
        let root = self.root;
        for (j, key) in page_keys(&root, tokens, geom.page()).take(n).enumerate() {
            let id = match self.index.get(&key) {
                Some(&id) => id,
                None => self.insert(key),
            };
            let Some(entry) = self.entries[id as usize].as_mut() else { continue };
            let mut added = false;
            for l in 0..self.num_layers {
                let Some(b) = table.block(l, j) else { continue };
                if entry.blocks[l] == UNMAPPED && pool.tag(b).is_none() {
                    pool.set_tag(b, id)?;
                    entry.blocks[l] = b as i32;
                    entry.count += 1;
                    added = true;
                }
            }
            if entry.count == 0 {
                self.remove(id);
            }
            recorded += usize::from(added);
        }
        Ok(recorded)
    }

    /// The pool handed out `block`, which carried `tag`: its page is no longer there.
    pub fn forget(&mut self, tag: Tag, block: BlockId) {
        let Some(entry) = self.entries.get_mut(tag as usize).and_then(Option::as_mut) else { return };
        if let Some(slot) = entry.blocks.iter_mut().find(|b| **b == block as i32) {
            *slot = UNMAPPED;
            entry.count -= 1;
            self.stats.evictions += 1;
        }
        if entry.count == 0 {
            self.remove(tag);
        }
    }

    fn insert(&mut self, key: PageKey) -> Tag {
        let entry = Entry { key, blocks: vec![UNMAPPED; self.num_layers], count: 0 };
        let id = match self.vacant.pop() {
            Some(id) => {
                self.entries[id as usize] = Some(entry);
                id
            }
            None => {
                self.entries.push(Some(entry));
                (self.entries.len() - 1) as Tag
            }
        };
        self.index.insert(key, id);
        id
    }

    fn remove(&mut self, id: Tag) {
        if let Some(entry) = self.entries[id as usize].take() {
            self.index.remove(&entry.key);
            self.vacant.push(id);
        }
    }

    /// Tags and entries agree: every tagged block sits in exactly one slot of the entry its tag
    /// names, every slot's block carries that tag, and the index names live, non-empty entries.
    pub fn check(&self, pool: &BlockPool) -> Result<(), String> {
        for b in 0..pool.len() as BlockId {
            let Some(tag) = pool.tag(b) else { continue };
            let Some(entry) = self.entries.get(tag as usize).and_then(Option::as_ref) else {
                return Err(format!("block {b} tagged with missing entry {tag}"));
            };
            if entry.blocks.iter().filter(|&&x| x == b as i32).count() != 1 {
                return Err(format!("block {b} is not in exactly one slot of entry {tag}"));
            }
        }
        let mut live = 0;
        for (id, entry) in self.entries.iter().enumerate() {
            let Some(entry) = entry else { continue };
            live += 1;
            let mapped: Vec<_> = entry.blocks.iter().filter(|&&b| b != UNMAPPED).collect();
            if mapped.len() != entry.count || entry.count == 0 {
                return Err(format!("entry {id}: count {} but {} blocks", entry.count, mapped.len()));
            }
            if let Some(&&b) = mapped.iter().find(|&&&b| pool.tag(b as BlockId) != Some(id as Tag)) {
                return Err(format!("entry {id} holds block {b}, which does not carry its tag"));
            }
            if self.index.get(&entry.key) != Some(&(id as Tag)) {
                return Err(format!("entry {id} is not indexed under its key"));
            }
        }
        if live != self.index.len() {
            return Err(format!("{} index keys for {live} entries", self.index.len()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: usize = 4;

    fn geom(window: usize, sliding: Vec<bool>) -> KvGeometry {
        KvGeometry::new(P, window, sliding).unwrap()
    }

    /// A table of `len` tokens built from fresh pool blocks (no window release: window large).
    fn written(pool: &mut BlockPool, g: &KvGeometry, len: usize) -> BlockTable {
        let mut t = BlockTable::new(g.num_layers());
        t.release_out_of_window(g, g.keep_from(0), |_| Ok(())).unwrap();
        t.map_through(g, len, |_| Ok(pool.allocate()?.block)).unwrap();
        t
    }

    #[test]
    fn keys_chain_over_whole_prefixes() {
        let root = root_key(b"m");
        let a: Vec<u32> = (0..9).collect();
        let keys: Vec<_> = page_keys(&root, &a, P).collect();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[0], chain_key(&root, &a[0..4]));
        assert_eq!(keys[1], chain_key(&keys[0], &a[4..8]));
        // Same second page after a different first page: a different key.
        let mut b = a.clone();
        b[0] = 99;
        let kb: Vec<_> = page_keys(&root, &b, P).collect();
        assert_ne!(kb[0], keys[0]);
        assert_ne!(kb[1], keys[1]);
        // Token ids are hashed as 4-byte values, not concatenated digits.
        assert_ne!(chain_key(&root, &[1, 23]), chain_key(&root, &[12, 3]));
        assert_ne!(chain_key(&root, &[]), root);
    }

    #[test]
    fn the_last_tokens_page_is_never_keyed() {
        let root = root_key(b"m");
        let t: Vec<u32> = (0..64).collect();
        for (len, pages) in [(0, 0), (1, 0), (4, 0), (5, 1), (8, 1), (9, 2)] {
            assert_eq!(cacheable_pages(len, P), pages);
            assert_eq!(page_keys(&root, &t[..len], P).count(), pages, "len {len}");
        }
        assert_eq!(cacheable_pages(64, 64), 0);
        assert_eq!(cacheable_pages(65, 64), 1);
    }

    #[test]
    fn salts_separate_models() {
        let t: Vec<u32> = (0..9).collect();
        let a: Vec<_> = page_keys(&root_key(b"model-a"), &t, P).collect();
        let b: Vec<_> = page_keys(&root_key(b"model-b"), &t, P).collect();
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));

        let g = geom(100, vec![false]);
        let mut pool = BlockPool::new(8).unwrap();
        let mut ca = PrefixCache::new(b"model-a", 1);
        let cb = PrefixCache::new(b"model-b", 1);
        let table = written(&mut pool, &g, 9);
        assert_eq!(ca.publish(&mut pool, &g, &t, &table).unwrap(), 2);
        assert_eq!(ca.peek(&g, &t), 8);
        assert_eq!(cb.peek(&g, &t), 0);
    }

    #[test]
    fn attach_retains_and_counts() {
        let g = geom(100, vec![false, true]);
        let mut pool = BlockPool::new(16).unwrap();
        let mut cache = PrefixCache::new(b"m", 2);
        let t: Vec<u32> = (0..13).collect();
        let table = written(&mut pool, &g, 13);
        assert_eq!(cache.publish(&mut pool, &g, &t, &table).unwrap(), 3);
        // Publishing again records nothing new.
        assert_eq!(cache.publish(&mut pool, &g, &t, &table).unwrap(), 0);
        assert_eq!((cache.entries(), pool.tagged_count()), (3, 6));
        cache.check(&pool).unwrap();

        // Same prompt: 3 pages (12 tokens; token 12 is recomputed).
        let a = cache.attach_longest(&mut pool, &g, &t).unwrap();
        assert_eq!(a.pages, 3);
        assert_eq!(a.rows[0], table.row(0).unwrap()[..3]);
        assert_eq!(pool.refcount(table.block(0, 0).unwrap()), Ok(2));
        // A prompt ending at the page edge recomputes its last page.
        assert_eq!(cache.attach_longest(&mut pool, &g, &t[..12]).unwrap().pages, 2);
        // A prompt diverging in page 1 attaches page 0 only.
        let mut d = t.clone();
        d[5] = 1000;
        assert_eq!(cache.attach_longest(&mut pool, &g, &d).unwrap().pages, 1);
        assert_eq!(cache.attach_longest(&mut pool, &g, &[7, 7, 7, 7, 7]).unwrap().pages, 0);
        let s = cache.stats();
        assert_eq!((s.lookups, s.hits, s.hit_tokens), (4, 3, 24));
        cache.check(&pool).unwrap();
    }

    #[test]
    fn reuse_forgets_only_that_layer() {
        let g = geom(100, vec![false, true]);
        let mut pool = BlockPool::new(6).unwrap();
        let mut cache = PrefixCache::new(b"m", 2);
        let t: Vec<u32> = (0..9).collect();
        let table = written(&mut pool, &g, 9);
        cache.publish(&mut pool, &g, &t, &table).unwrap();
        for b in table.release_order(&g).collect::<Vec<_>>() {
            pool.release(b).unwrap();
        }
        assert_eq!(pool.cached_free_count(), 4);
        // Rows are [0, 1, 2] (full) and [3, 4, 5] (sliding); release order is 5, 2, 4, 1, 3, 0, so
        // the untagged page 2 goes first, then page 1's sliding block.
        assert_eq!(pool.allocate().unwrap().evicted, None);
        assert_eq!(pool.allocate().unwrap().evicted, None);
        assert_eq!(pool.allocate().unwrap(), crate::kv::pool::Allocation { block: 4, evicted: Some(1) });
        cache.forget(1, 4);
        let key1 = page_keys(cache.root(), &t, P).nth(1).unwrap();
        assert_eq!(cache.get(&key1), Some(&[1, -1][..]));
        cache.check(&pool).unwrap();
        // Page 1 lost a sliding block the next query needs, so only page 0 attaches.
        assert_eq!(cache.peek(&g, &t), 4);
        // Losing page 1's full block too empties and drops the entry.
        assert_eq!(pool.allocate().unwrap(), crate::kv::pool::Allocation { block: 1, evicted: Some(1) });
        cache.forget(1, 1);
        assert_eq!(cache.entries(), 1);
        assert_eq!(cache.stats().evictions, 2);
        cache.check(&pool).unwrap();
    }

    #[test]
    fn sliding_pages_behind_the_window_may_be_gone() {
        // Window 4 = one page: the query at 8 sees [5, 8], so only page 1 is needed on the
        // sliding layer when attaching 2 pages.
        let g = geom(4, vec![false, true]);
        let mut pool = BlockPool::new(16).unwrap();
        let mut cache = PrefixCache::new(b"m", 2);
        let t: Vec<u32> = (0..9).collect();
        let mut table = BlockTable::new(2);
        table.map_through(&g, 8, |_| Ok(pool.allocate()?.block)).unwrap();
        table.release_out_of_window(&g, g.keep_from(8), |b| pool.release(b).map(drop)).unwrap();
        // Rows: full [0, 1], sliding [2, 3] with page 0 (block 2) slid out.
        assert_eq!(table.row(1).unwrap(), &[-1, 3]);
        assert_eq!(cache.publish(&mut pool, &g, &t, &table).unwrap(), 2);
        let a = cache.attach_longest(&mut pool, &g, &t).unwrap();
        assert_eq!(a.pages, 2);
        assert_eq!(a.rows, [vec![0, 1], vec![-1, 3]]);
        // A 1-page prefix needs page 0 on the sliding layer, which is gone, but the 2-page one
        // is preferred anyway; a prompt that diverges in page 1 gets nothing.
        let mut d = t.clone();
        d[6] = 99;
        assert_eq!(cache.peek(&g, &d), 0);
        // A sequence that still holds page 0 on the sliding layer fills the gap.
        let mut b = BlockTable::new(2);
        b.map_through(&g, 5, |_| Ok(pool.allocate()?.block)).unwrap();
        assert_eq!(cache.publish(&mut pool, &g, &t, &b).unwrap(), 1);
        let key0 = page_keys(cache.root(), &t, P).next().unwrap();
        assert_eq!(cache.get(&key0), Some(&[0, b.block(1, 0).unwrap() as i32][..]));
        assert_eq!(cache.peek(&g, &d), 4);
        cache.check(&pool).unwrap();
    }

    #[test]
    fn publish_stops_at_written_pages() {
        let g = geom(100, vec![false, true]);
        let mut pool = BlockPool::new(16).unwrap();
        let mut cache = PrefixCache::new(b"m", 2);
        let t: Vec<u32> = (0..20).collect();
        // Only 6 tokens are written: one full page can be recorded.
        let short = written(&mut pool, &g, 6);
        assert_eq!(cache.publish(&mut pool, &g, &t, &short).unwrap(), 1);
        assert_eq!(cache.peek(&g, &t), 4);
        // Another sequence that computed the same page keeps its own blocks untagged.
        let other = written(&mut pool, &g, 9);
        assert_eq!(cache.publish(&mut pool, &g, &t, &other).unwrap(), 1);
        assert_eq!(pool.tag(other.block(0, 0).unwrap()), None);
        assert_eq!(cache.peek(&g, &t), 8);
        cache.check(&pool).unwrap();
    }
}
