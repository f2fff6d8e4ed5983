//! Bulk-tensor-copy descriptors (CUtensorMap) of the weight matrices: the megakernel's producer
//! warp copies one MK_STAGE_ROWS x MK_STAGE_COLS tile of a matrix per ring stage with one
//! instruction, which needs the matrix described to the copy engine once, on the host.

use cudarc::driver::sys;

use super::abi::{STAGE_COLS, STAGE_ROWS, TENSOR_MAP_BYTES};
use super::GpuError;

/// One weight matrix to describe: the device address of a row-major bf16 [rows, cols] tensor
/// (nn.Linear layout), or address 0 for an empty table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatrixSpec {
    pub address: u64,
    pub rows: u64,
    pub cols: u64,
}

/// Columns of a stage (the box's inner size) for rows of `cols` values.
pub fn stage_cols(cols: u64) -> u32 {
    cols.min(STAGE_COLS as u64) as u32
}

fn check(m: &MatrixSpec) -> Result<(), GpuError> {
    let bad = |why: &str| Err(GpuError::InvalidArgument(format!("tensor map of {m:?}: {why}")));
    if m.address % 16 != 0 {
        return bad("the address must be 16-byte aligned");
    }
    if m.rows == 0 || m.cols == 0 || m.cols % 32 != 0 {
        return bad("rows must be > 0 and cols a positive multiple of 32");
    }
    if m.rows >= 1 << 31 || m.cols >= 1 << 31 {
        return bad("dimensions must be below 2^31");
    }
    Ok(())
}

/// The encoded maps of `matrices`, TENSOR_MAP_BYTES each, in order (zeros for address 0).
/// Needs the CUDA driver, not a context.
pub fn encode(matrices: &[MatrixSpec]) -> Result<Vec<u8>, GpuError> {
    // SAFETY: only tries to dlopen libcuda.
    if !unsafe { sys::is_culib_present() } {
        return Err(GpuError::NoDriver);
    }
    let mut out = vec![0u8; matrices.len() * TENSOR_MAP_BYTES];
    for (m, bytes) in matrices.iter().zip(out.chunks_exact_mut(TENSOR_MAP_BYTES)) {
        if m.address == 0 {
            continue;
        }
        check(m)?;
        let mut map = sys::CUtensorMap { opaque: [0; 16] };
        let dims = [m.cols, m.rows];
        let strides = [m.cols * 2];
        let boxes = [stage_cols(m.cols), STAGE_ROWS];
        let element_strides = [1u32, 1];
        // SAFETY: every pointer is to a live local array of the rank the call is told; the
        // address is only recorded in the map, never dereferenced here.
        let status = unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                2,
                m.address as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                element_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        if status != sys::CUresult::CUDA_SUCCESS {
            return Err(GpuError::InvalidArgument(format!("cuTensorMapEncodeTiled({m:?}) failed: {status:?}")));
        }
        for (i, word) in map.opaque.iter().enumerate() {
            bytes[8 * i..8 * i + 8].copy_from_slice(&word.to_le_bytes());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_columns_are_capped_by_the_box() {
        assert_eq!(stage_cols(2048), STAGE_COLS);
        assert_eq!(stage_cols(64), 64);
    }

    #[test]
    fn bad_matrices_are_refused_before_the_driver() {
        let ok = MatrixSpec { address: 1 << 20, rows: 16, cols: 2048 };
        assert!(check(&ok).is_ok());
        for bad in [
            MatrixSpec { address: 8, ..ok },
            MatrixSpec { rows: 0, ..ok },
            MatrixSpec { cols: 100, ..ok },
            MatrixSpec { cols: 1 << 31, ..ok },
        ] {
            assert!(check(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn empty_entries_encode_to_zeros_and_need_no_driver_call() {
        if !unsafe { sys::is_culib_present() } {
            assert!(matches!(encode(&[]), Err(GpuError::NoDriver)));
            return;
        }
        let out = encode(&[MatrixSpec { address: 0, rows: 0, cols: 0 }]).unwrap();
        assert_eq!(out, vec![0u8; TENSOR_MAP_BYTES]);
    }
}
