//! Page arithmetic for one model's KV cache: page size, sliding window, which layers slide, and
//! the block demand that follows. Kept apart from the tables so admission can be reasoned about
//! (and tested) without any allocation state.

use super::KvError;

/// The shape of the KV cache that every table of a model shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGeometry {
    page: usize,
    window: usize,
    sliding: Vec<bool>,
    num_sliding: usize,
}

impl KvGeometry {
    /// `page`: tokens per block; `window`: keys a sliding layer keeps visible, the current token
    /// included (a query at p sees [p−W+1, p]); `sliding[l]`: whether layer l is windowed.
    ///
    /// `window` is what the KV layer retains, not only what the model attends: an attention kernel
    /// that reads whole tiles behind the window needs the window widened by its tile's slack.
    pub fn new(page: usize, window: usize, sliding: Vec<bool>) -> Result<Self, KvError> {
        if page == 0 {
            return Err(KvError::Config("page size must be at least 1 token".into()));
        }
        if sliding.is_empty() {
            return Err(KvError::Config("the model needs at least one layer".into()));
        }
        let num_sliding = sliding.iter().filter(|&&s| s).count();
        if num_sliding > 0 && window == 0 {
            return Err(KvError::Config("sliding layers need a window of at least 1 token".into()));
        }
        Ok(Self { page, window, sliding, num_sliding })
    }

    pub fn page(&self) -> usize {
        self.page
    }

    pub fn window(&self) -> usize {
        self.window
    }

    pub fn num_layers(&self) -> usize {
        self.sliding.len()
    }

    pub fn num_sliding(&self) -> usize {
        self.num_sliding
    }

    pub fn num_full(&self) -> usize {
        self.sliding.len() - self.num_sliding
    }

    /// Whether `layer` is a sliding-window layer (false for layers out of range).
    pub fn is_sliding(&self, layer: usize) -> bool {
        self.sliding.get(layer).copied().unwrap_or(false)
    }

    pub fn sliding(&self) -> &[bool] {
        &self.sliding
    }

    /// Pages that hold positions [0, len).
    pub fn pages_for(&self, len: usize) -> usize {
        len.div_ceil(self.page)
    }

    /// The most pages `span` consecutive positions can touch: an unaligned span straddles one
    /// page more than an aligned one (4096 tokens in 64-token pages: 65).
    pub fn span_pages(&self, span: usize) -> usize {
        if span == 0 {
            0
        } else {
            span.saturating_add(2 * self.page - 2) / self.page
        }
    }

    /// The most pages a sliding layer ever holds for one sequence in steady decode.
    pub fn window_pages(&self) -> usize {
        self.span_pages(self.window)
    }

    /// First logical page a sliding layer still needs when the earliest query still to be computed
    /// is at position `query`: it sees [query−W+1, query], so pages wholly below that are dead.
    pub fn keep_from(&self, query: usize) -> usize {
        query.saturating_add(1).saturating_sub(self.window) / self.page
    }

    /// Blocks one sequence of `len` tokens holds at most while decoding: every page on full
    /// layers, at most a window's worth on sliding layers. This, not layers × context, is what
    /// admission must count on a hybrid model.
    pub fn blocks_needed(&self, len: usize) -> usize {
        let pages = self.pages_for(len);
        self.layer_blocks(pages, pages.min(self.window_pages()))
    }

    /// Peak blocks while prefilling `len` tokens in chunks of `chunk` (0: one chunk): a chunk's
    /// first query still needs the window behind it, so sliding layers transiently hold the
    /// chunk's pages plus that window.
    pub fn prefill_blocks_needed(&self, len: usize, chunk: usize) -> usize {
        let chunk = if chunk == 0 { len } else { chunk.min(len) };
        let pages = self.pages_for(len);
        let transient = self.span_pages(self.window.saturating_add(chunk).saturating_sub(1)).max(self.window_pages());
        self.layer_blocks(pages, pages.min(transient))
    }

