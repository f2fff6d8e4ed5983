//! Whole-manager invariants, checked after every operation by the property tests and available to
//! the engine's own tests (a leak or a shared block found here is a scheduler bug caught early).

use std::collections::HashMap;

use super::pool::BlockId;
use super::KvManager;

impl KvManager {
    /// Verifies that the pool, the tables and the prefix cache agree:
    /// - the free list is well formed and holds exactly the unreferenced blocks;
    /// - every block's refcount equals the number of table slots that hold it;
    /// - a block held more than once carries a prefix key (it was shared through the cache), and
    ///   all its holders map it at the same layer and page;
    /// - tags and prefix-cache entries name each other;
    /// - every table maps exactly what its length and window require.
    pub fn check(&self) -> Result<(), String> {
        self.pool.check()?;
        self.prefix.check(&self.pool)?;
        let mut holders: HashMap<BlockId, (u32, usize, usize)> = HashMap::new();
        for (&seq, table) in &self.seqs {
            table.check(&self.geom).map_err(|e| format!("sequence {seq}: {e}"))?;
            for (l, j, b) in table.blocks() {
                let h = holders.entry(b).or_insert((0, l, j));
                if (h.1, h.2) != (l, j) {
                    return Err(format!(
                        "block {b} is layer {} page {} in one table, layer {l} page {j} in another",
                        h.1, h.2
                    ));
                }
                h.0 += 1;
            }
        }
        for b in 0..self.pool.len() as BlockId {
            let refs = self.pool.refcount(b).map_err(|e| e.to_string())?;
            let held = holders.get(&b).map_or(0, |h| h.0);
            if refs != held {
                return Err(format!("block {b}: refcount {refs} but held by {held} table slots"));
            }
            if refs > 1 && self.pool.tag(b).is_none() {
                return Err(format!("block {b} is shared by {refs} tables without a prefix key"));
            }
        }
        Ok(())
    }
}
