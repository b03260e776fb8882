/* Internal to the tensor-core attention, host side: the shape checks and the scale that the
 * forward (attention_tc_fwd.cu) and backward (attention_tc_bwd.cu) launchers share, and those two
 * launchers, which the entry points in attention_tc.cu call. The device helpers are in
 * attention_tc_common.cuh. */
#ifndef MT_CUDA_ATTENTION_TC_LAUNCH_CUH
#define MT_CUDA_ATTENTION_TC_LAUNCH_CUH

#include "attention_tc_common.cuh"

namespace {

/* The same fp32 scale as attention.cu and the CPU reference: head_dim ** -0.5 in double. */
inline float tc_scale(int D) { return (float)(1.0 / sqrt((double)D)); }

inline bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* Shapes and pointers these kernels take; anything else goes to attention.cu. */
inline bool tc_handles(int B, int S, int Hq, int Hkv, int D, const void *const *ptrs, int nptr)
{
    if (!g_cuda.ready) return false;
    if (D != 64 && D != 128) return false;
    if (B < 0 || S < 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv != 0) return false;
    /* grid limits: y counts tiles (<= 65535), x counts (batch, head) pairs */
    if ((S + TC_BC - 1) / TC_BC > 65535 || (long long)B * Hq > 0x7fffffffLL) return false;
    for (int i = 0; i < nptr; i++)
        if (!aligned16(ptrs[i])) return false;
    return true;
}

} /* namespace */

/* The forward with optional document ids (seg [B,S] or nullptr); false when the case is not one
 * the tensor-core kernels handle. */
bool tc_forward(void *out, float *lse, const void *q, const void *k, const void *v, int B, int S,
                int Hq, int Hkv, int D, const int32_t *seg);
/* The backward with optional document ids (seg [B,S] or nullptr: then the mma.sync kernels);
 * work (work_bytes, may be null) is memory the caller lends for the stored dS (ATTN_BWD_DS), used
 * when large enough instead of the backend's own scratch. */
bool tc_backward(void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                 const void *v, const void *out, const float *lse, int B, int S, int Hq, int Hkv,
                 int D, const int32_t *seg, void *work, size_t work_bytes);

#endif
