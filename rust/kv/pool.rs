//! The physical block pool: reference counts and a least-recently-released free list.
//!
//! A block is one layer's page (K and V) of one sequence. A released block keeps its prefix-cache
//! tag, so it stays attachable ("cached-free") until the free list hands it out again; handing it
//! out reports the tag so the prefix cache can forget that block. The free list is intrusive and
//! doubly linked so that attaching a cached-free block takes it out of the middle in O(1).

use super::KvError;

/// Index of a physical block in the KV arena (the same id indexes the K and the V pool).
pub type BlockId = u32;

/// Opaque prefix-cache tag carried by a block (the cache's entry id).
pub type Tag = u32;

const NIL: u32 = u32::MAX;

/// Blocks a KV arena of `bytes` holds (the caller measures free memory and picks the fraction).
pub fn blocks_for_budget(bytes: u64, bytes_per_block: u64) -> usize {
    bytes.checked_div(bytes_per_block).map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX))
}

/// Bytes of one block, K and V: `page` tokens × `kv_heads` × `head_dim` × `elem_bytes`, twice.
/// For North Mini Code in bf16: 2 × 64 × 4 × 128 × 2 = 128 KiB.
pub const fn bytes_per_block(page: u64, kv_heads: u64, head_dim: u64, elem_bytes: u64) -> u64 {
    2 * page * kv_heads * head_dim * elem_bytes
}

/// What `allocate` handed out, and the tag the block lost by being reused (if it was cached).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    pub block: BlockId,
    pub evicted: Option<Tag>,
}

#[derive(Debug, Clone)]
pub struct BlockPool {
    refs: Vec<u32>,
    tags: Vec<Tag>,
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    free: usize,
    tagged: usize,
    cached_free: usize,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks, handed out in id order at first. Ids must fit the
    /// `i32` page tables the GPU reads, so at most `i32::MAX` blocks.
    pub fn new(num_blocks: usize) -> Result<Self, KvError> {
        if num_blocks > i32::MAX as usize {
            return Err(KvError::Config(format!("{num_blocks} blocks do not fit i32 page-table entries")));
        }
        let n = num_blocks as u32;
        let prev = (0..n).map(|b| if b == 0 { NIL } else { b - 1 }).collect();
        let next = (0..n).map(|b| if b + 1 == n { NIL } else { b + 1 }).collect();
        Ok(Self {
            refs: vec![0; num_blocks],
            tags: vec![NIL; num_blocks],
            prev,
            next,
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { n - 1 },
            free: num_blocks,
            tagged: 0,
            cached_free: 0,
        })
    }

    /// Total blocks in the arena.
    pub fn len(&self) -> usize {
        self.refs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.refs.is_empty()
    }

    /// Blocks on the free list, cached-free ones included (they are reusable at any time).
    pub fn free_count(&self) -> usize {
        self.free
    }

    /// Blocks held by at least one table.
    pub fn live_count(&self) -> usize {
        self.len() - self.free
    }

    /// Blocks carrying a prefix-cache tag, live or free.
    pub fn tagged_count(&self) -> usize {
        self.tagged
    }

    /// Free blocks that still carry a tag (attachable until reused).
    pub fn cached_free_count(&self) -> usize {
        self.cached_free
    }

    fn index(&self, block: BlockId) -> Result<usize, KvError> {
        let i = block as usize;
        if i < self.refs.len() {
            Ok(i)
        } else {
            Err(KvError::NoSuchBlock { block, num_blocks: self.refs.len() })
        }
    }

    pub fn refcount(&self, block: BlockId) -> Result<u32, KvError> {
        Ok(self.refs[self.index(block)?])
    }

    pub fn tag(&self, block: BlockId) -> Option<Tag> {
        self.tags.get(block as usize).copied().filter(|&t| t != NIL)
    }

