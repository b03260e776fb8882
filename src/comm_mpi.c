/* MPI implementation of the comm table (host buffers). Large counts are split into chunks below
 * INT_MAX elements since MPI counts are int. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "common.h"
#include "watchdog.h"

size_t comm_dtype_size(enum comm_dtype t)
{
    switch (t) {
    case COMM_F32: return 4;
    case COMM_F64: return 8;
    case COMM_I32: return 4;
    case COMM_I64: return 8;
    case COMM_BYTE: return 1;
    case COMM_BF16: return 2;
    }
    return 1;
}

static MPI_Datatype mpi_type(enum comm_dtype t)
{
    switch (t) {
    case COMM_F32: return MPI_FLOAT;
    case COMM_F64: return MPI_DOUBLE;
    case COMM_I32: return MPI_INT32_T;
    case COMM_I64: return MPI_INT64_T;
    case COMM_BYTE: return MPI_BYTE;
    case COMM_BF16: return MPI_UINT16_T;
    }
    return MPI_BYTE;
}

static int checked_count(size_t n)
{
    MT_CHECK(n <= INT_MAX, "collective of %zu elements exceeds MPI's int count", n);
    return (int)n;
}

static void mpi_all_gather(struct comm *c, void *recv, const void *send, size_t n, enum comm_dtype t)
{
    const bool in_place = send == (const char *)recv + (size_t)c->rank * n * comm_dtype_size(t);
    MT_CHECK_MPI(MPI_Allgather(in_place ? MPI_IN_PLACE : send, checked_count(n), mpi_type(t),
                               recv, checked_count(n), mpi_type(t), c->mpi));
}

/* In place (recv = send + rank * n, comm.h) MPI leaves the result at the start of the buffer. */
static void mpi_reduce_scatter_sum(struct comm *c, void *recv, const void *send, size_t n,
                                   enum comm_dtype t)
{
    const size_t es = comm_dtype_size(t);
    if (recv == (const char *)send + (size_t)c->rank * n * es) {
        MT_CHECK_MPI(MPI_Reduce_scatter_block(MPI_IN_PLACE, (void *)send, checked_count(n), mpi_type(t),
                                              MPI_SUM, c->mpi));
        memmove(recv, send, n * es);
        return;
    }
    MT_CHECK_MPI(MPI_Reduce_scatter_block(send, recv, checked_count(n), mpi_type(t), MPI_SUM, c->mpi));
}

static void mpi_all_reduce_sum(struct comm *c, void *buf, size_t n, enum comm_dtype t)
{
    size_t es = comm_dtype_size(t);
    for (size_t done = 0; done < n;) {
        size_t chunk = MT_MIN(n - done, (size_t)1 << 30);
        MT_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, (char *)buf + done * es, (int)chunk, mpi_type(t),
                                   MPI_SUM, c->mpi));
        done += chunk;
    }
}

static void mpi_all_to_all_v(struct comm *c, void *recv, const int64_t *recv_counts,
                             const void *send, const int64_t *send_counts, enum comm_dtype t)
{
    int p = c->size;
    int *sc = mt_malloc(4 * (size_t)p * sizeof(int));
    int *sd = sc + p, *rc = sc + 2 * p, *rd = sc + 3 * p;
    int64_t so = 0, ro = 0;
    for (int i = 0; i < p; i++) {
        sc[i] = checked_count((size_t)send_counts[i]);
        rc[i] = checked_count((size_t)recv_counts[i]);
        sd[i] = checked_count((size_t)so);
        rd[i] = checked_count((size_t)ro);
        so += send_counts[i];
        ro += recv_counts[i];
    }
    MT_CHECK_MPI(MPI_Alltoallv(send, sc, sd, mpi_type(t), recv, rc, rd, mpi_type(t), c->mpi));
    free(sc);
}

static void mpi_all_to_all(struct comm *c, void *recv, const void *send, size_t n, enum comm_dtype t)
{
    MT_CHECK_MPI(MPI_Alltoall(send, checked_count(n), mpi_type(t), recv, checked_count(n),
                              mpi_type(t), c->mpi));
}

/* c->impl of an MPI comm: the all_to_all_inbox buffer, grown on demand */
struct mpi_inbox {
    void *buf;
    size_t cap;
};

