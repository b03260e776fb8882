/* train.master_weights: split. The fp32 master held as its compute copy (the high 16 bits, a bf16)
 * and a second 16-bit half, so that the pair is the same 32 bits as an fp32 master while the
 * compute copy costs nothing beside it (2 bytes a parameter less, and 2 fewer moved by AdamW).
 *
 * hi = (bits + 0x8000) >> 16 rounds the master half away from zero in its bit pattern (bf16's
 * round to nearest, but ties away from zero instead of to even), which keeps lo = bits - (hi << 16)
 * within int16; with ties to even a tie could need +32768. So the compute copy differs from a
 * nearest-even cast of the same master only where the low 16 bits are exactly 0x8000. The CPU
 * backend, the CUDA kernels and the host conversions all use these. */
#ifndef MT_MASTER_SPLIT_H
#define MT_MASTER_SPLIT_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define MT_HD __host__ __device__ __forceinline__
#else
#define MT_HD static inline
#endif

MT_HD uint16_t mt_master_hi_bits(uint32_t bits) { return (uint16_t)((bits + 0x8000u) >> 16); }
MT_HD uint16_t mt_master_lo_bits(uint32_t bits, uint16_t hi) { return (uint16_t)(bits - ((uint32_t)hi << 16)); }
MT_HD uint32_t mt_master_bits(uint16_t hi, uint16_t lo)
{
    return ((uint32_t)hi << 16) + (uint32_t)(int32_t)(int16_t)lo;
}

#ifndef __CUDACC__
static inline void mt_master_split(float x, uint16_t *hi, uint16_t *lo)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    *hi = mt_master_hi_bits(u);
    *lo = mt_master_lo_bits(u, *hi);
}
static inline float mt_master_join(uint16_t hi, uint16_t lo)
{
    const uint32_t u = mt_master_bits(hi, lo);
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}
#endif

#undef MT_HD
#endif
