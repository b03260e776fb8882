/* The shard/gather module (design.md "The grid": one FSDP unit at a time). It answers the model's
 * unit hooks: before a unit's forward it all-gathers the unit's weights into a working buffer
 * (reused while it still holds them), before its backward it binds a zeroed working gradient, and
 * after the backward it reduce-scatters that gradient into the rank's shard. A group of one rank
 * with a compute copy is bound once and skipped. What stays resident per rank is the shard's state
 * plus two units of working weights (one sized for the largest unit, the embedding or the head,
 * one for the largest decoder layer: the model never uses two layers or two large units at once),
 * one unit of working gradients per group (two with tied embeddings) and the expert staging,
 * and with prefetch one more dense working gradient of the largest layer.
 * Prefetch: each before-hook starts the gather of the unit expected next (the following layer in
 * a forward, the preceding one in a backward) into a free buffer that fits, and the next hook,
 * whichever it is, finishes it, so the gather runs while the unit between them computes (MPI:
 * a non-blocking all-gather; NCCL: a side stream). A wrong guess costs bandwidth, never a result.
 * With prefetch the dense reduce-scatter overlaps too: after a unit's backward it is started and
 * left in flight in its gradient buffer while the unit before it runs its backward in the other
 * one; it is finished (and added to the shard) when its buffer is needed again or by fsdp_flush
 * before the gradients are read. The experts' reduction shares the staging with the gathers and
 * stays blocking. With parallel.reduce_grads = step each sharded unit has its own gradient buffer
 * instead, kept bound across the step's micro-steps, and each unit is reduced once: with prefetch
 * the dense units as the step's last backward leaves them (in flight behind the next unit's
 * backward), the rest in fsdp_flush. The train loop owns it; the model never sees it. */
#ifndef MT_FSDP_H
#define MT_FSDP_H

#include <stdbool.h>
#include <stdint.h>

#include "params.h"

/* a tied head binds the final norm's and the embedding's units at once; one more lets a dense
 * reduce-scatter run while the next unit's backward computes */
#define FSDP_GRAD_BUFS 3

struct fsdp_wbuf {
    int unit;              /* unit whose weights it holds (-1: none) */
    int users;             /* hooks between before_* and after_* on it */
    uint64_t last_use;     /* for reuse: the least recently used free buffer goes first */
    bool prefetched;       /* gathered ahead and not used yet */
    void *w[TG_COUNT];     /* compute dtype, per group built per unit */
    int64_t cap[TG_COUNT]; /* elements w holds */
};

/* One working gradient buffer of one group. */
struct fsdp_gbuf {
    int unit;              /* unit whose gradients it holds (-1: free) */
    bool reducing;         /* its reduce-scatter is in flight (req) */
    struct comm_p2p_req req;
    uint64_t started;      /* when the reduction started: the oldest is finished first */
    bool into_shard;       /* the reduction writes the shard's gradient itself (reduce_grads=step) */
    float *g;              /* [cap] fp32 */
    int64_t cap;
};

struct fsdp_prefetch {
    struct fsdp_wbuf *buf;                /* NULL: nothing in flight */
    struct comm_p2p_req req[TG_COUNT];
};

struct fsdp {
    struct params *p;
    bool dyn_w[TG_COUNT];      /* the group's working weights are built per unit (gathered, or
                                * cast from the master when no compute copy is kept) */
    bool dyn_g[TG_COUNT];      /* its gradients go through a unit buffer and a reduce-scatter */
    bool reshard;              /* free a unit's weights after its forward (else keep to backward) */
    int n_bufs;
    struct fsdp_wbuf *wbuf;
    struct fsdp_gbuf gbuf[TG_COUNT][FSDP_GRAD_BUFS]; /* per group, n_gbufs[g] of them */
    int n_gbufs[TG_COUNT];
    /* reduce_grads=step: [n_units] per sharded group, each unit's own fp32 gradient buffer
     * ([u_work[u]]) accumulating over the step's micro-steps (NULL: the pool above) */
    struct fsdp_gbuf *unit_g[TG_COUNT];
    bool overlap_reduce;       /* the dense group's reduce-scatters are left in flight (prefetch) */
    uint64_t clock;
    bool prefetch;             /* parallel.prefetch */
    struct fsdp_prefetch pending;
    int64_t n_gathers;         /* units gathered (prefetched or not), for the end-of-run line */
    int64_t n_prefetched;      /* of which started ahead by a before-hook and then used */
    int64_t n_reduces;         /* reduce-scatters (dense and expert), for the same line */
    int64_t n_reduces_overlapped; /* of which left in flight behind the next unit's backward */
    float *stage;              /* expert all-gather output / reduce-scatter input, ep_fsdp x
                                * piece fp32 (the gather uses it in the compute dtype) */
};

/* reshard: parallel.reshard_after_forward; prefetch: parallel.prefetch; reduce_per_step:
 * parallel.reduce_grads = step. Installs the hooks on p->m and binds the unsharded groups. */
void fsdp_init(struct fsdp *f, struct params *p, bool reshard, bool prefetch, bool reduce_per_step);
void fsdp_free(struct fsdp *f);
/* Whether a unit's non-expert gradient stays in place from its backward until the step's last
 * backward (not sharded, or reduce_grads=step with a buffer per unit), so that work adding to it
 * may run after the unit's after_backward hook in every backward but the last. */
bool fsdp_dense_grads_persist(const struct fsdp *f);
/* Whether group g's gradients go through a reduction (fsdp_flush finishes it); false: each backward
 * adds straight into the shard, final once the last backward's work has run. */
bool fsdp_group_reduces(const struct fsdp *f, enum tensor_group g);
/* After the last backward of a step, before its gradients are read: finishes every reduction in
 * flight. */
void fsdp_flush(struct fsdp *f);
/* After the optimizer step: every gathered copy is stale. */
void fsdp_invalidate(struct fsdp *f);

#endif
