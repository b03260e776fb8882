/* NCCL vs MPI: runs every operation of the comm table through comm_mpi (host buffers) and
 * comm_nccl (device buffers of the CUDA backend) on the same random data and compares, on
 * MPI_COMM_WORLD and on a split of it (halves by rank parity: size-1 groups when run on 2 ranks).
 * Run under `mpirun -np N` with one GPU per rank (scripts/test-gpu.sh). Data movement (gathers,
 * all-to-alls, every dtype including BF16 and BYTE) must match bit for bit; sums must match
 * exactly for integers and, for floats, to 1e-6 of the size of the terms (NCCL may add the ranks'
 * contributions in another order than MPI: for 2 ranks a + b is the same either way; for more the
 * rounding differs by a few ulp of the TERMS, which are N(0,1) here, so a sum that cancels to a
 * small value is compared on the scale of its terms, not of itself). Also checks that an NCCL comm handed HOST buffers gives the MPI
 * result, and the all_to_all_inbox of the MoE row exchanges, through the copy-engine path and through
 * NCCL (inbox_suite). Prints "skipped: no GPU" and exits 0 without a GPU or without CUDA in the
 * build. */
#include <mpi.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "common.h"
#include "ops.h"
#ifdef MT_HAVE_NCCL
#include <cuda_runtime_api.h>

#include "comm_nccl.h"
#endif

#ifdef MT_HAVE_NCCL

static int n_checks, n_fail;

static void report(const char *tag, const char *op, enum comm_dtype t, bool ok, const char *detail)
{
    static const char *names[] = {"f32", "f64", "i32", "i64", "byte", "bf16"};
    n_checks++;
    if (!ok) {
        n_fail++;
        fprintf(stderr, "[rank %d] FAIL %s %s %s: %s\n", mt_rank(), tag, op, names[t], detail);
    }
}

static void fill(mt_rng *r, void *buf, size_t n, enum comm_dtype t)
{
    for (size_t i = 0; i < n; i++) {
        switch (t) {
        case COMM_F32: ((float *)buf)[i] = (float)mt_rng_normal(r); break;
        case COMM_F64: ((double *)buf)[i] = mt_rng_normal(r); break;
        case COMM_I32: ((int32_t *)buf)[i] = (int32_t)(mt_rng_next(r) % 2001) - 1000; break;
        case COMM_I64: ((int64_t *)buf)[i] = (int64_t)(mt_rng_next(r) % 2000000000001ull) - 1000000000000ll; break;
        case COMM_BYTE: ((uint8_t *)buf)[i] = (uint8_t)mt_rng_next(r); break;
        case COMM_BF16: ((uint16_t *)buf)[i] = (uint16_t)mt_rng_next(r); break;
        }
    }
}

/* a (device result) against b (MPI result): bytes, or for float sums of P terms of size ~1 each,
 * 1e-6 of the result plus 1e-6·P (a wrong or missing term is off by O(1)) */
static bool same(const void *a, const void *b, size_t n, enum comm_dtype t, bool is_sum, char *why,
                 size_t cap)
{
    if (is_sum && (t == COMM_F32 || t == COMM_F64)) {
        const double P = (double)mt_world();
        for (size_t i = 0; i < n; i++) {
            double x = t == COMM_F32 ? ((const float *)a)[i] : ((const double *)a)[i];
            double y = t == COMM_F32 ? ((const float *)b)[i] : ((const double *)b)[i];
            if (!(fabs(x - y) <= 1e-6 * (fabs(x) + fabs(y)) + 1e-6 * P)) {
                snprintf(why, cap, "element %zu: nccl %.9g, mpi %.9g", i, x, y);
                return false;
            }
        }
        return true;
    }
    const size_t es = comm_dtype_size(t);
    for (size_t i = 0; i < n * es; i++)
        if (((const uint8_t *)a)[i] != ((const uint8_t *)b)[i]) {
            snprintf(why, cap, "byte %zu (element %zu) differs", i, i / es);
            return false;
        }
    return true;
}

static void *dev_from(const struct backend *g, const void *h, size_t bytes)
{
    void *d = g->alloc(bytes ? bytes : 1);
    if (bytes) g->upload(d, h, bytes);
    return d;
}

/* device output, poisoned */
static void *dev_out(const struct backend *g, size_t bytes)
{
    void *d = g->alloc(bytes ? bytes : 1);
    if (bytes) {
        void *p = mt_malloc(bytes);
        memset(p, 0xa5, bytes);
        g->upload(d, p, bytes);
        free(p);
    }
    return d;
}

