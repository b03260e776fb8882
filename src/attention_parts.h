/* How many parts the attention backward's dK/dV pass splits each kv group's query heads into
 * (cuda/attention_tma_bwd.cu). The pass has a block per (batch, kv head, 128 keys), and a block
 * walks every query head of its group over the query tiles at or after its keys: the first key
 * tile has S/128 times the last one's work. With few blocks the pass waits on the heaviest:
 * Qwen3-235B-A22B's 4 kv heads at micro-batch 1 and seq 4096 make 128 blocks for 132 SMs, each
 * over 16 query heads. In parts, a block takes group/parts of the heads and writes its fp32 sums,
 * which a last kernel adds in part order (deterministic; other bits than one part). Included by
 * the launcher and by memory_estimate.c, so that `plan` counts the parts' memory. */
#ifndef MT_ATTENTION_PARTS_H
#define MT_ATTENTION_PARTS_H

#include <stddef.h>

/* fewer blocks than this get parts (doubling while the group divides) */
enum { ATTN_DKDV_MIN_BLOCKS = 256 };

static inline int attn_dkdv_parts(long long B, long long S, int Hq, int Hkv)
{
    const long long blocks = B * Hkv * ((S + 127) / 128);
    const int group = Hkv > 0 ? Hq / Hkv : 1;
    int parts = 1;
    while (blocks > 0 && blocks * parts < ATTN_DKDV_MIN_BLOCKS && group % (2 * parts) == 0) parts *= 2;
    return parts;
}

/* the parts' fp32 sums of dK and dV: [2][parts][B][S][Hkv·D], none for one part */
static inline double attn_dkdv_part_bytes(long long B, long long S, int Hkv, int D, int parts)
{
    return parts > 1 ? 2.0 * parts * (double)B * (double)S * Hkv * D * 4 : 0;
}

#endif
