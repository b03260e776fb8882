#include "profile.h"

#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "common.h"

static const struct backend *inner;
static struct backend wrapped;
static double acc[PROF_COUNT];
static double t_begin;

/* per op and shape key: where inside a category the time goes */
enum { MAX_OP_ROWS = 128 };
static struct op_row {
    const char *name;
    long key;
    double secs;
    int calls;
} rows[MAX_OP_ROWS];
static int n_rows;

static void add_op(const char *name, long key, double secs)
{
    for (int i = 0; i < n_rows; i++)
        if (rows[i].name == name && rows[i].key == key) {
            rows[i].secs += secs;
            rows[i].calls++;
            return;
        }
    if (n_rows < MAX_OP_ROWS) rows[n_rows++] = (struct op_row){name, key, secs, 1};
}

static void begin(void)
{
    inner->sync();
    t_begin = mt_now();
}

static void end(enum prof_cat c)
{
    inner->sync();
    acc[c] += mt_now() - t_begin;
}

static void end_op(enum prof_cat c, const char *name, long key)
{
    inner->sync();
    double dt = mt_now() - t_begin;
    acc[c] += dt;
    add_op(name, key, dt);
}

static void comm_begin(void) { begin(); }
/* op: the comm.h function that ran, e.g. "comm_all_to_all_inbox", a row of the per-op table */
static void comm_end(const char *op) { end_op(PROF_COMM, op, 0); }

/* One wrapper per op: W(op, category, key, (params), (args)) for void ops; key (an expression of
 * the params) separates calls of one op on different shapes in the per-op table. */
