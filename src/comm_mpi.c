/* MPI implementation of the comm table (host buffers). Large counts are split into pieces of at
 * most INT_MAX elements since MPI counts are int. */
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

/* MPI counts are int: larger collectives go in pieces of at most this many elements.
 * MT_MPI_MAX_COUNT lowers it so tests can exercise the split path with small buffers. */
static size_t max_count(void)
{
    static size_t lim;
    if (!lim) {
        const char *e = getenv("MT_MPI_MAX_COUNT");
        long long v = e && *e ? atoll(e) : 0;
        lim = v > 0 && v < INT_MAX ? (size_t)v : (size_t)INT_MAX;
    }
    return lim;
}

/* `k` elements of t with an extent of `stride` elements: one rank's piece of a chunked collective
 * whose per-rank blocks are `stride` apart. */
static MPI_Datatype strided_piece(enum comm_dtype t, size_t k, size_t stride)
{
    MPI_Datatype piece, resized;
    MT_CHECK_MPI(MPI_Type_contiguous((int)k, mpi_type(t), &piece));
    MT_CHECK_MPI(MPI_Type_create_resized(piece, 0, (MPI_Aint)(stride * comm_dtype_size(t)), &resized));
    MT_CHECK_MPI(MPI_Type_commit(&resized));
    MT_CHECK_MPI(MPI_Type_free(&piece));
    return resized;
}

static void mpi_all_gather(struct comm *c, void *recv, const void *send, size_t n, enum comm_dtype t)
{
    const size_t lim = max_count(), es = comm_dtype_size(t);
    /* in place (comm.h): this rank's block already sits at recv + rank * n */
    const bool in_place = send == (const char *)recv + (size_t)c->rank * n * es;
    if (n <= lim) {
        MT_CHECK_MPI(MPI_Allgather(in_place ? MPI_IN_PLACE : send, (int)n, mpi_type(t), recv, (int)n,
                                   mpi_type(t), c->mpi));
        return;
    }
    for (size_t o = 0; o < n; o += lim) {
        size_t k = MT_MIN(lim, n - o);
        MPI_Datatype piece = strided_piece(t, k, n);
        MT_CHECK_MPI(MPI_Allgather(in_place ? MPI_IN_PLACE : (const char *)send + o * es, (int)k,
                                   mpi_type(t), (char *)recv + o * es, 1, piece, c->mpi));
        MT_CHECK_MPI(MPI_Type_free(&piece));
    }
}

/* In place (recv = send + rank * n, comm.h) MPI leaves the result at the start of the buffer. */
static void mpi_reduce_scatter_sum(struct comm *c, void *recv, const void *send, size_t n,
                                   enum comm_dtype t)
{
    const size_t lim = max_count(), es = comm_dtype_size(t);
    /* in place (comm.h: recv = send + rank * n); MPI's own in-place form leaves the result at the
     * start of the buffer */
    const bool in_place = recv == (const char *)send + (size_t)c->rank * n * es;
    if (n <= lim) {
        if (in_place) {
            MT_CHECK_MPI(MPI_Reduce_scatter_block(MPI_IN_PLACE, (void *)send, (int)n, mpi_type(t), MPI_SUM,
                                                  c->mpi));
            memmove(recv, send, n * es);
        } else {
            MT_CHECK_MPI(MPI_Reduce_scatter_block(send, recv, (int)n, mpi_type(t), MPI_SUM, c->mpi));
        }
        return;
    }
    /* block r of send reduces onto rank r: one reduction per (rank, piece) */
    for (int r = 0; r < c->size; r++)
        for (size_t o = 0; o < n; o += lim) {
            size_t k = MT_MIN(lim, n - o);
            const char *sb = (const char *)send + ((size_t)r * n + o) * es;
            const bool mine = in_place && r == c->rank;  /* the block is its own result */
            MT_CHECK_MPI(MPI_Reduce(mine ? MPI_IN_PLACE : sb, (char *)recv + o * es, (int)k, mpi_type(t),
                                    MPI_SUM, r, c->mpi));
        }
}

static void mpi_all_reduce_sum(struct comm *c, void *buf, size_t n, enum comm_dtype t)
{
    size_t es = comm_dtype_size(t);
    for (size_t done = 0; done < n;) {
        size_t chunk = MT_MIN(n - done, max_count());
        MT_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, (char *)buf + done * es, (int)chunk, mpi_type(t),
                                   MPI_SUM, c->mpi));
        done += chunk;
    }
}

