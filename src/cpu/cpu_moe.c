/* The MoE data movement and expert compute on the CPU: row gather (dispatch), the weighted combine
 * back to tokens, and the grouped expert matmul (one dense matmul per expert's row range). */
#include "cpu/cpu_ops.h"
#include "cpu/cpu_dot.h"
#include "common.h"
#include "ops.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

/* in place: a token's k choices by ascending expert id, weights alongside */
static void sort_choices(int32_t *idx, float *w, int k)
{
    for (int j = 1; j < k; j++)
        for (int i = j; i > 0 && idx[i - 1] > idx[i]; i--) {
            int32_t ti = idx[i]; idx[i] = idx[i - 1]; idx[i - 1] = ti;
            float tw = w[i]; w[i] = w[i - 1]; w[i - 1] = tw;
        }
}

void cpu_moe_route_plan(int32_t *topk_idx, float *topk_w, int32_t *src_row, int32_t *slot_row,
                        int64_t *off, int T, int E, int k)
{
    int64_t *count = mt_calloc((size_t)E, sizeof *count);
    for (int t = 0; t < T; t++) {
        int32_t *idx = topk_idx + (size_t)t * k;
        sort_choices(idx, topk_w + (size_t)t * k, k);
        for (int j = 0; j < k; j++) {
            if (idx[j] == MT_NO_EXPERT) continue;
            MT_CHECK(idx[j] >= 0 && idx[j] < E, "router chose expert %d of %d", (int)idx[j], E);
            count[idx[j]]++;
        }
    }
    off[0] = 0;
    for (int e = 0; e < E; e++) off[e + 1] = off[e] + count[e];
    free(count);
    int64_t *fill = mt_malloc((size_t)E * sizeof *fill);
    memcpy(fill, off, (size_t)E * sizeof *fill);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            const int32_t e = topk_idx[(size_t)t * k + j];
            if (e == MT_NO_EXPERT) {
                slot_row[(size_t)t * k + j] = -1;
                continue;
            }
            int64_t row = fill[e]++;
            src_row[row] = t;
            slot_row[(size_t)t * k + j] = (int32_t)row;
        }
    free(fill);
}

void cpu_moe_pair_plan(int32_t *topk_idx, float *topk_w, int32_t *pair_tok, int32_t *tok_pair,
                       int32_t *meta_idx, float *meta_w, int32_t *w_map, int64_t *count_host,
                       int64_t *rows_host, int T, int ep, int n_local, int k, int block)
{
    const int E = ep * n_local;
    MT_CHECK(block == 0 || block >= T, "moe_pair_plan: blocks of %d pairs for %d tokens", block, T);
    int64_t *count = mt_calloc((size_t)ep, sizeof *count), *rows = mt_calloc((size_t)ep, sizeof *rows);
    for (int t = 0; t < T; t++) {
        int32_t *idx = topk_idx + (size_t)t * k;
        sort_choices(idx, topk_w + (size_t)t * k, k);
        for (int j = 0; j < k; j++) {
            MT_CHECK(idx[j] >= 0 && idx[j] < E, "router chose expert %d of %d", (int)idx[j], E);
            if (j == 0 || idx[j] / n_local != idx[j - 1] / n_local) count[idx[j] / n_local]++;
            rows[idx[j] / n_local]++;
        }
    }
    int64_t *fill = mt_malloc((size_t)ep * sizeof *fill);
    for (int d = 0, o = 0; d < ep; o += (int)count[d], d++) fill[d] = o;
    for (int d = 0; d < ep && block; d++) /* padding: no experts; its own token (0 past the tokens) */
        for (int64_t i = 0; i < block; i++) {
            const int64_t p = (int64_t)d * block + i;
            pair_tok[p] = i < T ? (int32_t)i : 0;
            for (int s = 0; s < k; s++) meta_idx[p * k + s] = MT_NO_EXPERT, meta_w[p * k + s] = 0.0f;
        }
    for (int t = 0; t < T; t++) {
        const int32_t *idx = topk_idx + (size_t)t * k;
        const float *w = topk_w + (size_t)t * k;
        for (int j0 = 0, j1; j0 < k; j0 = j1) {
            const int d = idx[j0] / n_local;
            for (j1 = j0 + 1; j1 < k && idx[j1] / n_local == d; j1++) {}
            const int64_t p = block ? (int64_t)d * block + t : fill[d]++;
            pair_tok[p] = t;
            for (int s = 0; s < k; s++) {
                const bool used = s < j1 - j0;
                meta_idx[p * k + s] = used ? idx[j0 + s] - d * n_local : MT_NO_EXPERT;
                meta_w[p * k + s] = used ? w[j0 + s] : 0.0f;
            }
            for (int j = j0; j < j1; j++) {
                tok_pair[(size_t)t * k + j] = j == j0 ? (int32_t)p : -1;
                w_map[(size_t)t * k + j] = (int32_t)(p * k + (j - j0));
            }
        }
    }
    if (count_host) memcpy(count_host, count, (size_t)ep * sizeof *count);
    if (rows_host) memcpy(rows_host, rows, (size_t)ep * sizeof *rows);
    free(fill), free(count), free(rows);
}