static void *host_of(const struct backend *g, const void *d, size_t bytes)
{
    void *h = mt_malloc(bytes ? bytes : 1);
    g->download(h, d, bytes); /* waits: the collective on the stream has finished */
    return h;
}

static void suite(const struct backend *g, struct comm *hc, struct comm *dc, const char *tag, int seed)
{
    const int P = hc->size, me = hc->rank;
    char why[256];
    for (int ti = 0; ti <= COMM_BF16; ti++) {
        const enum comm_dtype t = (enum comm_dtype)ti;
        const size_t es = comm_dtype_size(t);
        const bool summable = t == COMM_F32 || t == COMM_F64 || t == COMM_I32 || t == COMM_I64;
        mt_rng r;
        mt_rng_seed(&r, (uint64_t)seed * 1000 + (uint64_t)me * 17 + (uint64_t)ti);

        /* all_gather, out of place and in place */
        {
            const size_t n = 1537;
            void *send = mt_malloc(n * es), *ref = mt_malloc(P * n * es);
            fill(&r, send, n, t);
            hc->ops->all_gather(hc, ref, send, n, t);
            void *ds = dev_from(g, send, n * es), *dr = dev_out(g, P * n * es);
            dc->ops->all_gather(dc, dr, ds, n, t);
            void *got = host_of(g, dr, P * n * es);
            report(tag, "all_gather", t, same(got, ref, P * n, t, false, why, sizeof why), why);
            free(got);
            /* in place: this rank's block already at recv[me·n], the rest poisoned */
            g->free(dr);
            dr = dev_out(g, P * n * es);
            g->upload((char *)dr + (size_t)me * n * es, send, n * es);
            dc->ops->all_gather(dc, dr, dr, n, t);
            got = host_of(g, dr, P * n * es);
            report(tag, "all_gather in place", t, same(got, ref, P * n, t, false, why, sizeof why), why);
            free(got);
            /* all_gather_start/p2p_wait (the FSDP prefetch): in place at recv + me·n, on the side
             * stream, while the compute stream writes another buffer; even on one rank NCCL runs it */
            g->free(dr);
            dr = dev_out(g, P * n * es);
            void *busy = dev_out(g, (size_t)1 << 22);
            g->upload((char *)dr + (size_t)me * n * es, send, n * es);
            struct comm_p2p_req req;
            dc->ops->all_gather_start(dc, dr, (char *)dr + (size_t)me * n * es, n, t, &req);
            g->zero(busy, (size_t)1 << 22);
            dc->ops->p2p_wait(dc, &req);
            got = host_of(g, dr, P * n * es);
            report(tag, "all_gather_start in place", t, same(got, ref, P * n, t, false, why, sizeof why), why);
            free(got), free(send), free(ref);
            g->free(ds), g->free(dr), g->free(busy);
        }
        /* reduce_scatter_sum and all_reduce_sum */
        if (summable) {
            const size_t n = 2049;
            void *send = mt_malloc(P * n * es), *ref = mt_malloc(n * es);
            fill(&r, send, P * n, t);
            hc->ops->reduce_scatter_sum(hc, ref, send, n, t);
            void *ds = dev_from(g, send, P * n * es), *dr = dev_out(g, n * es);
            dc->ops->reduce_scatter_sum(dc, dr, ds, n, t);
            void *got = host_of(g, dr, n * es);
            report(tag, "reduce_scatter_sum", t, same(got, ref, n, t, true, why, sizeof why), why);
            free(got);
            g->free(dr);
            /* reduce_scatter_sum_start/p2p_wait (fsdp.c's overlapped gradient reduction): in place
             * at send + me·n on the side stream, while the compute stream writes another buffer */
            void *busy = dev_out(g, (size_t)1 << 22);
            struct comm_p2p_req req;
            dc->ops->reduce_scatter_sum_start(dc, (char *)ds + (size_t)me * n * es, ds, n, t, &req);
            g->zero(busy, (size_t)1 << 22);
            dc->ops->p2p_wait(dc, &req);
            got = host_of(g, (char *)ds + (size_t)me * n * es, n * es);
            report(tag, "reduce_scatter_sum_start in place", t, same(got, ref, n, t, true, why, sizeof why), why);
            free(got), free(send), free(ref);
            g->free(ds), g->free(busy);

            const size_t m = 100003;
            void *buf = mt_malloc(m * es);
            fill(&r, buf, m, t);
            void *db = dev_from(g, buf, m * es);
            hc->ops->all_reduce_sum(hc, buf, m, t);
            dc->ops->all_reduce_sum(dc, db, m, t);
            got = host_of(g, db, m * es);
            report(tag, "all_reduce_sum", t, same(got, buf, m, t, true, why, sizeof why), why);
            free(got), free(buf);
            g->free(db);
        }
        /* all_to_all: n elements per rank pair */
        {
            const size_t n = 333;
            void *send = mt_malloc(P * n * es), *ref = mt_malloc(P * n * es);
            fill(&r, send, P * n, t);
            hc->ops->all_to_all(hc, ref, send, n, t);
            void *ds = dev_from(g, send, P * n * es), *dr = dev_out(g, P * n * es);
            dc->ops->all_to_all(dc, dr, ds, n, t);
            void *got = host_of(g, dr, P * n * es);
            report(tag, "all_to_all", t, same(got, ref, P * n, t, false, why, sizeof why), why);
            free(got), free(send), free(ref);
            g->free(ds), g->free(dr);
        }
        /* all_to_all_v: uneven counts, some zero (the counts are exchanged over MPI first) */
        {
            int64_t *sc = mt_calloc(P, sizeof(int64_t)), *rc = mt_calloc(P, sizeof(int64_t));
            size_t stot = 0, rtot = 0;
            for (int p = 0; p < P; p++) {
                sc[p] = (me + p + ti) % 3 == 0 ? 0 : (int64_t)(mt_rng_next(&r) % 700);
                stot += (size_t)sc[p];
            }
            MT_CHECK_MPI(MPI_Alltoall(sc, 1, MPI_INT64_T, rc, 1, MPI_INT64_T, hc->mpi));
            for (int p = 0; p < P; p++) rtot += (size_t)rc[p];
            void *send = mt_malloc(stot * es + 1), *ref = mt_malloc(rtot * es + 1);
            fill(&r, send, stot, t);
            hc->ops->all_to_all_v(hc, ref, rc, send, sc, t);
            void *ds = dev_from(g, send, stot * es), *dr = dev_out(g, rtot * es);
            dc->ops->all_to_all_v(dc, dr, rc, ds, sc, t);
            void *got = host_of(g, dr, rtot * es);
            report(tag, "all_to_all_v", t, same(got, ref, rtot, t, false, why, sizeof why), why);
            free(got);
            /* all_to_all_v_start/p2p_wait (moe_exchange.c): two in flight on the side stream, the
             * count arrays overwritten as soon as they are started (they are read at the start) */
            int64_t *sc2 = mt_malloc(P * sizeof(int64_t)), *rc2 = mt_malloc(P * sizeof(int64_t));
            memcpy(sc2, sc, P * sizeof(int64_t)), memcpy(rc2, rc, P * sizeof(int64_t));
            void *dr2 = dev_out(g, rtot * es);
            struct comm_p2p_req q1, q2;
            dc->ops->all_to_all_v_start(dc, dr, rc2, ds, sc2, t, &q1);
            dc->ops->all_to_all_v_start(dc, dr2, rc2, ds, sc2, t, &q2);
            for (int p = 0; p < P; p++) sc2[p] = rc2[p] = -1;
            comm_p2p_wait(dc, &q2);
            comm_p2p_wait(dc, &q1);
            got = host_of(g, dr, rtot * es);
            report(tag, "all_to_all_v_start (first)", t, same(got, ref, rtot, t, false, why, sizeof why), why);
            free(got);
            got = host_of(g, dr2, rtot * es);
            report(tag, "all_to_all_v_start (second)", t, same(got, ref, rtot, t, false, why, sizeof why), why);
            free(got), free(sc2), free(rc2);
            g->free(dr2);
            free(send), free(ref), free(sc), free(rc);
            g->free(ds), g->free(dr);
        }
    }
    /* an NCCL comm given host buffers behaves as MPI */
    {
        double h1[5], h2[5];
        mt_rng r;
        mt_rng_seed(&r, (uint64_t)seed + 99 + (uint64_t)me);
        for (int i = 0; i < 5; i++) h1[i] = h2[i] = mt_rng_normal(&r);
        hc->ops->all_reduce_sum(hc, h1, 5, COMM_F64);
        dc->ops->all_reduce_sum(dc, h2, 5, COMM_F64);
        report(tag, "all_reduce_sum (host buffers)", COMM_F64,
               same(h2, h1, 5, COMM_F64, false, why, sizeof why), why);
    }
}