#define W(op, cat, key, params, args)  \
    static void p_##op params          \
    {                                  \
        begin();                       \
        inner->op args;                \
        end_op(cat, #op, (long)(key)); \
    }

W(zero, PROF_OTHER, 0, (void *p, size_t b), (p, b))
W(copy, PROF_OTHER, 0, (void *d, const void *s, size_t b), (d, s, b))
W(upload, PROF_OTHER, 0, (void *d, const void *s, size_t b), (d, s, b))
W(download, PROF_OTHER, 0, (void *d, const void *s, size_t b), (d, s, b))
W(cast_f32_to_x, PROF_OTHER, n, (void *o, const float *i, size_t n), (o, i, n))
W(cast_x_to_f32, PROF_OTHER, n, (float *o, const void *i, size_t n), (o, i, n))
W(add_inplace, PROF_OTHER, n, (void *y, const void *x, size_t n), (y, x, n))
W(scale_f32, PROF_OTHER, n, (float *x, size_t n, float s), (x, n, s))
W(add_f32, PROF_OTHER, n, (float *y, const float *x, size_t n), (y, x, n))
W(embedding_forward, PROF_OTHER, T, (void *o, const int32_t *ids, const void *w, int T, int H),
  (o, ids, w, T, H))
W(embedding_backward, PROF_OTHER, T, (float *dw, const void *d, const int32_t *ids, int T, int H),
  (dw, d, ids, T, H))
W(rmsnorm_forward, PROF_OTHER, C,
  (void *o, float *r, const void *i, const void *w, int N, int C, float eps), (o, r, i, w, N, C, eps))
W(rmsnorm_backward, PROF_OTHER, C,
  (void *di, float *dw, const void *d, const void *i, const void *w, const float *r, int N, int C,
   bool acc_),
  (di, dw, d, i, w, r, N, C, acc_))
W(matmul_forward, PROF_DENSE_GEMM, O, (void *o, const void *i, const void *w, int N, int I, int O),
  (o, i, w, N, I, O))
W(matmul_forward_residual, PROF_DENSE_GEMM, O,
  (void *o, const void *i, const void *w, const void *r, int N, int I, int O), (o, i, w, r, N, I, O))
W(matmul_backward, PROF_DENSE_GEMM, O,
  (void *di, float *dw, const void *d, const void *i, const void *w, int N, int I, int O, bool acc_),
  (di, dw, d, i, w, N, I, O, acc_))
W(matmul2_forward, PROF_DENSE_GEMM, O,
  (void *oa, void *ob, const void *i, const void *wa, const void *wb, int N, int I, int O),
  (oa, ob, i, wa, wb, N, I, O))
W(matmul2_backward, PROF_DENSE_GEMM, O,
  (void *di, float *dwa, float *dwb, const void *da, const void *db, const void *i, const void *wa,
   const void *wb, int N, int I, int O, bool acc_),
  (di, dwa, dwb, da, db, i, wa, wb, N, I, O, acc_))
W(router_matmul_forward, PROF_DENSE_GEMM, O,
  (float *o, const void *i, const void *w, int N, int I, int O), (o, i, w, N, I, O))
W(router_matmul_backward, PROF_DENSE_GEMM, O,
  (void *di, float *dw, const float *d, const void *i, const void *w, int N, int I, int O, bool acc_),
  (di, dw, d, i, w, N, I, O, acc_))
W(rope_forward, PROF_OTHER, nh,
  (void *o, const void *i, const int32_t *pos, int T, int nh, int D, float th),
  (o, i, pos, T, nh, D, th))
W(rope_backward, PROF_OTHER, nh,
  (void *o, const void *i, const int32_t *pos, int T, int nh, int D, float th),
  (o, i, pos, T, nh, D, th))
W(rmsnorm_rope_forward, PROF_OTHER, nh,
  (void *o, float *r, const void *i, const void *w, const int32_t *pos, int T, int nh, int D,
   float eps, float th),
  (o, r, i, w, pos, T, nh, D, eps, th))
W(rmsnorm_rope_backward, PROF_OTHER, nh,
  (void *di, float *dw, const void *d, const void *i, const void *w, const float *r,
   const int32_t *pos, int T, int nh, int D, float th),
  (di, dw, d, i, w, r, pos, T, nh, D, th))
W(attention_forward, PROF_ATTN, S,
  (void *o, float *lse, const void *q, const void *k, const void *v, int B, int S, int Hq, int Hkv,
   int D, const int32_t *seg),
  (o, lse, q, k, v, B, S, Hq, Hkv, D, seg))
W(attention_backward, PROF_ATTN, S,
  (void *dq, void *dk, void *dv, const void *d, const void *q, const void *k, const void *v,
   const void *o, const float *lse, int B, int S, int Hq, int Hkv, int D, const int32_t *seg,
   void *work, size_t work_bytes),
  (dq, dk, dv, d, q, k, v, o, lse, B, S, Hq, Hkv, D, seg, work, work_bytes))
W(router_forward, PROF_MOE_ROWS, E,
  (int32_t *ti, float *tw, float *p, const float *l, const float *b, int T, int E, int k,
   const struct router_opts *o),
  (ti, tw, p, l, b, T, E, k, o))
W(router_backward, PROF_MOE_ROWS, E,
  (float *dl, const float *dtw, const float *p, const int32_t *ti, const float *a, int T, int E,
   int k, const struct router_opts *o),
  (dl, dtw, p, ti, a, T, E, k, o))
W(router_gather_weights, PROF_MOE_ROWS, E,
  (float *tw, const float *p, const int32_t *ti, int T, int E, int k, const struct router_opts *o),
  (tw, p, ti, T, E, k, o))
W(aux_grad_from_stats, PROF_OTHER, E,
  (float *a, const float *s, int L, int E, double sc, double r), (a, s, L, E, sc, r))
W(router_stats, PROF_MOE_ROWS, E,
  (float *ps, float *c, const float *p, const int32_t *ti, int T, int E, int k),
  (ps, c, p, ti, T, E, k))
W(moe_route_plan, PROF_MOE_ROWS, E,
  (int32_t *ti, float *tw, int32_t *sr, int32_t *sl, int64_t *off, int T, int E, int k),
  (ti, tw, sr, sl, off, T, E, k))
W(moe_pair_plan, PROF_MOE_ROWS, ep,
  (int32_t *ti, float *tw, int32_t *pt, int32_t *tp, int32_t *mi, float *mw, int32_t *wm,
   int64_t *c, int64_t *rc, int T, int ep, int nl, int k, int blk),
  (ti, tw, pt, tp, mi, mw, wm, c, rc, T, ep, nl, k, blk))
W(moe_rows_cap, PROF_MOE_ROWS, E,
  (int64_t *off, int32_t *sr, int32_t *sl, int64_t *nm, int n, int E, int64_t cap), (off, sr, sl, nm, n, E, cap))
W(moe_rows_split, PROF_MOE_ROWS, 0,
  (int64_t *lo, int64_t *hi, const int64_t *off, const int32_t *sr, int n, int64_t a, int64_t b),
  (lo, hi, off, sr, n, a, b))
W(gather_f32, PROF_MOE_ROWS, 0, (float *o, const float *i, const int32_t *idx, int n), (o, i, idx, n))
W(gather_rows, PROF_MOE_ROWS, R, (void *o, const void *i, const int32_t *idx, int R, int H),
  (o, i, idx, R, H))
W(gather_rows_part, PROF_MOE_ROWS, R,
  (void *o, const void *i, const int32_t *idx, int R, int H, int lo, int hi, bool in), (o, i, idx, R, H, lo, hi, in))
W(dispatch_rows, PROF_MOE_ROWS, n, (void *o, const void *i, const int32_t *s, int n, int k, int H),
  (o, i, s, n, k, H))
W(gather_rows_backward, PROF_MOE_ROWS, R, (void *di, const void *d, const int32_t *idx, int R, int H),
  (di, d, idx, R, H))
W(moe_combine_forward, PROF_MOE_ROWS, H,
  (void *o, const void *y, const int32_t *s, const float *w, const void *r, int T, int k, int H),
  (o, y, s, w, r, T, k, H))
W(moe_combine_backward, PROF_MOE_ROWS, H,
  (void *dy, float *dw, const void *d, const void *y, const int32_t *s, const float *w, int T,
   int k, int H),
  (dy, dw, d, y, s, w, T, k, H))
W(expert_matmul_forward, PROF_EXPERT_GEMM, O,
  (void *o, const void *i, const void *w, const int64_t *off, const int64_t *end, int64_t R, int n, int I, int O),
  (o, i, w, off, end, R, n, I, O))
W(expert_matmul_backward, PROF_EXPERT_GEMM, O,
  (void *di, float *dw, const void *d, const void *i, const void *w, const int64_t *off, int64_t R,
   int n, int I, int O, bool ow),
  (di, dw, d, i, w, off, R, n, I, O, ow))
W(expert_matmul_wgrad_sets, PROF_EXPERT_GEMM, O,
  (float *dw, const struct expert_rows *sets, int ns, int n, int I, int O, bool ow, double *ss),
  (dw, sets, ns, n, I, O, ow, ss))
W(expert_matmul_wgrad_part, PROF_EXPERT_GEMM, O,
  (float *dw, const struct expert_rows *sets, int ns, int n, int I, int O, bool ow, int32_t *c,
   const struct exchange_arrival *u),
  (dw, sets, ns, n, I, O, ow, c, u))
W(swiglu_forward, PROF_OTHER, I, (void *o, const void *gu, int R, int I, const int64_t *n), (o, gu, R, I, n))
W(swiglu_backward, PROF_OTHER, I, (void *d, const void *o, const void *gu, int R, int I, const int64_t *n),
  (d, o, gu, R, I, n))
W(cross_entropy_forward, PROF_OTHER, V,
  (float *l, float *lse, const void *z, const int32_t *t, int N, int V), (l, lse, z, t, N, V))
W(cross_entropy_backward, PROF_OTHER, V,
  (void *d, const void *z, const float *lse, const int32_t *t, int N, int V, float s),
  (d, z, lse, t, N, V, s))
W(cross_entropy_fused, PROF_OTHER, V,
  (float *l, float *lse, void *z, const int32_t *t, int N, int V, float s), (l, lse, z, t, N, V, s))
W(adamw_update_m16, PROF_OPTIM, 0,
  (float *ms, void *p, const float *g, void *m, void *v, size_t n, float lr, float b1, float b2,
   float eps, float wd, int t, float gs),
  (ms, p, g, m, v, n, lr, b1, b2, eps, wd, t, gs))
W(adamw_update, PROF_OPTIM, 0,
  (float *ms, void *p, const float *g, float *m, float *v, size_t n, float lr, float b1, float b2,
   float eps, float wd, int t, float gs),
  (ms, p, g, m, v, n, lr, b1, b2, eps, wd, t, gs))
W(adamw_update_multi, PROF_OPTIM, 0,
  (const struct adamw_segment *sg, int n, size_t mb, float lr, float b1, float b2, float eps, int t,
   float gs),
  (sg, n, mb, lr, b1, b2, eps, t, gs))
#undef W

static double p_sumsq_f32(const float *x, size_t n)
{
    begin();
    double r = inner->sumsq_f32(x, n);
    end(PROF_OPTIM);
    return r;
}

const struct backend *profile_wrap(const struct backend *be)
{
    inner = be;
    wrapped = *be;
#define SET(op) wrapped.op = p_##op
    SET(zero); SET(copy); SET(upload); SET(download); SET(cast_f32_to_x); SET(cast_x_to_f32);
    SET(add_inplace); SET(scale_f32); SET(add_f32); SET(sumsq_f32); SET(embedding_forward);
    SET(embedding_backward); SET(rmsnorm_forward); SET(rmsnorm_backward); SET(matmul_forward);
    SET(matmul_forward_residual); SET(matmul_backward); SET(matmul2_forward); SET(matmul2_backward);
    SET(router_matmul_forward);
    SET(router_matmul_backward);
    SET(rope_forward); SET(rope_backward); SET(rmsnorm_rope_forward); SET(rmsnorm_rope_backward);
    SET(attention_forward);
    SET(attention_backward); SET(router_forward); SET(router_backward); SET(router_gather_weights);
    SET(router_stats); SET(aux_grad_from_stats);
    SET(moe_route_plan); SET(moe_pair_plan); SET(moe_rows_cap); SET(moe_rows_split); SET(gather_f32); SET(gather_rows); SET(gather_rows_part);
    SET(gather_rows_backward); SET(dispatch_rows); SET(moe_combine_forward);
    SET(moe_combine_backward); SET(expert_matmul_forward); SET(expert_matmul_backward); SET(expert_matmul_wgrad_sets);
    SET(expert_matmul_wgrad_part);
    SET(swiglu_forward); SET(swiglu_backward); SET(cross_entropy_forward);
    SET(cross_entropy_backward); SET(cross_entropy_fused); SET(adamw_update); SET(adamw_update_m16);
    SET(adamw_update_multi);
#undef SET
    comm_set_timer(comm_begin, comm_end);
    return &wrapped;
}

void profile_read(double secs[PROF_COUNT]) { memcpy(secs, acc, sizeof acc); }
void profile_reset(void)
{
    memset(acc, 0, sizeof acc);
    n_rows = 0;
}

static int by_secs_desc(const void *a, const void *b)
{
    double x = ((const struct op_row *)a)->secs, y = ((const struct op_row *)b)->secs;
    return (x < y) - (x > y);
}

void profile_print_ops(FILE *f, double step_s)
{
    qsort(rows, (size_t)n_rows, sizeof rows[0], by_secs_desc);
    fprintf(f, "    %-24s %10s %6s %9s %6s\n", "op", "key", "calls", "ms", "share");
    for (int i = 0; i < n_rows; i++)
        fprintf(f, "    %-24s %10ld %6d %9.2f %5.1f%%\n", rows[i].name, rows[i].key, rows[i].calls,
                1e3 * rows[i].secs, 100 * rows[i].secs / step_s);
}

const char *profile_cat_name(enum prof_cat c)
{
    static const char *names[PROF_COUNT] = {"attention", "expert GEMMs", "dense GEMMs",
                                            "router+rows", "comm", "optimizer", "other"};
    return names[c];
}

void profile_format(char *buf, size_t cap, const double secs[PROF_COUNT], double step_s)
{
    size_t n = 0;
    double sum = 0;
    for (int c = 0; c < PROF_COUNT; c++) {
        sum += secs[c];
        n += (size_t)snprintf(buf + n, n < cap ? cap - n : 0, "%s%s %.0f%%", c ? " | " : "",
                              profile_cat_name((enum prof_cat)c), 100 * secs[c] / step_s);
    }
    snprintf(buf + n, n < cap ? cap - n : 0, " | host/idle %.0f%%", 100 * (step_s - sum) / step_s);
}