void cpu_moe_rows_cap(int64_t *off, int32_t *src_row, int32_t *slot_row, int64_t *need, int n_slots,
                      int n_exp, int64_t cap)
{
    if (off[n_exp] > need[0]) need[0] = off[n_exp];
    for (int64_t r = MT_MIN(off[n_exp], cap); r < cap; r++) src_row[r] = -1;
    if (off[n_exp] <= cap) return;
    need[1]++;
    for (int e = 0; e <= n_exp; e++) off[e] = MT_MIN(off[e], cap);
    for (int i = 0; i < n_slots; i++)
        if (slot_row[i] >= cap) slot_row[i] = -1;
}

/* the first row of [r0, r1) whose source is >= src (r1 if none): the sources ascend there */
static int64_t first_from(const int32_t *src_row, int64_t r0, int64_t r1, int64_t src)
{
    while (r0 < r1) {
        const int64_t mid = r0 + (r1 - r0) / 2;
        if (src_row[mid] < src) r0 = mid + 1;
        else r1 = mid;
    }
    return r0;
}

void cpu_moe_rows_split(int64_t *lo, int64_t *hi, const int64_t *off, const int32_t *src_row, int n_exp,
                        int64_t src_lo, int64_t src_hi)
{
    MT_CHECK(src_lo <= src_hi, "moe_rows_split: pairs [%lld, %lld)", (long long)src_lo, (long long)src_hi);
    for (int e = 0; e < n_exp; e++) {
        lo[e] = first_from(src_row, off[e], off[e + 1], src_lo);
        hi[e] = first_from(src_row, lo[e], off[e + 1], src_hi);
    }
    lo[n_exp] = hi[n_exp] = off[n_exp];
}

void cpu_gather_f32(float *out, const float *in, const int32_t *idx, int n)
{
    for (int i = 0; i < n; i++) {
        MT_CHECK(idx[i] >= 0, "gather_f32: negative index %d at %d", (int)idx[i], i);
        out[i] = in[idx[i]];
    }
}

void cpu_gather_rows(float *out, const float *in, const int32_t *idx, int R, int H)
{
    for (int r = 0; r < R; r++)
        if (idx[r] >= 0) memcpy(out + (size_t)r * H, in + (size_t)idx[r] * H, (size_t)H * sizeof(float));
}

void cpu_gather_rows_part(float *out, const float *in, const int32_t *idx, int R, int H, int lo, int hi, bool inside)
{
    MT_CHECK(lo <= hi, "gather_rows_part: empty range [%d, %d)", lo, hi);
    for (int r = 0; r < R; r++) {
        if (idx[r] < 0 || (idx[r] >= lo && idx[r] < hi) != inside) continue;
        memcpy(out + (size_t)r * H, in + (size_t)(idx[r] - (inside ? lo : 0)) * H, (size_t)H * sizeof(float));
    }
}

