//! One sequence's block tables: per layer, logical page j → physical block, stored as the `i32`
//! row the GPU reads (−1 for unmapped) so uploading it needs no conversion.
//!
//! Invariant per layer: pages below the layer's watermark `low` are unmapped (released out of the
//! window; always 0 on full layers), pages from `low` to the end are mapped, and the row covers
//! every position below `len`.

use super::geometry::KvGeometry;
use super::pool::BlockId;
use super::KvError;

/// Page-table value of a page with no block.
pub const UNMAPPED: i32 = -1;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockTable {
    len: usize,
    rows: Vec<Vec<i32>>,
    low: Vec<usize>,
    /// Shortest row and lowest sliding watermark (usize::MAX without sliding layers): enough to
    /// tell in O(1) that a decode step maps and releases nothing.
    pages: usize,
    sliding_low: usize,
}

impl BlockTable {
    /// An empty table (no tokens) for a model of `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self { len: 0, rows: vec![Vec::new(); num_layers], low: vec![0; num_layers], pages: 0, sliding_low: 0 }
    }

    /// A table of `pages` full pages attached from the prefix cache; `rows[l]` is layer l's row
    /// (sliding layers unmapped below the window that the next query needs).
    pub(crate) fn attached(geom: &KvGeometry, pages: usize, rows: Vec<Vec<i32>>) -> Self {
        let len = pages * geom.page();
        let low = (0..rows.len()).map(|l| if geom.is_sliding(l) { geom.keep_from(len) } else { 0 }).collect();
        let mut table = Self { len, rows, low, pages: 0, sliding_low: 0 };
        table.refresh(geom);
        table
    }

    fn refresh(&mut self, geom: &KvGeometry) {
        self.pages = self.rows.iter().map(Vec::len).min().unwrap_or(0);
        self.sliding_low =
            (0..self.rows.len()).filter(|&l| geom.is_sliding(l)).map(|l| self.low[l]).min().unwrap_or(usize::MAX);
    }

    /// Grows to `new_len` without touching the rows when that maps and releases nothing (63 of
    /// every 64 decode steps); returns false, changing nothing, otherwise.
    pub fn extend_in_place(&mut self, geom: &KvGeometry, new_len: usize) -> bool {
        if new_len < self.len || geom.pages_for(new_len) > self.pages || geom.keep_from(self.len) > self.sliding_low {
            return false;
        }
        self.len = new_len;
        true
    }

    /// Tokens whose pages are mapped: positions [0, len).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn num_layers(&self) -> usize {
        self.rows.len()
    }

    /// Layer `layer`'s row: one entry per logical page up to the last mapped one.
    pub fn row(&self, layer: usize) -> Result<&[i32], KvError> {
        self.rows.get(layer).map(Vec::as_slice).ok_or(KvError::NoSuchLayer { layer, num_layers: self.rows.len() })
    }

    /// The block behind logical page `page` of `layer`, if mapped.
    pub fn block(&self, layer: usize, page: usize) -> Option<BlockId> {
        let b = *self.rows.get(layer)?.get(page)?;
        (b != UNMAPPED).then_some(b as BlockId)
    }

    /// First page still mapped on `layer` (0 on full layers).
    pub fn low(&self, layer: usize) -> usize {
        self.low.get(layer).copied().unwrap_or(0)
    }

    /// Pages mapped on `layer`.
    pub fn mapped(&self, layer: usize) -> usize {
        self.rows.get(layer).map_or(0, |r| r.len().saturating_sub(self.low(layer)))
    }

    /// Every mapped block as (layer, page, block).
    pub fn blocks(&self) -> impl Iterator<Item = (usize, usize, BlockId)> + '_ {
        self.rows
            .iter()
            .enumerate()
            .flat_map(move |(l, row)| row.iter().enumerate().skip(self.low[l]).map(move |(j, &b)| (l, j, b as BlockId)))
    }

    /// Writes layer `layer`'s row padded with −1 to `out.len()` pages (the dense GPU layout).
    pub fn write_row(&self, layer: usize, out: &mut [i32]) -> Result<(), KvError> {
        let row = self.row(layer)?;
        if row.len() > out.len() {
            return Err(KvError::RowTooShort { pages: row.len(), max_pages: out.len() });
        }
        out[..row.len()].copy_from_slice(row);
        out[row.len()..].fill(UNMAPPED);
        Ok(())
    }

    /// Blocks that growing to `new_len` must map, over all layers. The earliest new query is at
    /// position `len`, so sliding layers need nothing below `keep_from(len)`.
    pub fn pages_to_map(&self, geom: &KvGeometry, new_len: usize) -> usize {
        let target = geom.pages_for(new_len);
        let keep = geom.keep_from(self.len);
        (0..self.rows.len())
            .map(|l| {
                let start = if geom.is_sliding(l) { self.rows[l].len().max(keep) } else { self.rows[l].len() };
                target.saturating_sub(start)
            })
            .sum()
    }

    /// Blocks of sliding layers below page `keep` (those a grow past `len` lets go of).
    pub fn out_of_window<'a>(&'a self, geom: &'a KvGeometry, keep: usize) -> impl Iterator<Item = BlockId> + 'a {
        (0..self.rows.len()).filter(|&l| geom.is_sliding(l)).flat_map(move |l| {
            let end = keep.min(self.rows[l].len());
            self.rows[l].get(self.low[l]..end).unwrap_or(&[]).iter().map(|&b| b as BlockId)
        })
    }

    /// Unmaps sliding-layer pages below `keep`, oldest first, handing each block to `release`.
    /// The watermark makes this incremental: each page is looked at once.
    pub fn release_out_of_window(
        &mut self,
        geom: &KvGeometry,
        keep: usize,
        mut release: impl FnMut(BlockId) -> Result<(), KvError>,
    ) -> Result<(), KvError> {
        for l in 0..self.rows.len() {
            if !geom.is_sliding(l) || self.low[l] >= keep {
                continue;
            }
            let end = keep.min(self.rows[l].len());
            for j in self.low[l]..end {
                let b = std::mem::replace(&mut self.rows[l][j], UNMAPPED);
                self.low[l] = j + 1;
                release(b as BlockId)?;
            }
            self.low[l] = keep;
        }
        self.refresh(geom);
        Ok(())
    }

    /// Maps every page through position `new_len − 1` with blocks from `alloc` (called with the
    /// layer), skipping sliding-layer pages already out of the window, then records the length.
    pub fn map_through(
        &mut self,
        geom: &KvGeometry,
        new_len: usize,
        mut alloc: impl FnMut(usize) -> Result<BlockId, KvError>,
    ) -> Result<(), KvError> {
        let target = geom.pages_for(new_len);
        let keep = geom.keep_from(self.len);
        for l in 0..self.rows.len() {
            if geom.is_sliding(l) && self.rows[l].len() < keep {
                self.rows[l].resize(keep, UNMAPPED);
                self.low[l] = keep;
            }
            while self.rows[l].len() < target {
                let b = alloc(l)?;
                self.rows[l].push(b as i32);
            }
        }
        self.len = self.len.max(new_len);
        self.refresh(geom);
        Ok(())
    }

    /// Shortens the table to `new_len` tokens (at least the first query of the call that grew it:
    /// speculative decoding keeps only what a step accepted), handing the blocks of pages past
    /// the new length to `release`. Sliding-layer watermarks stay: they were set for a query no
    /// later than `new_len`.
    pub fn truncate(
        &mut self,
        geom: &KvGeometry,
        new_len: usize,
        mut release: impl FnMut(BlockId) -> Result<(), KvError>,
    ) -> Result<(), KvError> {
        let pages = geom.pages_for(new_len);
        for row in &mut self.rows {
            while row.len() > pages {
                let b = row.pop().expect("a page past the new length");
                if b != UNMAPPED {
                    release(b as BlockId)?;
                }
            }
        }
        self.len = self.len.min(new_len);
        self.refresh(geom);
        Ok(())
    }

    /// Every mapped block in the order a finished sequence should give them back: last page
    /// first (the free list reuses early releases first, so prefix pages survive longest) and,
    /// within a page, sliding layers before full ones (a lost full-layer page breaks every longer
    /// cached prefix, a lost sliding one only those whose window covers it).
    pub fn release_order<'a>(&'a self, geom: &'a KvGeometry) -> impl Iterator<Item = BlockId> + 'a {
        let pages = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        (0..pages).rev().flat_map(move |j| {
            let sliding = (0..self.rows.len()).filter(|&l| geom.is_sliding(l));
            let full = (0..self.rows.len()).filter(|&l| !geom.is_sliding(l));
            sliding.chain(full).filter_map(move |l| self.block(l, j))
        })
    }

    /// Structural invariants of the table against `geom` (used by `KvManager::check`).
    pub fn check(&self, geom: &KvGeometry) -> Result<(), String> {
        if self.rows.len() != geom.num_layers() {
            return Err(format!("{} rows for {} layers", self.rows.len(), geom.num_layers()));
        }
        let pages = geom.pages_for(self.len);
        for (l, row) in self.rows.iter().enumerate() {
            if row.len() != pages {
                return Err(format!("layer {l}: {} pages for {} tokens", row.len(), self.len));
            }
            let low = self.low[l];
            if !geom.is_sliding(l) && low != 0 {
                return Err(format!("full layer {l} released pages below {low}"));
            }
            // The next query (at `len`) must still see everything it needs; the proptests check
            // the stronger rule that a grow keeps what its first query needs.
            if low > geom.keep_from(self.len) {
                return Err(format!("layer {l}: page {} released while the next query needs it", low - 1));
            }
            if row[..low.min(row.len())].iter().any(|&b| b != UNMAPPED) {
                return Err(format!("layer {l}: a page below the watermark {low} is still mapped"));
            }
            if row.get(low..).unwrap_or(&[]).iter().any(|&b| b < 0) {
                return Err(format!("layer {l}: a page at or above the watermark {low} is unmapped"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts up from 100 so block ids are recognisable.
    fn counter() -> impl FnMut(usize) -> Result<BlockId, KvError> {
        let mut next = 100;
        move |_| {
            next += 1;
            Ok(next - 1)
        }
    }

    fn grow(
        t: &mut BlockTable,
        g: &KvGeometry,
        new_len: usize,
        alloc: &mut impl FnMut(usize) -> Result<BlockId, KvError>,
    ) {
        let keep = g.keep_from(t.len());
        let mut released = Vec::new();
        t.release_out_of_window(g, keep, |b| {
            released.push(b);
            Ok(())
        })
        .unwrap();
        t.map_through(g, new_len, alloc).unwrap();
        t.check(g).unwrap();
    }

    #[test]
    fn growing_maps_the_page_of_each_new_position_on_every_layer() {
        let g = KvGeometry::new(4, 8, vec![false, true]).unwrap();
        let mut t = BlockTable::new(2);
        let mut alloc = counter();
        assert_eq!(t.pages_to_map(&g, 1), 2);
        grow(&mut t, &g, 1, &mut alloc);
        assert_eq!((t.row(0).unwrap(), t.row(1).unwrap()), (&[100][..], &[101][..]));
        // Positions 1..3 stay on page 0.
        assert_eq!(t.pages_to_map(&g, 4), 0);
        grow(&mut t, &g, 4, &mut alloc);
        assert_eq!(t.pages_to_map(&g, 5), 2);
        grow(&mut t, &g, 5, &mut alloc);
        assert_eq!(t.row(0).unwrap(), &[100, 102]);
        assert_eq!(t.row(1).unwrap(), &[101, 103]);
        assert_eq!(t.block(1, 1), Some(103));
        assert_eq!(t.block(1, 2), None);
        assert!(matches!(t.row(2), Err(KvError::NoSuchLayer { layer: 2, num_layers: 2 })));
    }

    /// Decodes one token at a time from 0 to `end`, reporting the sliding layer's watermark after
    /// each step (the step that computed position p).
    fn decode_watermarks(page: usize, window: usize, end: usize) -> Vec<usize> {
        let g = KvGeometry::new(page, window, vec![true]).unwrap();
        let mut t = BlockTable::new(1);
        let mut alloc = counter();
        (1..=end)
            .map(|len| {
                grow(&mut t, &g, len, &mut alloc);
                assert!(t.mapped(0) <= g.window_pages());
                t.low(0)
            })
            .collect()
    }

    #[test]
    fn window_release_boundaries() {
        // W = 8, pages of 4: the query at p sees [p−7, p]; page 0 = positions 0..3 is wholly out
        // once p − 7 ≥ 4, i.e. at p = 11 (len 12), not at p = 8 (exactly W) or 9 (W + 1).
        let lows = decode_watermarks(4, 8, 16);
        let at = |p: usize| lows[p];
        assert_eq!((at(7), at(8), at(9), at(10)), (0, 0, 0, 0));
        assert_eq!(at(11), 1);
        assert_eq!((at(14), at(15)), (1, 2));
        // Aligned window W = 4 = page: the query at p = 4 sees [1, 4], page 0 still holds 1..3.
        let lows = decode_watermarks(4, 4, 9);
        assert_eq!((lows[4], lows[6], lows[7], lows[8]), (0, 0, 1, 1));
        // Window 1: only the current page.
        let lows = decode_watermarks(4, 1, 9);
        assert_eq!((lows[3], lows[4], lows[8]), (0, 1, 2));
    }

    #[test]
    fn nmc_window_boundaries() {
        let lows = decode_watermarks(64, 4096, 4096 + 130);
        // Exactly W tokens, W + 1 tokens, up to the page edge: page 0 is still needed.
        assert_eq!(lows[4095], 0);
        assert_eq!(lows[4096], 0);
        assert_eq!(lows[4158], 0);
        // The query at 4159 sees [64, 4159]: page 0 goes.
        assert_eq!(lows[4159], 1);
        assert_eq!(lows[4159 + 63], 1);
        assert_eq!(lows[4159 + 64], 2);
    }

    #[test]
    fn in_place_extension_only_when_nothing_changes() {
        let g = KvGeometry::new(4, 8, vec![false, true]).unwrap();
        let mut t = BlockTable::new(2);
        let mut alloc = counter();
        assert!(!t.extend_in_place(&g, 1)); // needs page 0
        grow(&mut t, &g, 1, &mut alloc);
        assert!(t.extend_in_place(&g, 4));
        assert_eq!(t.len(), 4);
        assert!(!t.extend_in_place(&g, 5)); // needs page 1
        assert!(!t.extend_in_place(&g, 3)); // shrinking is not an extension
        for len in 5..=11 {
            grow(&mut t, &g, len, &mut alloc);
        }
        // len 11 → 12: no new page, but the query at 11 sees [4, 11]: page 0 must go.
        assert!(!t.extend_in_place(&g, 12));
        grow(&mut t, &g, 12, &mut alloc);
        assert_eq!(t.low(1), 1);
        assert!(t.extend_in_place(&g, 12));
    }

    #[test]
    fn full_layers_keep_everything() {
        let g = KvGeometry::new(4, 4, vec![false, true]).unwrap();
        let mut t = BlockTable::new(2);
        let mut alloc = counter();
        for len in 1..=40 {
            grow(&mut t, &g, len, &mut alloc);
        }
        assert_eq!(t.mapped(0), 10);
        assert_eq!(t.low(0), 0);
        assert!(t.mapped(1) <= g.window_pages());
    }

    #[test]
    fn a_chunk_keeps_the_window_of_its_first_query() {
        let g = KvGeometry::new(4, 8, vec![true]).unwrap();
        let mut t = BlockTable::new(1);
        let mut alloc = counter();
        grow(&mut t, &g, 20, &mut alloc);
        // One chunk from 0: nothing is released, all 5 pages live at once.
        assert_eq!((t.low(0), t.mapped(0)), (0, 5));
        // Next chunk [20, 32): its first query at 20 sees [13, 20], so pages 0..2 go (page 3 = 12..15 stays).
        let keep = g.keep_from(20);
        assert_eq!(keep, 3);
        assert_eq!(t.out_of_window(&g, keep).collect::<Vec<_>>(), [100, 101, 102]);
        assert_eq!(t.pages_to_map(&g, 32), 3);
        grow(&mut t, &g, 32, &mut alloc);
        assert_eq!((t.low(0), t.mapped(0)), (3, 5));
        // The following single step (query 32 sees [25, 32]) trims to the window: pages 6..8.
        grow(&mut t, &g, 33, &mut alloc);
        assert_eq!((t.low(0), t.mapped(0)), (6, 3));
    }

    #[test]
    fn dense_rows_are_padded() {
        let g = KvGeometry::new(4, 4, vec![true]).unwrap();
        let mut t = BlockTable::new(1);
        let mut alloc = counter();
        for len in [6, 8, 9] {
            grow(&mut t, &g, len, &mut alloc);
        }
        let mut out = [7; 5];
        t.write_row(0, &mut out).unwrap();
        assert_eq!(out, [-1, 101, 102, -1, -1]);
        let mut short = [0; 2];
        assert_eq!(t.write_row(0, &mut short), Err(KvError::RowTooShort { pages: 3, max_pages: 2 }));
    }

    #[test]
    fn release_order_is_reverse_logical_sliding_first() {
        let g = KvGeometry::new(4, 100, vec![false, true]).unwrap();
        let mut t = BlockTable::new(2);
        let mut alloc = counter();
        grow(&mut t, &g, 9, &mut alloc);
        // Pages 0, 1, 2: full layer 100, 101, 102; sliding layer 103, 104, 105.
        assert_eq!(t.release_order(&g).collect::<Vec<_>>(), [105, 102, 104, 101, 103, 100]);
    }
}
