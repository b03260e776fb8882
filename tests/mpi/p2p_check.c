/* mpirun -np N p2p_check [CHUNK [ASYNC]]
 *
 * Grouped point-to-point transfers of the comm layer (comm_p2p, src/comm.h) over MPI. Every rank
 * posts, in ONE group, sends to both ring neighbours and receives from both, listing its sends
 * before its receives (blocking sends in that order would deadlock on a ring), with two messages to
 * the same peer in one group (matched in order), three dtypes and a zero-count op. CHUNK > 0 cuts
 * every transfer into pieces of at most CHUNK elements (comm_mpi_set_p2p_chunk), exercising the
 * split that counts above INT_MAX take. ASYNC 1 posts the sends and the receives as two groups
 * with comm_p2p_start, both in flight before either is waited on (comm_p2p_wait). Each received element must equal what the sender wrote.
 * Exits 0 when everything matches, else each failing rank prints its first problem and all exit 1. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "common.h"

/* element j of message `msg` from rank `from` */
static int64_t value(int from, int msg, size_t j) { return (int64_t)from * 1000003 + msg * 10007 + (int64_t)j; }

int main(int argc, char **argv)
{
    MT_CHECK_MPI(MPI_Init(&argc, &argv));
    const size_t chunk = argc > 1 ? (size_t)atol(argv[1]) : 0;
    comm_mpi_set_p2p_chunk(chunk);
    struct comm *c = comm_mpi_create(MPI_COMM_WORLD);
    const int r = c->rank, n = c->size, next = (r + 1) % n, prev = (r + n - 1) % n;
    const size_t N = 1000 + 37 * (size_t)r; /* sizes differ per sender: a mismatch would show */
    const size_t n_next = 1000 + 37 * (size_t)next, n_prev = 1000 + 37 * (size_t)prev;
    (void)n_next;

    /* to next: f32 (msg 0) then i64 (msg 1); to prev: bf16 as raw uint16 (msg 2) */
    float *s0 = mt_malloc(N * sizeof(float)), *r0 = mt_malloc(n_prev * sizeof(float));
    int64_t *s1 = mt_malloc(N * sizeof(int64_t)), *r1 = mt_malloc(n_prev * sizeof(int64_t));
    uint16_t *s2 = mt_malloc(N * sizeof(uint16_t)), *r2 = mt_malloc(n_next * 2 * sizeof(uint16_t));
    for (size_t j = 0; j < N; j++) {
        s0[j] = (float)(value(r, 0, j) % 65536);
        s1[j] = value(r, 1, j);
        s2[j] = (uint16_t)value(r, 2, j);
    }
    memset(r0, 0, n_prev * sizeof(float));
    memset(r1, 0, n_prev * sizeof(int64_t));
    memset(r2, 0, n_next * 2 * sizeof(uint16_t));
    const int n_ops = n > 1 ? 7 : 0;
    struct comm_p2p_op ops[7] = {
        {COMM_SEND, next, s0, N, COMM_F32},
        {COMM_SEND, next, s1, N, COMM_I64},
        {COMM_SEND, prev, s2, N, COMM_BF16},
        {COMM_SEND, prev, s2, 0, COMM_BF16},
        {COMM_RECV, prev, r0, n_prev, COMM_F32},
        {COMM_RECV, prev, r1, n_prev, COMM_I64},
        {COMM_RECV, next, r2, 1000 + 37 * (size_t)next, COMM_BF16},
    };
    if (argc > 2 && atoi(argv[2])) {
        struct comm_p2p_req sends, recvs;
        comm_p2p_start(c, ops, n_ops ? 4 : 0, &sends);
        comm_p2p_start(c, ops + 4, n_ops ? 3 : 0, &recvs);
        comm_p2p_wait(c, &recvs);
        comm_p2p_wait(c, &sends);
    } else {
        comm_p2p(c, ops, n_ops);
    }

    int bad = 0;
    char first[256] = "";
    for (size_t j = 0; j < n_prev && n > 1; j++) {
        const float w0 = (float)(value(prev, 0, j) % 65536);
        if (r0[j] != w0 && !bad++) snprintf(first, sizeof first, "f32 from %d [%zu] = %g, expected %g", prev, j, r0[j], w0);
        if (r1[j] != value(prev, 1, j) && !bad++)
            snprintf(first, sizeof first, "i64 from %d [%zu] = %lld", prev, j, (long long)r1[j]);
    }
    for (size_t j = 0; j < 1000 + 37 * (size_t)next && n > 1; j++)
        if (r2[j] != (uint16_t)value(next, 2, j) && !bad++)
            snprintf(first, sizeof first, "bf16 from %d [%zu] = %u", next, j, r2[j]);
    if (n > 1 && r2[1000 + 37 * (size_t)next] != 0 && !bad++)
        snprintf(first, sizeof first, "bf16 from %d wrote past its count", next);

    /* an empty group and a NULL comm with no ops are no-ops */
    comm_p2p(c, NULL, 0);
    comm_p2p(NULL, NULL, 0);

    if (bad) fprintf(stderr, "p2p_check: rank %d: %d wrong elements, first: %s\n", r, bad, first);
    int any = bad > 0, all = 0;
    MT_CHECK_MPI(MPI_Allreduce(&any, &all, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
    free(s0); free(r0); free(s1); free(r1); free(s2); free(r2);
    comm_free(c);
    MT_CHECK_MPI(MPI_Finalize());
    return all ? 1 : 0;
}