void cpu_dispatch_rows(float *out, const float *in, const int32_t *slot, int n, int k, int H)
{
    for (int i = 0; i < n; i++)
        for (int j = 0; j < k; j++) {
            const int32_t row = slot[(size_t)i * k + j];
            if (row >= 0) memcpy(out + (size_t)row * H, in + (size_t)i * H, (size_t)H * sizeof(float));
        }
}

void cpu_gather_rows_backward(float *din, const float *dout, const int32_t *idx, int R, int H)
{
    for (int r = 0; r < R; r++) {
        MT_CHECK(idx[r] >= 0, "gather_rows backward: negative index %d at row %d", (int)idx[r], r);
        float *d = din + (size_t)idx[r] * H;
        const float *g = dout + (size_t)r * H;
        for (int h = 0; h < H; h++) d[h] += g[h];
    }
}

void cpu_moe_combine_forward(float *out, const float *y, const int32_t *slot_row, const float *w,
                             int T, int k, int H)
{
    for (int t = 0; t < T; t++) {
        float *o = out + (size_t)t * H;
        memset(o, 0, (size_t)H * sizeof(float));
        for (int j = 0; j < k; j++) {
            const int32_t r = slot_row[(size_t)t * k + j];
            if (r < 0) continue; /* an empty slot */
            const float wj = w[(size_t)t * k + j];
            const float *yr = y + (size_t)r * H;
            for (int h = 0; h < H; h++) o[h] += wj * yr[h];
        }
    }
}

void cpu_moe_combine_backward(float *dy, float *dw, const float *dout, const float *y,
                              const int32_t *slot_row, const float *w, int T, int k, int H)
{
    for (int t = 0; t < T; t++) {
        const float *g = dout + (size_t)t * H;
        for (int j = 0; j < k; j++) {
            const int32_t r = slot_row[(size_t)t * k + j];
            if (r < 0) continue; /* an empty slot: neither dy nor dw */
            const float wj = w[(size_t)t * k + j];
            float *dyr = dy + (size_t)r * H;
            dw[(size_t)t * k + j] = cpu_dot(g, y + (size_t)r * H, H);
            for (int h = 0; h < H; h++) dyr[h] = wj * g[h];
        }
    }
}

static void check_offsets(const char *what, const int64_t *off, int n_exp)
{
    MT_CHECK(n_exp >= 0 && (n_exp == 0 || off[0] >= 0), "%s: bad expert count or first offset",
             what);
    for (int e = 0; e < n_exp; e++)
        MT_CHECK(off[e + 1] >= off[e], "%s: offsets decrease at expert %d (%lld > %lld)", what, e,
                 (long long)off[e], (long long)off[e + 1]);
}

void cpu_expert_matmul_forward(float *out, const float *in, const float *w, const int64_t *off,
                               const int64_t *end, int n_exp, int I, int O)
{
    check_offsets("expert_matmul", off, n_exp);
    for (int e = 0; e < n_exp; e++) {
        const int64_t r0 = off[e], n = (end ? end[e] : off[e + 1]) - off[e];
        MT_CHECK(n >= 0 && r0 + n <= off[e + 1], "expert_matmul: expert %d's rows end at %lld, outside [%lld, %lld]",
                 e, (long long)(r0 + n), (long long)r0, (long long)off[e + 1]);
        if (n == 0) continue;
        cpu_matmul_forward(out + r0 * O, in + r0 * I, w + (size_t)e * O * I, (int)n, I, O);
    }
}

void cpu_expert_matmul_backward(float *din, float *dw, const float *dout, const float *in,
                                const float *w, const int64_t *off, int n_exp, int I, int O)
{
    check_offsets("expert_matmul backward", off, n_exp);
    for (int e = 0; e < n_exp; e++) {
        const int64_t r0 = off[e], n = off[e + 1] - off[e];
        if (n == 0) continue;
        /* in is read only for dw, w only for din (either may be NULL when not) */
        cpu_matmul_backward(din ? din + r0 * I : NULL, dw ? dw + (size_t)e * O * I : NULL,
                            dout + r0 * O, in ? in + r0 * I : NULL, w ? w + (size_t)e * O * I : NULL,
                            (int)n, I, O, false);
    }
}
