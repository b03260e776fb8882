/* MT_MPI_MAX_COUNT=K mpirun -np N comm_split_check N_ELEMS
 * (without MT_MPI_MAX_COUNT the ordinary paths: one MPI call per collective)
 * Runs every collective of the MPI comm on N_ELEMS elements per rank block; with K below N_ELEMS
 * they take the split path that counts above INT_MAX take in a real run. Each result is checked
 * against values written out here; exits non-zero on every rank on any mismatch. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#include "comm.h"
#include "common.h"

static int problems;

#define EXPECT(cond, ...)                                                       \
    do {                                                                        \
        if (!(cond) && problems++ < 5) {                                        \
            fprintf(stderr, "comm_split_check: rank %d: ", mt_rank());          \
            fprintf(stderr, __VA_ARGS__);                                       \
            fputc('\n', stderr);                                                \
        }                                                                       \
    } while (0)

/* element i of the block rank r contributes for destination d */
static double val(int r, int d, size_t i) { return 1000.0 * r + 100.0 * d + (double)i; }

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    struct comm *c = comm_mpi_create(MPI_COMM_WORLD);
    const int p = mt_world(), me = mt_rank();
    const size_t n = argc > 1 ? (size_t)atol(argv[1]) : 20;
    double *a = mt_malloc((size_t)p * n * sizeof(double)), *b = mt_malloc((size_t)p * n * sizeof(double));

    /* all_gather, separate and in place */
    for (size_t i = 0; i < n; i++) a[i] = val(me, 0, i);
    comm_all_gather(c, b, a, n, COMM_F64);
    for (int r = 0; r < p; r++)
        for (size_t i = 0; i < n; i++) EXPECT(b[r * n + i] == val(r, 0, i), "all_gather [%d][%zu]", r, i);
    for (size_t i = 0; i < (size_t)p * n; i++) b[i] = -1;
    for (size_t i = 0; i < n; i++) b[me * n + i] = val(me, 0, i);
    comm_all_gather(c, b, b + (size_t)me * n, n, COMM_F64);   /* in place (comm.h) */
    for (int r = 0; r < p; r++)
        for (size_t i = 0; i < n; i++) EXPECT(b[r * n + i] == val(r, 0, i), "all_gather in place [%d][%zu]", r, i);

    /* reduce_scatter: block d of every rank sums onto rank d */
    for (int d = 0; d < p; d++)
        for (size_t i = 0; i < n; i++) a[d * n + i] = val(me, d, i);
    comm_reduce_scatter_sum(c, b, a, n, COMM_F64);
    for (size_t i = 0; i < n; i++) {
        double want = 0;
        for (int r = 0; r < p; r++) want += val(r, me, i);
        EXPECT(b[i] == want, "reduce_scatter [%zu] = %g, want %g", i, b[i], want);
    }
    /* in place: the result lands at this rank's block of the input */
    for (int d = 0; d < p; d++)
        for (size_t i = 0; i < n; i++) a[d * n + i] = val(me, d, i);
    comm_reduce_scatter_sum(c, a + (size_t)me * n, a, n, COMM_F64);
    for (size_t i = 0; i < n; i++) {
        double want = 0;
        for (int r = 0; r < p; r++) want += val(r, me, i);
        EXPECT(a[me * n + i] == want, "reduce_scatter in place [%zu] = %g, want %g", i, a[me * n + i], want);
    }

    /* reduce_scatter_sum_start/comm_p2p_wait (fsdp.c's overlapped gradient reduction): in place
     * and separate, both in flight at once, waited in reverse order */
    double *a2 = mt_malloc((size_t)p * n * sizeof(double));
    for (int d = 0; d < p; d++)
        for (size_t i = 0; i < n; i++) a[d * n + i] = a2[d * n + i] = val(me, d, i);
    for (size_t i = 0; i < n; i++) b[i] = -1;
    struct comm_p2p_req rs1, rs2;
    comm_reduce_scatter_sum_start(c, a + (size_t)me * n, a, n, COMM_F64, &rs1);
    comm_reduce_scatter_sum_start(c, b, a2, n, COMM_F64, &rs2);
    comm_p2p_wait(c, &rs2);
    comm_p2p_wait(c, &rs1);
    for (size_t i = 0; i < n; i++) {
        double want = 0;
        for (int r = 0; r < p; r++) want += val(r, me, i);
        EXPECT(a[me * n + i] == want, "reduce_scatter_start in place [%zu] = %g, want %g", i, a[me * n + i], want);
        EXPECT(b[i] == want, "reduce_scatter_start [%zu] = %g, want %g", i, b[i], want);
    }
    free(a2);

    /* all_reduce */
    for (size_t i = 0; i < n; i++) a[i] = val(me, 0, i);
    comm_all_reduce_sum(c, a, n, COMM_F64);
    for (size_t i = 0; i < n; i++) {
        double want = 0;
        for (int r = 0; r < p; r++) want += val(r, 0, i);
        EXPECT(a[i] == want, "all_reduce [%zu]", i);
    }

    /* all_to_all: block d goes to rank d */
    for (int d = 0; d < p; d++)
        for (size_t i = 0; i < n; i++) a[d * n + i] = val(me, d, i);
    comm_all_to_all(c, b, a, n, COMM_F64);
    for (int r = 0; r < p; r++)
        for (size_t i = 0; i < n; i++) EXPECT(b[r * n + i] == val(r, me, i), "all_to_all [%d][%zu]", r, i);

    /* all_to_all_v: rank r sends (r + d) % 3 * n / 2 + 1 elements to rank d */
    int64_t *sc = mt_malloc(2 * (size_t)p * sizeof(int64_t)), *rc = sc + p;
    size_t stot = 0, rtot = 0;
    for (int d = 0; d < p; d++) {
        sc[d] = (me + d) % 3 * (int64_t)n / 2 + 1;
        rc[d] = (d + me) % 3 * (int64_t)n / 2 + 1;
        stot += (size_t)sc[d];
        rtot += (size_t)rc[d];
    }
    double *sv = mt_malloc(stot * sizeof(double)), *rv = mt_malloc(rtot * sizeof(double));
    size_t o = 0;
    for (int d = 0; d < p; d++)
        for (int64_t i = 0; i < sc[d]; i++) sv[o++] = val(me, d, (size_t)i);
    comm_all_to_all_v(c, rv, rc, sv, sc, COMM_F64);
    o = 0;
    for (int r = 0; r < p; r++)
        for (int64_t i = 0; i < rc[r]; i++, o++) EXPECT(rv[o] == val(r, me, (size_t)i), "all_to_all_v [%d][%lld]", r, (long long)i);

    /* all_to_all_v_start/comm_p2p_wait: two in flight, waited in reverse order, the count arrays
     * overwritten once started (they are read at the start) */
    int64_t *sc2 = mt_malloc(2 * (size_t)p * sizeof(int64_t)), *rc2 = sc2 + p;
    for (int d = 0; d < p; d++) sc2[d] = sc[d], rc2[d] = rc[d];
    double *rv2 = mt_malloc(rtot * sizeof(double));
    for (size_t i = 0; i < rtot; i++) rv[i] = rv2[i] = -1;
    struct comm_p2p_req q1, q2;
    comm_all_to_all_v_start(c, rv, rc2, sv, sc2, COMM_F64, &q1);
    comm_all_to_all_v_start(c, rv2, rc2, sv, sc2, COMM_F64, &q2);
    for (int d = 0; d < p; d++) sc2[d] = rc2[d] = -1;
    comm_p2p_wait(c, &q2);
    comm_p2p_wait(c, &q1);
    o = 0;
    for (int r = 0; r < p; r++)
        for (int64_t i = 0; i < rc[r]; i++, o++) {
            EXPECT(rv[o] == val(r, me, (size_t)i), "all_to_all_v_start (first) [%d][%lld]", r, (long long)i);
            EXPECT(rv2[o] == val(r, me, (size_t)i), "all_to_all_v_start (second) [%d][%lld]", r, (long long)i);
        }
    free(sc2);
    free(rv2);

    int all = 0;
    MPI_Allreduce(&problems, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (me == 0) printf("comm_split_check: %d elements per block, %d problems\n", (int)n, all);
    free(a); free(b); free(sc); free(sv); free(rv);
    comm_free(c);
    MPI_Finalize();
    return all ? 1 : 0;
}
