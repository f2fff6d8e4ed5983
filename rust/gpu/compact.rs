//! Host-side inputs of one megakernel launch, from the engine's sparse batch rows.
//!
//! The engine keeps one dense page table `[layer][engine row][page]` whose rows never move; a
//! launch numbers its rows 0..B-1 and the kernel indexes `block_tables[(layer * B + b) * pages]`
//! with that launch's B. So each launch gets its own compacted copy, `pages` wide: only the pages
//! its longest row reaches, not the table's full width (at short contexts that is most of it).

use crate::kv::PAGE_SIZE;
use crate::sched::PageTable;

/// Pages per row a launch needs: enough for its highest write position.
pub fn step_pages(positions: &[u32]) -> usize {
    positions.iter().map(|&p| p as usize / PAGE_SIZE + 1).max().unwrap_or(0)
}

/// `[layer][i][page]` for i over `rows` (engine rows), `pages` entries each, into `out`.
pub fn compact_tables(table: &PageTable, rows: &[usize], pages: usize, out: &mut Vec<i32>) {
    assert!(pages <= table.max_pages(), "{pages} pages of a {}-page table", table.max_pages());
    out.clear();
    out.reserve(table.layers() * rows.len() * pages);
    for layer in 0..table.layers() {
        for &r in rows {
            out.extend_from_slice(&table.entries(layer, r)[..pages]);
        }
    }
}

/// Checks that every page a launch reads or writes is mapped to a block of the pool: row i at
/// `positions[i]` touches, on each layer, the pages from its window's first key to the position
/// (`window[layer]`: keys including the current one, None for full attention). A bad entry would
/// make the kernel read or write outside the pool, so it is refused before the launch.
pub fn check_mapped(
    compact: &[i32],
    positions: &[u32],
    pages: usize,
    window: &[Option<usize>],
    num_blocks: usize,
) -> Result<(), String> {
    let b = positions.len();
    for (layer, w) in window.iter().enumerate() {
        for (i, &pos) in positions.iter().enumerate() {
            let pos = pos as usize;
            let first = w.map_or(0, |w| (pos + 1).saturating_sub(w)) / PAGE_SIZE;
            let entries = &compact[(layer * b + i) * pages..][..pages];
            for (page, &block) in entries.iter().enumerate().take(pos / PAGE_SIZE + 1).skip(first) {
                if block < 0 || block as usize >= num_blocks {
                    return Err(format!(
                        "step row {i} (position {pos}) reads page {page} of layer {layer}, mapped to block {block} \
                         (pool of {num_blocks})"
                    ));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvConfig, KvManager, UNMAPPED};

    /// 2 layers (full, sliding with a 128-token window), 64-token pages, a 6-page table of 3 rows.
    fn setup() -> (KvManager, PageTable) {
        let kv = KvManager::new(KvConfig {
            sliding: vec![false, true],
            window: 128,
            page_size: PAGE_SIZE,
            num_blocks: 64,
            salt: vec![],
        })
        .unwrap();
        (kv, PageTable::new(2, 3, 6))
    }

    #[test]
    fn sparse_rows_become_consecutive_with_the_steps_width() {
        let (mut kv, mut pt) = setup();
        // Engine rows 0 and 2 decode; row 1 is idle (mapped, but not in the step).
        for (seq, row, len) in [(1, 0, 100), (2, 1, 300), (3, 2, 250)] {
            kv.admit(seq, &[]).unwrap();
            kv.grow(seq, len - 50).unwrap();
            kv.grow(seq, len).unwrap(); // sliding layers release what the window left behind
            pt.sync(row, kv.block_table(seq).unwrap()).unwrap();
        }
        let positions = [99, 249];
        let pages = step_pages(&positions);
        assert_eq!(pages, 4); // position 249 is on page 3
        let mut out = vec![7; 3];
        compact_tables(&pt, &[0, 2], pages, &mut out);
        assert_eq!(out.len(), 2 * 2 * pages);
        for layer in 0..2 {
            assert_eq!(&out[(layer * 2) * pages..][..pages], &pt.entries(layer, 0)[..pages]);
            assert_eq!(&out[(layer * 2 + 1) * pages..][..pages], &pt.entries(layer, 2)[..pages]);
        }
        // Row 0 reaches page 1 only: the rest of its compacted row is unmapped.
        assert_eq!(out[2..4], [UNMAPPED, UNMAPPED]);
        check_mapped(&out, &positions, pages, &[None, Some(128)], 64).unwrap();
        // The sliding layer let page 0 of the 250-token row go, and the check knows it may.
        assert_eq!(out[(2 + 1) * pages], UNMAPPED);
    }

    #[test]
    fn an_unmapped_or_foreign_page_is_refused() {
        let (mut kv, mut pt) = setup();
        kv.admit(1, &[]).unwrap();
        kv.grow(1, 64).unwrap();
        pt.sync(0, kv.block_table(1).unwrap()).unwrap();
        let mut out = Vec::new();
        // Position 64 was never mapped (the engine maps before it calls; this is the guard).
        compact_tables(&pt, &[0], 2, &mut out);
        let err = check_mapped(&out, &[64], 2, &[None, Some(128)], 64).unwrap_err();
        assert!(err.contains("page 1 of layer 0"), "{err}");
        check_mapped(&out, &[63], 2, &[None, Some(128)], 64).unwrap();
        // A block id past the pool (a table from another pool) is refused too.
        assert!(check_mapped(&out, &[63], 2, &[None, Some(128)], 1).is_err());
    }

    #[test]
    fn step_pages_follow_the_highest_position() {
        assert_eq!(step_pages(&[]), 0);
        assert_eq!(step_pages(&[0]), 1);
        assert_eq!(step_pages(&[63, 5]), 1);
        assert_eq!(step_pages(&[64, 5]), 2);
        assert_eq!(step_pages(&[8191]), 128);
    }
}
