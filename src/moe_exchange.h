/* The MoE layer's exchange in chunks that overlap the expert GEMMs (parallel.moe_chunks > 1).
 * The layer's T tokens are cut into n contiguous chunks; each has its own route plan (counts, pairs,
 * expert offsets) and its own slice of every plan array and expert-side buffer (chunk c's entries
 * after chunk c-1's), so chunk c's expert GEMMs run on chunk c's rows alone. The all-to-alls are
 * started (comm_all_to_all_v_start: MPI_Ialltoallv, or NCCL on the comm's side stream) before the
 * GEMMs of the previous chunk are queued and waited on after them: chunk c+1's dispatch and
 * chunk c's combine cross while chunk c+1's (resp. c's) GEMMs run. Per token the same expert
 * outputs are added in the same order as with one chunk, so the layer output and every gradient
 * except the expert weights' are bit-identical; an expert's weight gradient sums its rows chunk by
 * chunk (with ep > 1 a different order, equal to rounding). */
#ifndef MT_MOE_EXCHANGE_H
#define MT_MOE_EXCHANGE_H

#include <stdint.h>

struct model;
struct layer_acts;

/* One chunk's plan (host): tokens [t0, t0 + T) of the layer */
struct moe_chunk {
    int t0, T;
    int64_t pair0, P_send;   /* its sent pairs: [pair0, pair0 + P_send) of the layer's */
    int64_t recv0, P_recv;   /* its received pairs (without pairs: its tokens) */
    int64_t row0, R;         /* its expert-side rows */
    int64_t *send_counts, *recv_counts; /* [ep] pairs per EP rank */
    int64_t *expert_off;     /* dev [n_local + 1] rows of each local expert, from row0 (a slice of
                              * the layer's route.chunk_off) */
};

/* moe_forward / moe_backward's expert part when m->moe_chunks > 1 (the router stays in moe.c) */
void moe_exchange_forward(struct model *m, struct layer_acts *a, int l, void *out, const void *resid);
void moe_exchange_backward(struct model *m, struct layer_acts *a, int l);

/* The count exchange of moe.c's one-piece path and of the chunked one: pairs per rank both ways,
 * and the expert rows the pairs sent to each rank make there (send_rows [ep]); returns the rows
 * this rank gets */
int64_t moe_exchange_counts(struct model *m, int64_t *recv_counts, const int64_t *send_counts,
                            const int64_t *send_rows);

#endif
