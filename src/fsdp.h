/* The shard/gather module (design.md "The grid": one FSDP unit at a time). It answers the model's
 * unit hooks: before a unit's forward it all-gathers the unit's weights into a working buffer
 * (reused while it still holds them), before its backward it binds a zeroed working gradient, and
 * after the backward it reduce-scatters that gradient into the rank's shard. A group of one rank
 * with a compute copy is bound once and skipped. What stays resident per rank is the shard's state
 * plus two units of working weights (one sized for the largest unit, the embedding or the head,
 * one for the largest decoder layer: the model never uses two layers or two large units at once),
 * one unit of working gradients (two with tied embeddings) and the expert staging.
 * Prefetch: each before-hook starts the gather of the unit expected next (the following layer in
 * a forward, the preceding one in a backward) into a free buffer that fits, and the next hook,
 * whichever it is, finishes it, so the gather runs while the unit between them computes (MPI:
 * a non-blocking all-gather; NCCL: a side stream). A wrong guess costs bandwidth, never a result.
 * The train loop owns it; the model never sees it. */
#ifndef MT_FSDP_H
#define MT_FSDP_H

#include <stdbool.h>
#include <stdint.h>

#include "params.h"

#define FSDP_GRAD_BUFS 2   /* a tied head binds the final norm's and the embedding's units at once */

struct fsdp_wbuf {
    int unit;              /* unit whose weights it holds (-1: none) */
    int users;             /* hooks between before_* and after_* on it */
    uint64_t last_use;     /* for reuse: the least recently used free buffer goes first */
    bool prefetched;       /* gathered ahead and not used yet */
    void *w[TG_COUNT];     /* compute dtype, per group built per unit */
    int64_t cap[TG_COUNT]; /* elements w holds */
};

struct fsdp_gbuf {
    int unit;              /* unit whose gradients it holds (-1: free) */
    float *g[TG_COUNT];    /* [params_unit_max work] fp32, per sharded group */
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
    struct fsdp_gbuf gbuf[FSDP_GRAD_BUFS];
    uint64_t clock;
    bool prefetch;             /* parallel.prefetch */
    struct fsdp_prefetch pending;
    int64_t n_gathers;         /* units gathered (prefetched or not), for the end-of-run line */
    int64_t n_prefetched;      /* of which started ahead by a before-hook and then used */
    float *stage;              /* expert all-gather output / reduce-scatter input, ep_fsdp x
                                * piece fp32 (the gather uses it in the compute dtype) */
};

/* reshard: parallel.reshard_after_forward; prefetch: parallel.prefetch. Installs the hooks on
 * p->m and binds the unsharded groups. */
void fsdp_init(struct fsdp *f, struct params *p, bool reshard, bool prefetch);
void fsdp_free(struct fsdp *f);
/* After the optimizer step: every gathered copy is stale. */
void fsdp_invalidate(struct fsdp *f);

#endif
