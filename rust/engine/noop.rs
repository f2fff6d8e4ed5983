//! A backend that computes nothing, for measuring the control plane alone. It still does the
//! host work every real backend must: copying the page-table rows that changed into its own
//! mirror (what a GPU backend uploads).

use super::backend::{Backend, BackendError, DecodeInput, PrefillInput, PrefillResult};
use crate::sampling::Sampled;
use crate::sched::PageTable;

#[derive(Debug, Default)]
pub struct NoopBackend {
    /// The token every call "samples" (pick one that is not EOS).
    pub token: u32,
    mirror: Vec<i32>,
    /// Page-table rows copied so far.
    pub rows_uploaded: u64,
}

impl NoopBackend {
    pub fn new(token: u32) -> Self {
        Self { token, ..Self::default() }
    }

    fn upload(&mut self, table: &PageTable, dirty: &[usize]) {
        if self.mirror.len() != table.data().len() {
            self.mirror = table.data().to_vec();
        }
        let (rows, pages) = (table.rows(), table.max_pages());
        for &row in dirty {
            for l in 0..table.layers() {
                let start = (l * rows + row) * pages;
                self.mirror[start..start + pages].copy_from_slice(table.entries(l, row));
            }
        }
        self.rows_uploaded += dirty.len() as u64;
    }
}

impl Backend for NoopBackend {
    fn prefill(&mut self, input: &PrefillInput<'_>, out: &mut Vec<PrefillResult>) -> Result<(), BackendError> {
        self.upload(input.table, input.dirty_rows);
        if input.layers.is_none_or(|s| s.last) {
            out.extend(input.chunks.iter().map(|c| Ok(c.last.then(|| Sampled::token(self.token)))));
        }
        Ok(())
    }

    fn decode(&mut self, input: &DecodeInput<'_>, out: &mut Vec<Sampled>) -> Result<(), BackendError> {
        self.upload(input.table, input.dirty_rows);
        out.extend(input.rows.iter().map(|_| Sampled::token(self.token)));
        Ok(())
    }
}