/* all_to_all_v with a count or offset beyond max_count: point-to-point pieces, 64-bit offsets */
static void all_to_all_v_p2p(struct comm *c, void *recv, const int64_t *recv_counts, const void *send,
                             const int64_t *send_counts, enum comm_dtype t)
{
    const size_t lim = max_count(), es = comm_dtype_size(t);
    int n_req = 0, cap = 16;
    MPI_Request *req = mt_malloc((size_t)cap * sizeof *req);
    int64_t so = 0, ro = 0;
    for (int i = 0; i < c->size; i++) {
        for (int dir = 0; dir < 2; dir++) {
            int64_t cnt = dir ? send_counts[i] : recv_counts[i], at = dir ? so : ro;
            for (int64_t o = 0; o < cnt; o += (int64_t)lim) {
                int k = (int)MT_MIN((int64_t)lim, cnt - o);
                if (n_req == cap) req = mt_realloc(req, (size_t)(cap *= 2) * sizeof *req);
                if (dir) MT_CHECK_MPI(MPI_Isend((const char *)send + (size_t)(at + o) * es, k, mpi_type(t),
                                                i, 0, c->mpi, &req[n_req++]));
                else MT_CHECK_MPI(MPI_Irecv((char *)recv + (size_t)(at + o) * es, k, mpi_type(t), i, 0,
                                            c->mpi, &req[n_req++]));
            }
        }
        so += send_counts[i];
        ro += recv_counts[i];
    }
    /* pieces between one pair travel in order on one tag (MPI's non-overtaking rule) */
    MT_CHECK_MPI(MPI_Waitall(n_req, req, MPI_STATUSES_IGNORE));
    free(req);
}

/* MPI's int counts and displacements of an all_to_all_v whose totals fit an int (checked by the
 * callers): sc/sd for the send side, rc/rd for the receive side, [p] each */
static void v_counts_as_int(int p, const int64_t *send_counts, const int64_t *recv_counts, int *sc,
                            int *sd, int *rc, int *rd)
{
    int64_t so = 0, ro = 0;
    for (int i = 0; i < p; i++) {
        sc[i] = (int)send_counts[i];
        rc[i] = (int)recv_counts[i];
        sd[i] = (int)so;
        rd[i] = (int)ro;
        so += send_counts[i];
        ro += recv_counts[i];
    }
}

static void mpi_all_to_all_v(struct comm *c, void *recv, const int64_t *recv_counts,
                             const void *send, const int64_t *send_counts, enum comm_dtype t)
{
    int p = c->size;
    const int64_t lim = (int64_t)max_count();
    int64_t so = 0, ro = 0;
    for (int i = 0; i < p; i++) {
        so += send_counts[i];
        ro += recv_counts[i];
    }
    /* the last displacement plus its count bounds every int MPI would be handed */
    if (so > lim || ro > lim) {
        all_to_all_v_p2p(c, recv, recv_counts, send, send_counts, t);
        return;
    }
    int *sc = mt_malloc(4 * (size_t)p * sizeof(int));
    int *sd = sc + p, *rc = sc + 2 * p, *rd = sc + 3 * p;
    v_counts_as_int(p, send_counts, recv_counts, sc, sd, rc, rd);
    MT_CHECK_MPI(MPI_Alltoallv(send, sc, sd, mpi_type(t), recv, rc, rd, mpi_type(t), c->mpi));
    free(sc);
}

static void mpi_all_to_all(struct comm *c, void *recv, const void *send, size_t n, enum comm_dtype t)
{
    const size_t lim = max_count(), es = comm_dtype_size(t);
    if (n <= lim) {
        MT_CHECK_MPI(MPI_Alltoall(send, (int)n, mpi_type(t), recv, (int)n, mpi_type(t), c->mpi));
        return;
    }
    for (size_t o = 0; o < n; o += lim) {
        size_t k = MT_MIN(lim, n - o);
        MPI_Datatype piece = strided_piece(t, k, n);
        MT_CHECK_MPI(MPI_Alltoall((const char *)send + o * es, 1, piece, (char *)recv + o * es, 1, piece,
                                  c->mpi));
        MT_CHECK_MPI(MPI_Type_free(&piece));
    }
}

static size_t p2p_chunk = INT_MAX;

void comm_mpi_set_p2p_chunk(size_t elements)
{
    p2p_chunk = elements >= 1 && elements <= INT_MAX ? elements : INT_MAX;
}

struct mpi_p2p_state {
    int n;
    /* after the requests complete: move_bytes from move_src to move_dst (an in-place
     * reduce-scatter's result, which MPI leaves at the start of the buffer) */
    void *move_dst;
    const void *move_src;
    size_t move_bytes;
    MPI_Request req[];
};

