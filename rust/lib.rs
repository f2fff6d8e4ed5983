//! mk's control plane: everything the host does around the decode megakernel.
//!
//! The logic modules are plain Rust (tested with `cargo test`); the PyO3 surface lives in
//! `python` and is compiled only with the `python` feature (maturin turns it on).

pub mod abi;
pub mod engine;
pub mod gpu;
pub mod grammar;
pub mod graph;
pub mod kv;
pub mod sampling;
pub mod sched;
pub mod speculative;

#[cfg(feature = "python")]
mod python;
