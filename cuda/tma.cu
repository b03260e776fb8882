/* The tensor-map encoder behind tma.cuh: cuTensorMapEncodeTiled through the runtime's driver entry
 * point (no link against libcuda). */
#include "tma.cuh"

static PFN_cuTensorMapEncodeTiled_v12000 encode_tiled()
{
    static PFN_cuTensorMapEncodeTiled_v12000 fn;
    if (!fn) {
        void *ptr = NULL;
        cudaDriverEntryPointQueryResult q;
        CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                    cudaEnableDefault, &q));
        MT_CHECK(q == cudaDriverEntryPointSuccess && ptr,
                 "the CUDA driver has no cuTensorMapEncodeTiled (needed by the Hopper kernels)");
        fn = (PFN_cuTensorMapEncodeTiled_v12000)ptr;
    }
    return fn;
}

static void make_map(CUtensorMap *m, CUtensorMapDataType type, const void *base, int rank,
                     const cuuint64_t *dims, const cuuint64_t *strides, const cuuint32_t *box,
                     const char *what)
{
    const cuuint32_t elem_strides[3] = {1, 1, 1};
    const CUresult r = encode_tiled()(m, type, (cuuint32_t)rank, const_cast<void *>(base), dims, strides,
                                      box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    MT_CHECK(r == CUDA_SUCCESS, "%s: cuTensorMapEncodeTiled failed (CUresult %d)", what, (int)r);
}

void tma_make_map(CUtensorMap *m, const void *base, int rank, const cuuint64_t *dims,
                  const cuuint64_t *strides, const cuuint32_t *box, const char *what)
{
    make_map(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, base, rank, dims, strides, box, what);
}

void tma_make_map_f32(CUtensorMap *m, const void *base, int rank, const cuuint64_t *dims,
                      const cuuint64_t *strides, const cuuint32_t *box, const char *what)
{
    make_map(m, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, base, rank, dims, strides, box, what);
}