/* Each op becomes ceil(count / chunk) requests of at most INT_MAX elements; both sides split the
 * same count the same way, so the k-th piece of a send meets the k-th piece of its recv. */
static void mpi_p2p_start(struct comm *c, const struct comm_p2p_op *ops, int n, struct comm_p2p_req *r)
{
    const size_t chunk = p2p_chunk;
    size_t n_req = 0;
    for (int i = 0; i < n; i++) {
        MT_CHECK(ops[i].peer >= 0 && ops[i].peer < c->size && ops[i].peer != c->rank,
                 "p2p: peer %d is not another rank of a group of %d (this is rank %d)", ops[i].peer,
                 c->size, c->rank);
        n_req += (ops[i].count + chunk - 1) / chunk;
    }
    MT_CHECK(n_req <= INT_MAX, "p2p: %zu requests", n_req);
    struct mpi_p2p_state *st = mt_calloc(1, sizeof *st + MT_MAX(n_req, 1) * sizeof(MPI_Request));
    MPI_Request *req = st->req;
    size_t k = 0;
    for (int i = 0; i < n; i++) {
        const struct comm_p2p_op *o = &ops[i];
        const size_t es = comm_dtype_size(o->dtype);
        for (size_t done = 0; done < o->count; done += chunk) {
            const int cnt = (int)MT_MIN(o->count - done, chunk);
            char *p = (char *)o->buf + done * es;
            if (o->kind == COMM_SEND)
                MT_CHECK_MPI(MPI_Isend(p, cnt, mpi_type(o->dtype), o->peer, 0, c->mpi, &req[k++]));
            else
                MT_CHECK_MPI(MPI_Irecv(p, cnt, mpi_type(o->dtype), o->peer, 0, c->mpi, &req[k++]));
        }
    }
    st->n = (int)k;
    r->state = st;
}

static void mpi_p2p_wait(struct comm *c, struct comm_p2p_req *r)
{
    (void)c;
    struct mpi_p2p_state *st = r->state;
    if (!st) return;
    MT_CHECK_MPI(MPI_Waitall(st->n, st->req, MPI_STATUSES_IGNORE));
    if (st->move_bytes) memmove(st->move_dst, st->move_src, st->move_bytes);
    free(st);
    r->state = NULL;
}

/* one MPI_Iallgather, completed by mpi_p2p_wait (counts above the int limit run blocking) */
static void mpi_all_gather_start(struct comm *c, void *recv, const void *send, size_t n, enum comm_dtype t,
                                 struct comm_p2p_req *r)
{
    r->state = NULL;
    if (n > max_count()) {
        mpi_all_gather(c, recv, send, n, t);
        return;
    }
    const bool in_place = send == (const char *)recv + (size_t)c->rank * n * comm_dtype_size(t);
    struct mpi_p2p_state *st = mt_calloc(1, sizeof *st + sizeof(MPI_Request));
    MT_CHECK_MPI(MPI_Iallgather(in_place ? MPI_IN_PLACE : send, (int)n, mpi_type(t), recv, (int)n, mpi_type(t),
                                c->mpi, &st->req[0]));
    st->n = 1;
    r->state = st;
}

/* one MPI_Ireduce_scatter_block, completed by mpi_p2p_wait (counts above the int limit run
 * blocking); in place, the wait moves the result from the buffer's start to recv */
static void mpi_reduce_scatter_sum_start(struct comm *c, void *recv, const void *send, size_t n,
                                         enum comm_dtype t, struct comm_p2p_req *r)
{
    r->state = NULL;
    if (n > max_count()) {
        mpi_reduce_scatter_sum(c, recv, send, n, t);
        return;
    }
    const size_t es = comm_dtype_size(t);
    const bool in_place = recv == (const char *)send + (size_t)c->rank * n * es;
    struct mpi_p2p_state *st = mt_calloc(1, sizeof *st + sizeof(MPI_Request));
    if (in_place) {
        MT_CHECK_MPI(MPI_Ireduce_scatter_block(MPI_IN_PLACE, (void *)send, (int)n, mpi_type(t), MPI_SUM, c->mpi,
                                               &st->req[0]));
        st->move_dst = recv;
        st->move_src = send;
        st->move_bytes = recv == send ? 0 : n * es;
    } else {
        MT_CHECK_MPI(MPI_Ireduce_scatter_block(send, recv, (int)n, mpi_type(t), MPI_SUM, c->mpi, &st->req[0]));
    }
    st->n = 1;
    r->state = st;
}

