//! The dense page table the decode step reads: `i32 [layer][batch row][page]`, −1 unmapped.
//! It mirrors the KV manager's per-sequence tables for the sequences that hold
//! a batch row, and is patched incrementally: a decode step that crosses a page writes one entry
//! per layer (plus the pages a sliding layer let go of), not whole rows.

use crate::kv::{BlockTable, KvError, UNMAPPED};

#[derive(Debug, Clone)]
pub struct PageTable {
    layers: usize,
    rows: usize,
    max_pages: usize,
    data: Vec<i32>,
    /// Per (row, layer): the row length and the first mapped page as last written.
    len: Vec<usize>,
    low: Vec<usize>,
}

impl PageTable {
    pub fn new(layers: usize, rows: usize, max_pages: usize) -> Self {
        Self {
            layers,
            rows,
            max_pages,
            data: vec![UNMAPPED; layers * rows * max_pages],
            len: vec![0; rows * layers],
            low: vec![0; rows * layers],
        }
    }

    pub fn layers(&self) -> usize {
        self.layers
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn max_pages(&self) -> usize {
        self.max_pages
    }

    /// The whole table, `[layer][row][page]`.
    pub fn data(&self) -> &[i32] {
        &self.data
    }

    /// Layer `layer`'s entries for batch row `row`.
    pub fn entries(&self, layer: usize, row: usize) -> &[i32] {
        let start = (layer * self.rows + row) * self.max_pages;
        &self.data[start..start + self.max_pages]
    }

    /// Batch row `row` of every layer, `[layer][page]`, appended to `out`.
    pub fn copy_row(&self, row: usize, out: &mut Vec<i32>) {
        for l in 0..self.layers {
            out.extend_from_slice(self.entries(l, row));
        }
    }

    /// Brings row `row` up to date with `table`, writing only what changed since the last sync:
    /// pages that slid out of the window and pages newly mapped. (Growth never remaps a page,
    /// so entries mapped before and after are unchanged.)
    pub fn sync(&mut self, row: usize, table: &BlockTable) -> Result<(), KvError> {
        for l in 0..self.layers {
            let src = table.row(l)?;
            if src.len() > self.max_pages {
                return Err(KvError::RowTooShort { pages: src.len(), max_pages: self.max_pages });
            }
            let i = row * self.layers + l;
            let (old_len, old_low) = (self.len[i], self.low[i]);
            let (new_len, new_low) = (src.len(), table.low(l).min(src.len()));
            let start = (l * self.rows + row) * self.max_pages;
            let dst = &mut self.data[start..start + self.max_pages];
            for range in [old_low.min(new_low)..old_low.max(new_low), old_len.min(new_len)..old_len.max(new_len)] {
                for j in range {
                    dst[j] = src.get(j).copied().unwrap_or(UNMAPPED);
                }
            }
            self.len[i] = new_len;
            self.low[i] = new_low;
        }
        Ok(())
    }

    /// Unmaps row `row` entirely (its sequence left the batch).
    pub fn clear(&mut self, row: usize) {
        for l in 0..self.layers {
            let i = row * self.layers + l;
            let start = (l * self.rows + row) * self.max_pages;
            self.data[start + self.low[i]..start + self.len[i]].fill(UNMAPPED);
            self.len[i] = 0;
            self.low[i] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvConfig, KvManager};

    /// 3 layers (full, sliding, sliding), pages of 4 tokens, window 8.
    fn kv() -> KvManager {
        KvManager::new(KvConfig {
            sliding: vec![false, true, true],
            window: 8,
            page_size: 4,
            num_blocks: 200,
            salt: vec![],
        })
        .unwrap()
    }

    fn expected(kv: &KvManager, rows: &[Option<u64>], max_pages: usize) -> Vec<i32> {
        let mut out = vec![0; 3 * rows.len() * max_pages];
        kv.write_page_table(rows, max_pages, &mut out).unwrap();
        out
    }

    #[test]
    fn incremental_sync_matches_a_full_rewrite() {
        let mut kv = kv();
        let mut pt = PageTable::new(3, 2, 12);
        kv.admit(1, &[]).unwrap();
        kv.admit(2, &[]).unwrap();
        for len in [5usize, 6, 9, 13, 20, 21, 30, 31, 40, 48] {
            kv.grow(1, len).unwrap();
            pt.sync(1, kv.block_table(1).unwrap()).unwrap();
            kv.grow(2, len / 2 + 1).unwrap();
            pt.sync(0, kv.block_table(2).unwrap()).unwrap();
            assert_eq!(pt.data(), expected(&kv, &[Some(2), Some(1)], 12), "len {len}");
        }
        // Sliding layers really did let pages go.
        assert_eq!(pt.entries(1, 1)[0], UNMAPPED);
        let mut row = Vec::new();
        pt.copy_row(1, &mut row);
        assert_eq!(row.len(), 36);
        assert_eq!(&row[12..24], pt.entries(1, 1));
        pt.clear(1);
        kv.release(1).unwrap();
        assert_eq!(pt.data(), expected(&kv, &[Some(2), None], 12));
        // A new sequence in the cleared row is written whole.
        kv.admit(3, &[]).unwrap();
        kv.grow(3, 7).unwrap();
        pt.sync(1, kv.block_table(3).unwrap()).unwrap();
        assert_eq!(pt.data(), expected(&kv, &[Some(2), Some(3)], 12));
    }

    #[test]
    fn rows_longer_than_the_table_are_refused() {
        let mut kv = kv();
        let mut pt = PageTable::new(3, 1, 2);
        kv.admit(1, &[]).unwrap();
        kv.grow(1, 9).unwrap();
        assert!(matches!(pt.sync(0, kv.block_table(1).unwrap()), Err(KvError::RowTooShort { .. })));
    }
}