/* all_to_all_inbox: ROUNDS calls back to back with no host wait between them, each followed by a
 * device copy of the inbox into its own result buffer, at sizes that grow and shrink (the window
 * is regrown in the middle of the queue). A protocol that let a peer write the next round into a
 * window still being read, or let the copy start before every block landed, shows up as wrong
 * bytes. Every third round goes through comm_all_to_all_inbox_start and comm_p2p_wait with other
 * work queued between them (a copy that read the window before the wait would see old bytes).
 * Rounds 1 and 5 are all_gather_inbox_start (every rank sent the same block: the MoE fixed
 * exchange's token rows), compared with MPI's all_gather; the others with MPI's all_to_all_v.
 * Round 5 is comm_all_gather_inbox_start_others, whose block to self the caller takes from its
 * send buffer (the self-last dispatch): the other blocks must be right.
 * Round 7 is comm_all_to_all_inbox_start_self_later: the send buffer's block to self is overwritten
 * with 0xff bytes before the start and the caller writes the right block into the window after it
 * (moe.c's combine_self_last), so a comm that still copied the block to self, or a wrong place for
 * it, shows as wrong bytes. */
static void inbox_suite(const struct backend *g, struct comm *hc, struct comm *dc, const char *tag,
                        int seed)
{
    enum { ROUNDS = 8 };
    static const double scale[ROUNDS] = {1, 3, 0.5, 40, 2, 0.1, 60, 1};
    const int P = hc->size, me = hc->rank;
    char why[256];
    mt_rng r;
    mt_rng_seed(&r, (uint64_t)seed * 7919 + (uint64_t)me);
    void *ref[ROUNDS], *out[ROUNDS], *dsend[ROUNDS];
    int64_t *sc[ROUNDS], *rc[ROUNDS];
    size_t rtot[ROUNDS];
    enum comm_dtype type[ROUNDS];
    for (int k = 0; k < ROUNDS; k++) {
        const enum comm_dtype t = k % 2 ? COMM_F32 : COMM_BF16;
        const size_t es = comm_dtype_size(t);
        const bool gather = k % 4 == 1;
        sc[k] = mt_calloc(P, sizeof(int64_t)), rc[k] = mt_calloc(P, sizeof(int64_t));
        size_t stot = 0;
        const int64_t same_n = (int64_t)(scale[k] * 7001); /* the same on every rank */
        for (int p = 0; p < P; p++) {
            sc[k][p] = gather ? same_n
                       : (me + p + k) % 4 == 0 ? 0 : (int64_t)(scale[k] * (double)(mt_rng_next(&r) % 20000));
            stot += gather ? 0 : (size_t)sc[k][p];
        }
        if (gather) stot = (size_t)same_n;
        MT_CHECK_MPI(MPI_Alltoall(sc[k], 1, MPI_INT64_T, rc[k], 1, MPI_INT64_T, hc->mpi));
        rtot[k] = 0;
        for (int p = 0; p < P; p++) rtot[k] += (size_t)rc[k][p];
        void *send = mt_malloc(stot * es + 1);
        ref[k] = mt_malloc(rtot[k] * es + 1);
        fill(&r, send, stot, t);
        if (gather) hc->ops->all_gather(hc, ref[k], send, stot, t);
        else hc->ops->all_to_all_v(hc, ref[k], rc[k], send, sc[k], t);
        dsend[k] = dev_from(g, send, stot * es);
        out[k] = dev_out(g, rtot[k] * es);
        type[k] = t;
        free(send);
    }
    const size_t busy_bytes = 64u << 20; /* work queued between a start and its wait */
    void *busy = g->alloc(busy_bytes);
    g->sync();
    for (int k = 0; k < ROUNDS; k++) {
        const void *in;
        if (k % 4 == 1) {
            struct comm_p2p_req req;
            const size_t n = (size_t)sc[k][0], es = comm_dtype_size(type[k]);
            in = k == 5 ? comm_all_gather_inbox_start_others(dc, dsend[k], n, type[k], &req)
                        : comm_all_gather_inbox_start(dc, dsend[k], n, type[k], &req);
            g->zero(busy, busy_bytes);
            comm_p2p_wait(dc, &req);
            if (k == 5) { /* the caller's own block comes from its send buffer */
                g->copy(out[k], in, rtot[k] * es);
                g->copy((char *)out[k] + (size_t)me * n * es, dsend[k], n * es);
                continue;
            }
        } else if (k % 3 == 2) {
            struct comm_p2p_req req;
            in = comm_all_to_all_inbox_start(dc, rc[k], dsend[k], sc[k], type[k], &req);
            g->zero(busy, busy_bytes);
            comm_p2p_wait(dc, &req);
        } else if (k == ROUNDS - 1) {
            const size_t es = comm_dtype_size(type[k]);
            size_t so = 0, ro = 0;
            for (int p = 0; p < me; p++) so += (size_t)sc[k][p], ro += (size_t)rc[k][p];
            const size_t n_self = (size_t)sc[k][me] * es;
            void *mine = g->alloc(n_self + 1), *ff = mt_malloc(n_self + 1);
            g->copy(mine, (char *)dsend[k] + so * es, n_self);
            memset(ff, 0xff, n_self + 1);
            g->upload((char *)dsend[k] + so * es, ff, n_self);
            struct comm_p2p_req req;
            void *win = comm_all_to_all_inbox_start_self_later(dc, rc[k], dsend[k], sc[k], type[k], &req);
            g->copy((char *)win + ro * es, mine, n_self);
            g->zero(busy, busy_bytes);
            comm_p2p_wait(dc, &req);
            in = win;
            g->sync();
            g->free(mine), free(ff);
        } else {
            in = dc->ops->all_to_all_inbox(dc, rc[k], dsend[k], sc[k], type[k]);
        }
        g->copy(out[k], in, rtot[k] * comm_dtype_size(type[k]));
    }
    g->free(busy);
    for (int k = 0; k < ROUNDS; k++) {
        void *got = host_of(g, out[k], rtot[k] * comm_dtype_size(type[k]));
        char op[64];
        snprintf(op, sizeof op, "%s round %d", k % 4 == 1 ? "all_gather_inbox" : k == ROUNDS - 1 ?
                 "all_to_all_inbox self later" : "all_to_all_inbox", k);
        report(tag, op, type[k], same(got, ref[k], rtot[k], type[k], false, why, sizeof why), why);
        free(got), free(ref[k]), free(sc[k]), free(rc[k]);
        g->free(out[k]), g->free(dsend[k]);
    }
}