    /// `full` pages on every full layer plus `sliding` on every sliding one (saturating: absurd
    /// lengths must compare as "does not fit", not wrap).
    fn layer_blocks(&self, full: usize, sliding: usize) -> usize {
        self.num_full().saturating_mul(full).saturating_add(self.num_sliding.saturating_mul(sliding))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nmc() -> KvGeometry {
        KvGeometry::new(64, 4096, (0..49).map(|l| l % 4 != 0).collect()).unwrap()
    }

    #[test]
    fn rejects_bad_shapes() {
        assert!(matches!(KvGeometry::new(0, 8, vec![true]), Err(KvError::Config(_))));
        assert!(matches!(KvGeometry::new(64, 0, vec![true]), Err(KvError::Config(_))));
        assert!(matches!(KvGeometry::new(64, 8, vec![]), Err(KvError::Config(_))));
        // A window is irrelevant without sliding layers.
        assert!(KvGeometry::new(64, 0, vec![false, false]).is_ok());
    }

    #[test]
    fn nmc_layer_counts_and_window_pages() {
        let g = nmc();
        assert_eq!((g.num_layers(), g.num_full(), g.num_sliding()), (49, 13, 36));
        assert_eq!(g.window_pages(), 65);
        assert_eq!(g.span_pages(1), 1);
        assert_eq!(g.span_pages(64), 2);
        assert_eq!(g.span_pages(65), 2);
        assert_eq!(g.span_pages(66), 3);
    }

    #[test]
    fn span_pages_is_the_worst_alignment() {
        for page in 1..9 {
            let g = KvGeometry::new(page, 1, vec![true]).unwrap();
            for span in 1..40 {
                let worst = (0..page).map(|start| (start + span - 1) / page - start / page + 1).max().unwrap();
                assert_eq!(g.span_pages(span), worst, "page {page} span {span}");
            }
        }
    }

    #[test]
    fn keep_from_window_boundaries() {
        let g = nmc();
        // Query at p sees [p−4095, p].
        assert_eq!(g.keep_from(0), 0);
        assert_eq!(g.keep_from(4095), 0); // sees [0, 4095]
        assert_eq!(g.keep_from(4096), 0); // sees [1, 4096]: page 0 still holds position 63
        assert_eq!(g.keep_from(4158), 0); // sees [63, 4158]
        assert_eq!(g.keep_from(4159), 1); // sees [64, 4159]: page 0 wholly out
        assert_eq!(g.keep_from(4159 + 64), 2);
    }

    #[test]
    fn demand_is_hybrid() {
        let g = nmc();
        assert_eq!(g.blocks_needed(0), 0);
        assert_eq!(g.blocks_needed(1), 49);
        assert_eq!(g.blocks_needed(64), 49);
        assert_eq!(g.blocks_needed(65), 98);
        // 32K tokens: 512 pages on 13 full layers, 65 on 36 sliding ones.
        assert_eq!(g.blocks_needed(32768), 13 * 512 + 36 * 65);
        assert!(g.blocks_needed(32768) < 49 * 512 / 2);
    }

    #[test]
    fn prefill_transient_covers_chunk_plus_window() {
        let g = nmc();
        // Short prompts: nothing slides out, the transient is the prompt itself.
        assert_eq!(g.prefill_blocks_needed(1000, 1024), g.blocks_needed(1000));
        // A chunk of 1024 behind a full window spans 4096+1024−1 positions: 81 pages.
        assert_eq!(g.prefill_blocks_needed(32768, 1024), 13 * 512 + 36 * 81);
        // Unchunked: the whole prompt is live at once.
        assert_eq!(g.prefill_blocks_needed(32768, 0), 49 * 512);
        for len in [1, 63, 64, 65, 4096, 4097, 9000] {
            assert!(g.prefill_blocks_needed(len, 512) >= g.blocks_needed(len));
        }
        // Absurd sizes saturate instead of wrapping.
        assert!(g.blocks_needed(usize::MAX) > g.blocks_needed(1 << 40));
        assert!(g.prefill_blocks_needed(usize::MAX, usize::MAX) > g.blocks_needed(1 << 40));
        let all_full = KvGeometry::new(1, 1, vec![false; 3]).unwrap();
        assert_eq!(all_full.blocks_needed(usize::MAX), usize::MAX);
        assert_eq!(KvGeometry::new(64, usize::MAX, vec![true]).unwrap().window_pages(), usize::MAX / 64);
    }
}