    /// Takes the least recently released block, refcount 1. Its tag, if any, is dropped and
    /// returned: its old contents are about to be overwritten.
    pub fn allocate(&mut self) -> Result<Allocation, KvError> {
        if self.head == NIL {
            return Err(KvError::OutOfBlocks { needed: 1, free: 0 });
        }
        let block = self.head;
        self.unlink(block);
        let i = block as usize;
        self.refs[i] = 1;
        let evicted = (self.tags[i] != NIL).then(|| std::mem::replace(&mut self.tags[i], NIL));
        if evicted.is_some() {
            self.tagged -= 1;
            self.cached_free -= 1;
        }
        Ok(Allocation { block, evicted })
    }

    /// One more holder of `block`; a cached-free block leaves the free list with its tag intact.
    pub fn retain(&mut self, block: BlockId) -> Result<(), KvError> {
        let i = self.index(block)?;
        if self.refs[i] == 0 {
            self.unlink(block);
            if self.tags[i] != NIL {
                self.cached_free -= 1;
            }
        }
        self.refs[i] += 1;
        Ok(())
    }

    /// One holder fewer; returns whether the block became free (it joins the tail of the free
    /// list, so blocks released earlier are reused first).
    pub fn release(&mut self, block: BlockId) -> Result<bool, KvError> {
        let i = self.index(block)?;
        match self.refs[i] {
            0 => Err(KvError::DoubleFree(block)),
            1 => {
                self.refs[i] = 0;
                self.push_back(block);
                if self.tags[i] != NIL {
                    self.cached_free += 1;
                }
                Ok(true)
            }
            _ => {
                self.refs[i] -= 1;
                Ok(false)
            }
        }
    }

    /// Marks `block` as holding the page the prefix cache knows as `tag`. A block holds one page
    /// of one prefix, so it carries at most one tag.
    pub fn set_tag(&mut self, block: BlockId, tag: Tag) -> Result<(), KvError> {
        let i = self.index(block)?;
        if self.tags[i] != NIL {
            return Err(KvError::AlreadyTagged(block));
        }
        if tag == NIL {
            return Err(KvError::Config(format!("tag {tag} is reserved")));
        }
        self.tags[i] = tag;
        self.tagged += 1;
        if self.refs[i] == 0 {
            self.cached_free += 1;
        }
        Ok(())
    }