/* comm_p2p and comm_p2p_start/wait on a ring, each rank sending to both neighbours and receiving
 * from both in one group (sends listed first: the grouping is what keeps it from deadlocking), on
 * device buffers through NCCL, against the same on host buffers through MPI. start/wait: two
 * groups in flight at once, the second started before the first is waited on. */
static void p2p_suite(const struct backend *g, struct comm *hc, struct comm *dc, const char *tag, int seed)
{
    const int P = hc->size, me = hc->rank;
    if (P < 2) return;
    const int next = (me + 1) % P, prev = (me + P - 1) % P;
    char why[256];
    for (int ti = 0; ti <= COMM_BF16; ti++) {
        const enum comm_dtype t = (enum comm_dtype)ti;
        const size_t es = comm_dtype_size(t), n = 1000 + 13 * (size_t)ti;
        mt_rng r;
        mt_rng_seed(&r, (uint64_t)seed * 1000 + (uint64_t)me * 17 + (uint64_t)ti);
        void *s0 = mt_malloc(n * es), *s1 = mt_malloc(n * es);
        fill(&r, s0, n, t);
        fill(&r, s1, n, t);
        for (int mode = 0; mode < 2; mode++) {
            void *hr0 = mt_calloc(n, es), *hr1 = mt_calloc(n, es);
            void *d0 = dev_from(g, s0, n * es), *d1 = dev_from(g, s1, n * es);
            void *dr0 = dev_out(g, n * es), *dr1 = dev_out(g, n * es);
            struct comm_p2p_op h[4] = {{COMM_SEND, next, s0, n, t}, {COMM_SEND, prev, s1, n, t},
                                       {COMM_RECV, prev, hr0, n, t}, {COMM_RECV, next, hr1, n, t}};
            struct comm_p2p_op d[4] = {{COMM_SEND, next, d0, n, t}, {COMM_SEND, prev, d1, n, t},
                                       {COMM_RECV, prev, dr0, n, t}, {COMM_RECV, next, dr1, n, t}};
            comm_p2p(hc, h, 4);
            if (mode == 0) {
                comm_p2p(dc, d, 4);
            } else {
                /* forward half, then backward half, both in flight before either is waited on */
                struct comm_p2p_op fw[2] = {d[0], d[2]}, bw[2] = {d[1], d[3]};
                struct comm_p2p_req rf, rb;
                comm_p2p_start(dc, fw, 2, &rf);
                comm_p2p_start(dc, bw, 2, &rb);
                comm_p2p_wait(dc, &rf);
                comm_p2p_wait(dc, &rb);
            }
            void *g0 = host_of(g, dr0, n * es), *g1 = host_of(g, dr1, n * es);
            const char *op = mode ? "p2p_start/wait" : "p2p";
            report(tag, op, t, same(g0, hr0, n, t, false, why, sizeof why), why);
            report(tag, op, t, same(g1, hr1, n, t, false, why, sizeof why), why);
            free(g0), free(g1), free(hr0), free(hr1);
            g->free(d0), g->free(d1), g->free(dr0), g->free(dr1);
        }
        free(s0), free(s1);
    }
}