static const void *mpi_all_to_all_inbox(struct comm *c, const int64_t *recv_counts,
                                        const void *send, const int64_t *send_counts,
                                        enum comm_dtype t)
{
    struct mpi_inbox *in = c->impl;
    if (!in) in = c->impl = mt_calloc(1, sizeof *in);
    size_t n = 0;
    for (int s = 0; s < c->size; s++) n += (size_t)recv_counts[s];
    const size_t bytes = MT_MAX(n, 1) * comm_dtype_size(t);
    if (bytes > in->cap) {
        free(in->buf);
        in->buf = mt_malloc(bytes);
        in->cap = bytes;
    }
    mpi_all_to_all_v(c, in->buf, recv_counts, send, send_counts, t);
    return in->buf;
}

static void mpi_destroy(struct comm *c)
{
    struct mpi_inbox *in = c->impl;
    if (in) free(in->buf);
    free(in);
    c->impl = NULL;
}

static const struct comm_ops mpi_ops = {
    .all_gather = mpi_all_gather,
    .reduce_scatter_sum = mpi_reduce_scatter_sum,
    .all_reduce_sum = mpi_all_reduce_sum,
    .all_to_all_v = mpi_all_to_all_v,
    .all_to_all = mpi_all_to_all,
    .all_to_all_inbox = mpi_all_to_all_inbox,
    .destroy = mpi_destroy,
};

struct comm *comm_mpi_create(MPI_Comm mpi)
{
    struct comm *c = mt_calloc(1, sizeof *c);
    c->mpi = mpi;
    MT_CHECK_MPI(MPI_Comm_rank(mpi, &c->rank));
    MT_CHECK_MPI(MPI_Comm_size(mpi, &c->size));
    c->ops = &mpi_ops;
    return c;
}

void comm_free(struct comm *c)
{
    if (c && c->ops && c->ops->destroy) c->ops->destroy(c);
    free(c);
}

static void (*timer_begin)(void), (*timer_end)(void);

void comm_set_timer(void (*begin)(void), void (*end)(void))
{
    timer_begin = begin;
    timer_end = end;
}

/* Also tells the watchdog which collective this rank is inside, for its report on a hang. */
#define TIMED(call)                                 \
    do {                                            \
        watchdog_collective(__func__, c->size);     \
        if (timer_begin) timer_begin();             \
        call;                                       \
        if (timer_end) timer_end();                 \
        watchdog_collective(NULL, 0);               \
    } while (0)

/* NULL is a host-memory group of one; a real comm (even of size 1) runs its own implementation,
 * which knows where its buffers live (host for MPI, device for NCCL). */
static int single(const struct comm *c) { return c == NULL; }

void comm_all_gather(struct comm *c, void *recv, const void *send, size_t n, enum comm_dtype t)
{
    if (single(c)) {
        if (recv != send) memmove(recv, send, n * comm_dtype_size(t));
        return;
    }
    TIMED(c->ops->all_gather(c, recv, send, n, t));
}

void comm_reduce_scatter_sum(struct comm *c, void *recv, const void *send, size_t n,
                             enum comm_dtype t)
{
    if (single(c)) {
        if (recv != send) memmove(recv, send, n * comm_dtype_size(t));
        return;
    }
    TIMED(c->ops->reduce_scatter_sum(c, recv, send, n, t));
}

void comm_all_reduce_sum(struct comm *c, void *buf, size_t n, enum comm_dtype t)
{
    if (!single(c)) TIMED(c->ops->all_reduce_sum(c, buf, n, t));
}

void comm_all_to_all_v(struct comm *c, void *recv, const int64_t *recv_counts, const void *send,
                       const int64_t *send_counts, enum comm_dtype t)
{
    if (single(c)) {
        if (recv != send) memmove(recv, send, (size_t)send_counts[0] * comm_dtype_size(t));
        return;
    }
    TIMED(c->ops->all_to_all_v(c, recv, recv_counts, send, send_counts, t));
}

void comm_all_to_all(struct comm *c, void *recv, const void *send, size_t n, enum comm_dtype t)
{
    if (single(c)) {
        if (recv != send) memmove(recv, send, n * comm_dtype_size(t));
        return;
    }
    TIMED(c->ops->all_to_all(c, recv, send, n, t));
}

const void *comm_all_to_all_inbox(struct comm *c, const int64_t *recv_counts, const void *send,
                                  const int64_t *send_counts, enum comm_dtype t)
{
    if (single(c)) return send;
    const void *r;
    TIMED(r = c->ops->all_to_all_inbox(c, recv_counts, send, send_counts, t));
    return r;
}