/* one MPI_Ialltoallv, completed by mpi_p2p_wait; its int counts and displacements live in the
 * request's state until then (totals above the int limit run blocking) */
static void mpi_all_to_all_v_start(struct comm *c, void *recv, const int64_t *recv_counts,
                                   const void *send, const int64_t *send_counts, enum comm_dtype t,
                                   struct comm_p2p_req *r)
{
    r->state = NULL;
    const int p = c->size;
    int64_t so = 0, ro = 0;
    for (int i = 0; i < p; i++) {
        so += send_counts[i];
        ro += recv_counts[i];
    }
    if (so > (int64_t)max_count() || ro > (int64_t)max_count()) {
        mpi_all_to_all_v(c, recv, recv_counts, send, send_counts, t);
        return;
    }
    struct mpi_p2p_state *st = mt_calloc(1, sizeof *st + sizeof(MPI_Request) + 4 * (size_t)p * sizeof(int));
    int *sc = (int *)(st->req + 1), *sd = sc + p, *rc = sc + 2 * p, *rd = sc + 3 * p;
    v_counts_as_int(p, send_counts, recv_counts, sc, sd, rc, rd);
    MT_CHECK_MPI(MPI_Ialltoallv(send, sc, sd, mpi_type(t), recv, rc, rd, mpi_type(t), c->mpi, &st->req[0]));
    st->n = 1;
    r->state = st;
}

static void mpi_p2p(struct comm *c, const struct comm_p2p_op *ops, int n)
{
    struct comm_p2p_req r = {NULL};
    mpi_p2p_start(c, ops, n, &r);
    mpi_p2p_wait(c, &r);
}

/* c->impl of an MPI comm: the all_to_all_inbox buffer, grown on demand */
struct mpi_inbox {
    void *buf;
    size_t cap;
};

/* the inbox, holding at least n elements of t */
static void *mpi_inbox_of(struct comm *c, size_t n, enum comm_dtype t)
{
    struct mpi_inbox *in = c->impl;
    if (!in) in = c->impl = mt_calloc(1, sizeof *in);
    const size_t bytes = MT_MAX(n, 1) * comm_dtype_size(t);
    if (bytes > in->cap) {
        free(in->buf);
        in->buf = mt_malloc(bytes);
        in->cap = bytes;
    }
    return in->buf;
}

static const void *mpi_all_to_all_inbox(struct comm *c, const int64_t *recv_counts,
                                        const void *send, const int64_t *send_counts,
                                        enum comm_dtype t)
{
    size_t n = 0;
    for (int s = 0; s < c->size; s++) n += (size_t)recv_counts[s];
    void *buf = mpi_inbox_of(c, n, t);
    mpi_all_to_all_v(c, buf, recv_counts, send, send_counts, t);
    return buf;
}

