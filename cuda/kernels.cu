// Standalone kernels, launched one at a time from Rust through the driver API. The decode
// megakernel (megakernel.cu) reuses their bodies from ops/.
#include "abi.h"
#include "ops/add_rmsnorm.cuh"

// One block per row; 256 threads cover rows of up to 8192 values.
extern "C" __global__ void __launch_bounds__(256) mk_add_rmsnorm(const MkAddRmsnormArgs args) {
    __shared__ float scratch[32];
    if (blockIdx.x < args.rows) mk::add_rmsnorm_row(args, blockIdx.x, scratch);
}