    /// The free list, least recently released first (the order `allocate` hands blocks out).
    pub fn free_list(&self) -> impl Iterator<Item = BlockId> + '_ {
        let mut at = self.head;
        std::iter::from_fn(move || {
            (at != NIL).then(|| {
                let b = at;
                at = self.next[b as usize];
                b
            })
        })
    }

    fn unlink(&mut self, block: BlockId) {
        let i = block as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.free -= 1;
    }

    fn push_back(&mut self, block: BlockId) {
        let i = block as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = block;
        } else {
            self.next[self.tail as usize] = block;
        }
        self.tail = block;
        self.free += 1;
    }

    /// Internal consistency: the free list is well linked and holds exactly the unreferenced
    /// blocks, and the counters agree with the per-block state.
    pub fn check(&self) -> Result<(), String> {
        let n = self.len();
        let mut on_list = vec![false; n];
        let mut count = 0;
        let mut prev = NIL;
        let mut at = self.head;
        while at != NIL {
            let i = at as usize;
            if i >= n || on_list[i] {
                return Err(format!("free list revisits or overruns at block {at}"));
            }
            if self.prev[i] != prev {
                return Err(format!("free list back link of block {at} is broken"));
            }
            on_list[i] = true;
            count += 1;
            prev = at;
            at = self.next[i];
        }
        if prev != self.tail {
            return Err("free list tail is stale".into());
        }
        if count != self.free {
            return Err(format!("free count {} but {count} blocks on the free list", self.free));
        }
        for (i, &on) in on_list.iter().enumerate() {
            if on != (self.refs[i] == 0) {
                return Err(format!("block {i}: refcount {} but on free list = {on}", self.refs[i]));
            }
        }
        let tagged = self.tags.iter().filter(|&&t| t != NIL).count();
        let cached_free = (0..n).filter(|&i| self.tags[i] != NIL && self.refs[i] == 0).count();
        if (tagged, cached_free) != (self.tagged, self.cached_free) {
            return Err(format!(
                "tag counters ({}, {}) disagree with blocks ({tagged}, {cached_free})",
                self.tagged, self.cached_free
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_helpers() {
        assert_eq!(bytes_per_block(64, 4, 128, 2), 128 * 1024);
        assert_eq!(blocks_for_budget(10 * 128 * 1024 + 5, bytes_per_block(64, 4, 128, 2)), 10);
        assert_eq!(blocks_for_budget(1 << 20, 0), 0);
    }

    #[test]
    fn allocates_in_id_order_then_runs_out() {
        let mut p = BlockPool::new(3).unwrap();
        let got: Vec<_> = (0..3).map(|_| p.allocate().unwrap().block).collect();
        assert_eq!(got, [0, 1, 2]);
        assert_eq!(p.allocate(), Err(KvError::OutOfBlocks { needed: 1, free: 0 }));
        assert_eq!((p.free_count(), p.live_count()), (0, 3));
        p.check().unwrap();
    }

    #[test]
    fn reuse_is_least_recently_released_first() {
        let mut p = BlockPool::new(5).unwrap();
        let b: Vec<_> = (0..3).map(|_| p.allocate().unwrap().block).collect();
        for &x in &[b[1], b[0], b[2]] {
            assert!(p.release(x).unwrap());
        }
        // Never-used blocks 3 and 4 were "released" at start, so they come first.
        assert_eq!(p.free_list().collect::<Vec<_>>(), [3, 4, b[1], b[0], b[2]]);
        let order: Vec<_> = (0..5).map(|_| p.allocate().unwrap().block).collect();
        assert_eq!(order, [3, 4, 1, 0, 2]);
        p.check().unwrap();
    }

    #[test]
    fn refcounts_and_double_free() {
        let mut p = BlockPool::new(2).unwrap();
        let b = p.allocate().unwrap().block;
        p.retain(b).unwrap();
        assert_eq!(p.refcount(b), Ok(2));
        assert!(!p.release(b).unwrap());
        assert!(p.release(b).unwrap());
        assert_eq!(p.release(b), Err(KvError::DoubleFree(b)));
        assert_eq!(p.release(7), Err(KvError::NoSuchBlock { block: 7, num_blocks: 2 }));
        assert_eq!(p.retain(7), Err(KvError::NoSuchBlock { block: 7, num_blocks: 2 }));
        assert_eq!(p.free_count(), 2);
        p.check().unwrap();
    }

    #[test]
    fn cached_free_blocks_are_attachable_until_reused() {
        let mut p = BlockPool::new(3).unwrap();
        let a = p.allocate().unwrap().block;
        let b = p.allocate().unwrap().block;
        p.set_tag(a, 10).unwrap();
        p.set_tag(b, 11).unwrap();
        assert_eq!(p.set_tag(a, 12), Err(KvError::AlreadyTagged(a)));
        p.release(a).unwrap();
        p.release(b).unwrap();
        assert_eq!((p.tagged_count(), p.cached_free_count()), (2, 2));
        // Attaching `b` pulls it out of the middle of the free list, tag intact.
        p.retain(b).unwrap();
        assert_eq!((p.tag(b), p.cached_free_count(), p.free_count()), (Some(11), 1, 2));
        p.check().unwrap();
        // Block 2 was never used and goes first; then `a` is reused and reports its lost tag.
        assert_eq!(p.allocate().unwrap(), Allocation { block: 2, evicted: None });
        assert_eq!(p.allocate().unwrap(), Allocation { block: a, evicted: Some(10) });
        assert_eq!((p.tag(a), p.tagged_count(), p.cached_free_count()), (None, 1, 0));
        p.check().unwrap();
    }

    #[test]
    fn empty_and_oversized_pools() {
        let mut p = BlockPool::new(0).unwrap();
        assert!(p.is_empty());
        assert!(p.allocate().is_err());
        p.check().unwrap();
        assert!(matches!(BlockPool::new(i32::MAX as usize + 1), Err(KvError::Config(_))));
    }
}
