//! The ABI's layout as nvcc compiled it (cuda/abi_probe.cu's `mk_abi_layout`) against the Rust
//! side's: `crate::abi`'s structs and constants, the task words of `crate::graph::task`, the page
//! size.

use crate::abi::*;

/// The values `mk_abi_layout` in cuda/abi_probe.cu holds, in its order, computed on the Rust side.
pub fn expected_probe_layout() -> Vec<(&'static str, u64)> {
    use std::mem::{offset_of, size_of};
    let mut out = vec![
        ("MK_ABI_VERSION", ABI_VERSION),
        ("MK_STEP_SMEM_BYTES", STEP_SMEM_BYTES as u64),
        ("MK_STEP_THREADS", STEP_THREADS as u64),
        ("sizeof(MkTask)", size_of::<crate::graph::task::MkTask>() as u64),
        ("MkTask.arg", offset_of!(crate::graph::task::MkTask, arg) as u64),
        ("sizeof(MkStepArgs)", size_of::<MkStepArgs>() as u64),
    ];
    out.extend(MkStepArgs::layout().into_iter().map(|(name, off, _)| (name, off as u64)));
    out.push(("sizeof(MkTraceEntry)", TRACE_ENTRY_BYTES as u64));
    out.push(("MK_TRACE_MARKED", u64::from(TRACE_MARKED)));
    out.push(("MK_LEDGER_STAGES", LEDGER_STAGES as u64));
    out.push(("sizeof(MkRowSample)", size_of::<MkRowSample>() as u64));
    out.extend(MkRowSample::layout().into_iter().map(|(name, off, _)| (name, off as u64)));
    out.push(("MK_STEP_MAX_K", STEP_MAX_K as u64));
    out.push(("MK_NARROW_ROWS", NARROW_ROWS as u64));
    out.push(("MK_WIDE_ROWS", WIDE_ROWS as u64));
    out.push(("MK_STEP_MAX_ROWS", STEP_MAX_ROWS as u64));
    out.push(("MK_GEMV_MAX_GROUPS", GEMV_MAX_GROUPS as u64));
    out.push(("MK_STEP_HEAD_DIM", STEP_HEAD_DIM as u64));
    out.push(("MK_STEP_MAX_GROUP", STEP_MAX_GROUP as u64));
    out.push(("MK_STEP_MAX_TOP_K", STEP_MAX_TOP_K as u64));
    out.push(("MK_STEP_MAX_EXPERTS", STEP_MAX_EXPERTS as u64));
    out.push(("MK_STAGE_ROWS", STAGE_ROWS as u64));
    out.push(("MK_STAGE_COLS", STAGE_COLS as u64));
    out.push(("MK_STAGE_BOXES", u64::from(STAGE_BOXES)));
    out.push(("MK_TENSOR_MAP_BYTES", TENSOR_MAP_BYTES as u64));
    out.push(("MK_KV_BOX_COLS", KV_BOX_COLS as u64));
    out.push(("MK_LW_COUNT", LAYER_WEIGHT_COUNT as u64));
    out.extend(LAYER_WEIGHTS.iter().enumerate().map(|(i, name)| (*name, i as u64)));
    use crate::graph::task::{Matrix, Op, COUNTERS_PER_LAYER, TASK_WORDS};
    out.push(("MK_COUNTERS_PER_LAYER", COUNTERS_PER_LAYER as u64));
    out.push(("MK_TASK_WORDS", TASK_WORDS as u64));
    out.push(("MK_PAGE_SIZE", crate::kv::PAGE_SIZE as u64));
    out.extend(Op::NAMED.into_iter().map(|(name, op)| (name, op as i32 as u64)));
    out.extend(Matrix::NAMED.into_iter().map(|(name, m)| (name, m as i32 as u64)));
    use crate::graph::task::Counter;
    for (name, c) in [
        ("MK_CTR_TOPK", Counter::TopK),
        ("MK_CTR_UP_CLAIM", Counter::UpClaim),
        ("MK_CTR_DOWN_CLAIM", Counter::DownClaim),
        ("MK_CTR_ROUTER", Counter::Router),
    ] {
        out.push((name, c as u64));
    }
    out.push(("MK_ARG_ROUTERS", crate::graph::task::ARG_ROUTERS as u64));
    out.push(("MK_WEIGHT_SWIZZLE", u64::from(WEIGHT_SWIZZLE)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use object::{Object, ObjectSection, ObjectSymbol};

    /// Reads the `u64` array `symbol` out of a cubin (an ELF file) without a GPU.
    fn read_u64_symbol(cubin: &[u8], symbol: &str) -> Vec<u64> {
        let elf = object::File::parse(cubin).expect("cubin is ELF");
        let sym = elf.symbols().find(|s| s.name() == Ok(symbol)).unwrap_or_else(|| panic!("{symbol} not in cubin"));
        let section = elf.section_by_index(sym.section_index().expect("defined symbol")).unwrap();
        let data = section.data().unwrap();
        let start = (sym.address() - section.address()) as usize;
        data[start..start + sym.size() as usize]
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn probe_cubin() -> &'static [u8] {
        crate::gpu::cubin("abi_probe").expect("abi_probe cubin embedded")
    }

    #[test]
    fn abi_layout_matches_nvcc() {
        let compiled = read_u64_symbol(probe_cubin(), "mk_abi_layout");
        let expected = expected_probe_layout();
        assert_eq!(compiled.len(), expected.len(), "probe table and Rust list differ in length");
        for ((name, want), got) in expected.iter().zip(&compiled) {
            assert_eq!(got, want, "{name}: nvcc compiled {got}, Rust mirror has {want}");
        }
    }

    #[test]
    fn probe_reader_sees_a_wrong_layout() {
        // The comparison must be able to fail: shift one field and it has to differ.
        let compiled = read_u64_symbol(probe_cubin(), "mk_abi_layout");
        let mut wrong = expected_probe_layout();
        wrong[4].1 += 4;
        assert!(wrong.iter().zip(&compiled).any(|((_, w), g)| w != g));
    }
}