int main(int argc, char **argv)
{
    MT_CHECK_MPI(MPI_Init(&argc, &argv));
    int rank, size;
    MT_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
    MT_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &size));
    MPI_Comm node;
    int local_rank, local_size;
    MT_CHECK_MPI(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
    MT_CHECK_MPI(MPI_Comm_rank(node, &local_rank));
    MT_CHECK_MPI(MPI_Comm_size(node, &local_size));

    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
    int usable = count >= local_size, all_usable = 0;
    MT_CHECK_MPI(MPI_Allreduce(&usable, &all_usable, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
    if (!all_usable) {
        if (rank == 0)
            printf("gpu_comm_check: skipped: no GPU (or fewer GPUs than ranks on a node: %d for %d)\n",
                   count, local_size);
        MT_CHECK_MPI(MPI_Comm_free(&node));
        MT_CHECK_MPI(MPI_Finalize());
        return 0;
    }
    const struct backend *g = backend_cuda(false, local_rank);
    MT_CHECK(g != NULL, "backend_cuda returned NULL although %d devices are visible", count);

    struct comm *hw = comm_mpi_create(MPI_COMM_WORLD), *dw = comm_nccl_create(MPI_COMM_WORLD);
    suite(g, hw, dw, "world", 1);
    MPI_Comm half;
    MT_CHECK_MPI(MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank, &half));
    struct comm *hh = comm_mpi_create(half), *dh = comm_nccl_create(half);
    suite(g, hh, dh, "half", 2);
    p2p_suite(g, hw, dw, "world", 6);
    p2p_suite(g, hh, dh, "half", 7);
    inbox_suite(g, hw, dw, "world", 3);
    inbox_suite(g, hh, dh, "half", 4);
    /* the same through NCCL (what a group spanning hosts uses) */
    setenv("MT_COMM_IPC", "0", 1);
    struct comm *dn = comm_nccl_create(MPI_COMM_WORLD);
    unsetenv("MT_COMM_IPC");
    inbox_suite(g, hw, dn, "world, NCCL", 5);
    comm_free(dn);

    comm_free(dh), comm_free(hh), comm_free(dw), comm_free(hw);
    int fails = 0, checks = 0;
    MT_CHECK_MPI(MPI_Allreduce(&n_fail, &fails, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD));
    MT_CHECK_MPI(MPI_Allreduce(&n_checks, &checks, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD));
    if (rank == 0)
        printf("gpu_comm_check: %s (%d checks on %d ranks, %d failed)\n", fails ? "FAIL" : "PASS",
               checks, size, fails);
    MT_CHECK_MPI(MPI_Comm_free(&half));
    MT_CHECK_MPI(MPI_Comm_free(&node));
    MT_CHECK_MPI(MPI_Finalize());
    return fails ? 1 : 0;
}

#else /* built without CUDA / NCCL */

int main(int argc, char **argv)
{
    MT_CHECK_MPI(MPI_Init(&argc, &argv));
    if (mt_rank() == 0) printf("gpu_comm_check: skipped: no GPU (built without CUDA/NCCL)\n");
    MT_CHECK_MPI(MPI_Finalize());
    return 0;
}

#endif
