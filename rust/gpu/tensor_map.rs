//! Bulk-tensor-copy descriptors (CUtensorMap) of the weight matrices and the KV pools: the
//! megakernel's producer warp copies a ring stage of a matrix (MK_STAGE_BOXES tiles of
//! MK_STAGE_ROWS x MK_STAGE_COLS side by side along k) with one instruction, and a page of one KV
//! head with two, which needs each tensor described to the copy engine once, on the host.

use cudarc::driver::sys;

use super::GpuError;
use crate::abi::{KV_BOX_COLS, STAGE_BOXES, STAGE_COLS, STAGE_ROWS, TENSOR_MAP_BYTES, WEIGHT_SWIZZLE};

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

/// Boxes of one copy of a matrix of `cols` columns (the kernel's `stage_depth`): in the swizzled
/// variant where `cols` is whole boxes, its map is the 3-D view [cols / box][rows][box] and a
/// stage is one copy of this many boxes; 0 otherwise (a 2-D map, a copy per box).
pub fn stage_depth(cols: u64) -> u32 {
    let box_cols = u64::from(stage_cols(cols));
    if WEIGHT_SWIZZLE && cols % box_cols == 0 {
        (cols / box_cols).min(u64::from(STAGE_BOXES)) as u32
    } else {
        0
    }
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

/// A weight matrix's map: boxes of one stage's rows, dense, or in the swizzled build variant 64
/// columns in the 128-byte swizzle (whole boxes only).
fn check_weights(m: &MatrixSpec) -> Result<sys::CUtensorMapSwizzle, GpuError> {
    check(m)?;
    if !WEIGHT_SWIZZLE {
        return Ok(sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE);
    }
    if m.cols % u64::from(STAGE_COLS) != 0 {
        let why = format!("the swizzled build needs cols a multiple of {STAGE_COLS}");
        return Err(GpuError::InvalidArgument(format!("tensor map of {m:?}: {why}")));
    }
    Ok(sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B)
}

/// The encoded maps of `matrices`, TENSOR_MAP_BYTES each, in order (zeros for address 0), each
/// box one ring stage's copy (`stage_depth`). Needs the CUDA driver, not a context.
pub fn encode(matrices: &[MatrixSpec]) -> Result<Vec<u8>, GpuError> {
    let mut out = vec![0u8; matrices.len() * TENSOR_MAP_BYTES];
    for (m, bytes) in matrices.iter().zip(out.chunks_exact_mut(TENSOR_MAP_BYTES)) {
        if m.address != 0 {
            let swizzle = check_weights(m)?;
            let box_cols = stage_cols(m.cols);
            let box_len = u64::from(box_cols);
            match stage_depth(m.cols) {
                0 => encode_one(m, &[m.cols, m.rows], &[m.cols * 2], &[box_cols, STAGE_ROWS], swizzle, bytes)?,
                depth => {
                    // Box b of a row sits b * box columns on: the third dimension's stride.
                    let dims = [box_len, m.rows, m.cols / box_len];
                    let boxes = [box_cols, STAGE_ROWS, depth];
                    encode_one(m, &dims, &[m.cols * 2, box_len * 2], &boxes, swizzle, bytes)?
                }
            }
        }
    }
    Ok(out)
}

/// The maps of the K and V pools (`MkStepArgs.kv_maps`), each `rows` (blocks x page) by `cols`
/// (kv_heads x head_dim) bf16: boxes of one page's rows by MK_KV_BOX_COLS columns, 128-byte
/// swizzled (the kernel's `SwizzledKv` reads that layout).
pub fn encode_kv(k: u64, v: u64, rows: u64, cols: u64) -> Result<Vec<u8>, GpuError> {
    let mut out = vec![0u8; 2 * TENSOR_MAP_BYTES];
    for (address, bytes) in [k, v].into_iter().zip(out.chunks_exact_mut(TENSOR_MAP_BYTES)) {
        let m = MatrixSpec { address, rows, cols };
        check(&m)?;
        if cols % KV_BOX_COLS as u64 != 0 || rows % crate::kv::PAGE_SIZE as u64 != 0 {
            return Err(GpuError::InvalidArgument(format!(
                "KV pool map of {m:?}: cols must be a multiple of {KV_BOX_COLS} and rows of the page size"
            )));
        }
        let boxes = [KV_BOX_COLS, crate::kv::PAGE_SIZE as u32];
        let swizzle = sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B;
        encode_one(&m, &[cols, rows], &[cols * 2], &boxes, swizzle, bytes)?;
    }
    Ok(out)
}

/// Encodes the map of the bf16 tensor at `m.address` (`m` names it in errors) of sizes `dims`
/// (innermost first), byte strides `strides` of the outer dimensions and boxes of `boxes` into
/// `bytes`.
fn encode_one(
    m: &MatrixSpec,
    dims: &[u64],
    strides: &[u64],
    boxes: &[u32],
    swizzle: sys::CUtensorMapSwizzle,
    bytes: &mut [u8],
) -> Result<(), GpuError> {
    assert!(dims.len() == boxes.len() && strides.len() + 1 == dims.len(), "a map's rank is one length");
    // SAFETY: only tries to dlopen libcuda.
    if !unsafe { sys::is_culib_present() } {
        return Err(GpuError::NoDriver);
    }
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    let element_strides = [1u32; 3];
    assert!(dims.len() <= element_strides.len(), "maps of rank 2 and 3 only");
    // SAFETY: every pointer is to a live local array of the rank the call is told; the address
    // is only recorded in the map, never dereferenced here.
    let status = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            dims.len() as u32,
            m.address as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
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
    Ok(())
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
    fn a_swizzled_matrix_of_whole_boxes_is_copied_a_stage_at_a_time() {
        let box_cols = u64::from(STAGE_COLS);
        let whole = |boxes: u32| if WEIGHT_SWIZZLE { boxes } else { 0 };
        assert_eq!(stage_depth(32 * box_cols), whole(STAGE_BOXES));
        assert_eq!(stage_depth(box_cols), whole(1));
        assert_eq!(stage_depth(2 * box_cols), whole(2));
        assert_eq!(stage_depth(box_cols + 32), 0, "a row that ends inside a box: a copy per box");
        if unsafe { sys::is_culib_present() } {
            for cols in [8 * box_cols, box_cols + 32, 64] {
                let m = MatrixSpec { address: 1 << 20, rows: 40, cols };
                if check_weights(&m).is_ok() {
                    let map = encode(&[m]).unwrap();
                    assert_ne!(map, vec![0u8; TENSOR_MAP_BYTES], "{m:?}");
                }
            }
        }
    }

    #[test]
    fn the_swizzled_build_takes_whole_boxes_only() {
        let m = MatrixSpec { address: 256, rows: 16, cols: 96 };
        assert_eq!(check_weights(&m).is_ok(), !WEIGHT_SWIZZLE);
        let whole = MatrixSpec { cols: 128, ..m };
        let swizzle = check_weights(&whole).unwrap();
        assert_eq!(swizzle == sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B, WEIGHT_SWIZZLE);
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
    fn kv_pools_of_a_wrong_shape_are_refused() {
        let (k, v) = (1 << 20, 1 << 21);
        for (rows, cols) in [(64, 96), (100, 512), (0, 512)] {
            assert!(encode_kv(k, v, rows, cols).is_err(), "{rows} x {cols}");
        }
        assert!(encode_kv(8, v, 64, 512).is_err(), "a misaligned pool");
        if unsafe { sys::is_culib_present() } {
            let maps = encode_kv(k, v, 64 * 10, 512).unwrap();
            assert_eq!(maps.len(), 2 * TENSOR_MAP_BYTES);
            assert_ne!(maps[..TENSOR_MAP_BYTES], maps[TENSOR_MAP_BYTES..], "K and V maps differ");
        }
    }

    #[test]
    fn empty_entries_encode_to_zeros_and_need_no_driver_call() {
        let out = encode(&[MatrixSpec { address: 0, rows: 0, cols: 0 }]).unwrap();
        assert_eq!(out, vec![0u8; TENSOR_MAP_BYTES]);
    }
}
