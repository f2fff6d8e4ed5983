//! Admission: the head of the queue joins the batch when a row is free and its blocks are there.

use super::{Phase, Scheduler};

impl Scheduler {
    /// Admits waiting requests in arrival order (never skipping the head) while a row is free,
    /// no preemption hold is in force, and the head's prefill fits beside what is promised.
    /// Returns how many joined. A cached prefix is attached here, so its tokens are not prefilled.
    pub fn admit(&mut self) -> usize {
        let mut admitted = 0;
        while let Some(head) = self.waiting.front() {
            if self.order.len() == self.cfg.max_batch {
                break;
            }
            if let Some(at) = self.hold {
                if self.left == at && !self.order.is_empty() {
                    break;
                }
                self.hold = None;
            }
            let need = self.kv.prefill_blocks_needed(head.tokens.len(), self.cfg.prefill_chunk);
            if need + self.promised() > self.kv.free_blocks() {
                break;
            }
            let mut seq = self.waiting.pop_front().expect("front exists");
            let row = self.rows.iter().position(Option::is_none).expect("a row is free below max_batch");
            let attached = self.kv.admit(seq.id, &seq.tokens).expect("a waiting sequence is not admitted");
            self.table.sync(row, self.kv.block_table(seq.id).expect("just admitted")).expect("row fits max_context");
            self.mark_dirty(row);
            if seq.fresh {
                seq.fresh = false;
                seq.cached = Some(attached);
                seq.queued = Some(seq.submitted.elapsed().as_secs_f64());
                self.dequeued += 1;
                self.stats.prompt_tokens += seq.prompt_len as u64;
            }
            seq.computed = attached;
            seq.phase = Phase::Prefill { target: seq.tokens.len() };
            self.rows[row] = Some(seq);
            self.order.push(row);
            admitted += 1;
        }
        admitted
    }

    /// Blocks that live sequences will still take without anything new joining: the rest of
    /// each prefill, and the next page of every decoding sequence on every layer.
    fn promised(&self) -> usize {
        let layers = self.kv.geometry().num_layers();
        self.order
            .iter()
            .filter_map(|&r| self.rows[r].as_ref())
            .map(|s| match s.phase {
                Phase::Prefill { target } => {
                    let held = self.kv.block_table(s.id).map_or(0, |t| t.blocks().count());
                    self.kv.prefill_blocks_needed(target, self.cfg.prefill_chunk).saturating_sub(held)
                }
                _ => layers,
            })
            .sum()
    }
}
