//! The one error type of the KV layer: every misuse by a caller is a value, never a panic, so the
//! scheduler can react (preempt, reject) instead of taking the engine down.

use super::pool::BlockId;
use super::SeqId;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("out of KV blocks: {needed} needed, {free} free")]
    OutOfBlocks { needed: usize, free: usize },
    #[error("KV block {0} released more often than it was retained")]
    DoubleFree(BlockId),
    #[error("KV block {block} does not exist (the pool has {num_blocks})")]
    NoSuchBlock { block: BlockId, num_blocks: usize },
    #[error("KV block {0} already carries a prefix-cache key")]
    AlreadyTagged(BlockId),
    #[error("sequence {0} is not admitted")]
    UnknownSequence(SeqId),
    #[error("sequence {0} is already admitted")]
    DuplicateSequence(SeqId),
    #[error("sequence {seq} holds {len} tokens and cannot shrink to {new_len}; release it instead")]
    Shrink { seq: SeqId, len: usize, new_len: usize },
    #[error("layer {layer} does not exist (the model has {num_layers})")]
    NoSuchLayer { layer: usize, num_layers: usize },
    #[error("a page-table row of {max_pages} pages cannot hold a sequence of {pages} pages")]
    RowTooShort { pages: usize, max_pages: usize },
    #[error("page-table buffer holds {got} entries; {expected} expected")]
    BufferSize { expected: usize, got: usize },
    #[error("invalid KV configuration: {0}")]
    Config(String),
}
