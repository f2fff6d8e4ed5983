//! Rust mirror of the task ABI in `cuda/abi.h` (MkTask, MkOp, MkMatrix, MkCounter).

/// `MK_NO_COUNTER`: a task that waits on, or signals, nothing.
pub const NO_COUNTER: i32 = -1;
/// `MK_COUNTERS_PER_LAYER`.
pub const COUNTERS_PER_LAYER: usize = 11;
/// `MK_TASK_WORDS`: int32 words of one task, and the word that holds `arg[0]`.
pub const TASK_WORDS: usize = 16;
pub const TASK_ARG_WORD: usize = 7;
/// `MK_ARG_ROUTERS`: the arg word of an expert task (GEMV of an expert matrix, or claim) that
/// holds the layer's router tasks when its block routes for itself (local routing), else 0.
pub const ARG_ROUTERS: usize = 5;

/// See `MkTask` in cuda/abi.h: 16 int32 words.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MkTask {
    pub op: i32,
    pub layer: i32,
    pub wait0: i32,
    pub target0: i32,
    pub wait1: i32,
    pub target1: i32,
    pub signal: i32,
    pub arg: [i32; 9],
}

// SAFETY: plain-old-data with the C layout of MkTask.
unsafe impl cudarc::driver::DeviceRepr for MkTask {}
// SAFETY: all-zero words are a valid task (a NOP).
unsafe impl cudarc::driver::ValidAsZeroBits for MkTask {}

#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Nop = 0,
    Embed = 1,
    Gemv = 2,
    AttnSplit = 3,
    AttnCombine = 4,
    TopK = 5,
    ResidualNorm = 6,
    SamplePart = 7,
    SampleFinal = 8,
    ExpertClaim = 9,
}

impl Op {
    /// Every op with its name in cuda/abi.h (`MK_OP_<name>`), the names Python uses too.
    pub const NAMED: [(&'static str, Op); 10] = [
        ("NOP", Op::Nop),
        ("EMBED", Op::Embed),
        ("GEMV", Op::Gemv),
        ("ATTN_SPLIT", Op::AttnSplit),
        ("ATTN_COMBINE", Op::AttnCombine),
        ("TOPK", Op::TopK),
        ("RESIDUAL_NORM", Op::ResidualNorm),
        ("SAMPLE_PART", Op::SamplePart),
        ("SAMPLE_FINAL", Op::SampleFinal),
        ("EXPERT_CLAIM", Op::ExpertClaim),
    ];

    pub fn from_i32(v: i32) -> Option<Op> {
        Op::NAMED.into_iter().map(|(_, op)| op).find(|op| *op as i32 == v)
    }
}

#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Matrix {
    Qkv = 0,
    O = 1,
    Router = 2,
    DenseGateUp = 3,
    DenseDown = 4,
    ExpertGateUp = 5,
    ExpertDown = 6,
    LmHead = 7,
}

impl Matrix {
    /// Every matrix with its name (cuda/abi.h `MK_MAT_<name>`; O is O_PROJ in Python).
    pub const NAMED: [(&'static str, Matrix); 8] = [
        ("QKV", Matrix::Qkv),
        ("O_PROJ", Matrix::O),
        ("ROUTER", Matrix::Router),
        ("DENSE_GATE_UP", Matrix::DenseGateUp),
        ("DENSE_DOWN", Matrix::DenseDown),
        ("EXPERT_GATE_UP", Matrix::ExpertGateUp),
        ("EXPERT_DOWN", Matrix::ExpertDown),
        ("LM_HEAD", Matrix::LmHead),
    ];

    pub fn from_i32(v: i32) -> Option<Matrix> {
        Matrix::NAMED.into_iter().map(|(_, m)| m).find(|m| *m as i32 == v)
    }
}

/// `MkCounter`: which of a layer's counters.
#[repr(usize)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    HReady = 0,
    Qkv = 1,
    AttnSplit = 2,
    Attn = 3,
    O = 4,
    Router = 5,
    TopK = 6,
    FfnUp = 7,
    FfnDown = 8,
    /// The claim queues' heads (Op::ExpertClaim): atomics, never waited on or signalled.
    UpClaim = 9,
    DownClaim = 10,
}

/// Counter index of `which` in `layer` (layer == num_layers is the final "layer").
pub fn counter(layer: usize, which: Counter) -> i32 {
    (layer * COUNTERS_PER_LAYER + which as usize) as i32
}

/// The logits and sampling counters live in the final "layer" (MK_CTR_LOGITS / MK_CTR_SAMPLE).
pub fn logits_counter(num_layers: usize) -> i32 {
    counter(num_layers, Counter::Qkv)
}
pub fn sample_counter(num_layers: usize) -> i32 {
    counter(num_layers, Counter::AttnSplit)
}

pub fn num_counters(num_layers: usize) -> usize {
    (num_layers + 1) * COUNTERS_PER_LAYER
}

impl MkTask {
    pub fn new(op: Op, layer: usize, args: &[i32]) -> MkTask {
        let mut arg = [0; 9];
        arg[..args.len()].copy_from_slice(args);
        MkTask {
            op: op as i32,
            layer: layer as i32,
            wait0: NO_COUNTER,
            target0: 0,
            wait1: NO_COUNTER,
            target1: 0,
            signal: NO_COUNTER,
            arg,
        }
    }

    pub fn op(&self) -> Op {
        Op::from_i32(self.op).expect("valid op")
    }

    pub fn signals(mut self, c: i32) -> MkTask {
        self.signal = c;
        self
    }

    /// Wait on counter `c`; `target` is filled in by the builder once all producers are known.
    pub fn waits(mut self, c: i32) -> MkTask {
        if self.wait0 == NO_COUNTER {
            self.wait0 = c;
        } else {
            assert_eq!(self.wait1, NO_COUNTER, "a task waits on at most two counters");
            self.wait1 = c;
        }
        self
    }

    pub fn waits_on(&self) -> impl Iterator<Item = (i32, i32)> {
        [(self.wait0, self.target0), (self.wait1, self.target1)].into_iter().filter(|(c, _)| *c != NO_COUNTER)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_is_sixteen_words() {
        assert_eq!(std::mem::size_of::<MkTask>(), 4 * TASK_WORDS);
        assert_eq!(std::mem::offset_of!(MkTask, arg), 4 * TASK_ARG_WORD);
    }

    #[test]
    fn enums_round_trip() {
        for v in 0..10 {
            assert_eq!(Op::from_i32(v).unwrap() as i32, v);
        }
        for v in 0..8 {
            assert_eq!(Matrix::from_i32(v).unwrap() as i32, v);
        }
        assert!(Op::from_i32(10).is_none() && Matrix::from_i32(8).is_none());
    }
}