static const void *mpi_all_gather_inbox_start(struct comm *c, const void *send, size_t n, enum comm_dtype t,
                                              struct comm_p2p_req *r, bool without_self)
{
    r->state = NULL;
    void *buf = mpi_inbox_of(c, n * (size_t)c->size, t);
    mpi_all_gather(c, buf, send, n, t);
    const size_t es = comm_dtype_size(t);
    if (without_self) memset((unsigned char *)buf + (size_t)c->rank * n * es, 0xff, n * es); /* not to be read */
    return buf;
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
    .all_gather_inbox_start = mpi_all_gather_inbox_start,
    .p2p = mpi_p2p,
    .p2p_start = mpi_p2p_start,
    .all_gather_start = mpi_all_gather_start,
    .all_to_all_v_start = mpi_all_to_all_v_start,
    .reduce_scatter_sum_start = mpi_reduce_scatter_sum_start,
    .p2p_wait = mpi_p2p_wait,
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

static void (*timer_begin)(void), (*timer_end)(const char *);

void comm_set_timer(void (*begin)(void), void (*end)(const char *op))
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
        if (timer_end) timer_end(__func__);         \
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

void comm_p2p(struct comm *c, const struct comm_p2p_op *ops, int n)
{
    if (single(c)) {
        MT_CHECK(n == 0, "p2p: %d transfers on a group of one rank (no peers)", n);
        return;
    }
    if (n > 0) TIMED(c->ops->p2p(c, ops, n));
}

void comm_p2p_start(struct comm *c, const struct comm_p2p_op *ops, int n, struct comm_p2p_req *r)
{
    r->state = NULL;
    if (single(c)) {
        MT_CHECK(n == 0, "p2p: %d transfers on a group of one rank (no peers)", n);
        return;
    }
    if (n > 0) TIMED(c->ops->p2p_start(c, ops, n, r));
}

void comm_all_gather_start(struct comm *c, void *recv, const void *send, size_t n, enum comm_dtype t,
                           struct comm_p2p_req *r)
{
    r->state = NULL;
    if (single(c)) {
        if (recv != send) memmove(recv, send, n * comm_dtype_size(t));
        return;
    }
    TIMED(c->ops->all_gather_start(c, recv, send, n, t, r));
}

void comm_all_to_all_v_start(struct comm *c, void *recv, const int64_t *recv_counts, const void *send,
                             const int64_t *send_counts, enum comm_dtype t, struct comm_p2p_req *r)
{
    r->state = NULL;
    if (single(c)) {
        if (recv != send) memmove(recv, send, (size_t)send_counts[0] * comm_dtype_size(t));
        return;
    }
    TIMED(c->ops->all_to_all_v_start(c, recv, recv_counts, send, send_counts, t, r));
}

void comm_reduce_scatter_sum_start(struct comm *c, void *recv, const void *send, size_t n,
                                   enum comm_dtype t, struct comm_p2p_req *r)
{
    r->state = NULL;
    if (single(c)) {
        if (recv != send) memmove(recv, send, n * comm_dtype_size(t));
        return;
    }
    TIMED(c->ops->reduce_scatter_sum_start(c, recv, send, n, t, r));
}

void comm_p2p_wait(struct comm *c, struct comm_p2p_req *r)
{
    if (!r->state) return;
    TIMED(c->ops->p2p_wait(c, r));
    r->state = NULL;
}

const void *comm_all_to_all_inbox(struct comm *c, const int64_t *recv_counts, const void *send,
                                  const int64_t *send_counts, enum comm_dtype t)
{
    if (single(c)) return send;
    const void *r;
    TIMED(r = c->ops->all_to_all_inbox(c, recv_counts, send, send_counts, t));
    return r;
}

bool comm_exchange_arrival(struct comm *c, const struct comm_p2p_req *r, struct exchange_arrival *out)
{
    return c && r->state && c->ops->exchange_arrival && c->ops->exchange_arrival(c, r, out);
}

static const void *all_gather_inbox(struct comm *c, const void *send, size_t n, enum comm_dtype t,
                                    struct comm_p2p_req *r, bool without_self)
{
    r->state = NULL;
    if (single(c)) return send;
    const void *in;
    TIMED(in = c->ops->all_gather_inbox_start(c, send, n, t, r, without_self));
    return in;
}

const void *comm_all_gather_inbox_start(struct comm *c, const void *send, size_t n, enum comm_dtype t,
                                        struct comm_p2p_req *r)
{
    return all_gather_inbox(c, send, n, t, r, false);
}

const void *comm_all_gather_inbox_start_others(struct comm *c, const void *send, size_t n, enum comm_dtype t,
                                               struct comm_p2p_req *r)
{
    return all_gather_inbox(c, send, n, t, r, true);
}

static const void *inbox_start(struct comm *c, const int64_t *recv_counts, const void *send,
                               const int64_t *send_counts, enum comm_dtype t, struct comm_p2p_req *r,
                               bool self_later)
{
    r->state = NULL;
    if (single(c) || !c->ops->all_to_all_inbox_start) return comm_all_to_all_inbox(c, recv_counts, send, send_counts, t);
    const void *in;
    TIMED(in = c->ops->all_to_all_inbox_start(c, recv_counts, send, send_counts, t, r, self_later));
    return in;
}

const void *comm_all_to_all_inbox_start(struct comm *c, const int64_t *recv_counts, const void *send,
                                        const int64_t *send_counts, enum comm_dtype t, struct comm_p2p_req *r)
{
    return inbox_start(c, recv_counts, send, send_counts, t, r, false);
}

void *comm_all_to_all_inbox_start_self_later(struct comm *c, const int64_t *recv_counts, const void *send,
                                             const int64_t *send_counts, enum comm_dtype t,
                                             struct comm_p2p_req *r)
{
    if (c) {
        const int me = c->rank;
        MT_CHECK(recv_counts[me] == send_counts[me], "all_to_all_inbox: rank %d sends %lld elements to itself "
                 "but expects %lld", me, (long long)send_counts[me], (long long)recv_counts[me]);
    }
    /* the buffer is the comm's (or send itself for a group of one): the caller's to write in part */
    return (void *)inbox_start(c, recv_counts, send, send_counts, t, r, true);
}
