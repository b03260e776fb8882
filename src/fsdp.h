/* The shard/gather module (design.md "The grid": one FSDP unit at a time). It answers the model's
 * unit hooks: before a unit's forward it all-gathers the unit's weights into a working buffer
 * (reused while it still holds them), before its backward it binds a zeroed working gradient, and
 * after the backward it reduce-scatters that gradient into the rank's shard. A group of one rank
 * (no sharding) is bound once and skipped. What stays resident per rank is the shard's state plus
 * `n_bufs` units of working weights, two units of working gradients and the collective staging.
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
    void *w[TG_COUNT];     /* [params_unit_max work] compute dtype, per sharded group */
};

struct fsdp_gbuf {
    int unit;              /* unit whose gradients it holds (-1: free) */
    float *g[TG_COUNT];    /* [params_unit_max work] fp32, per sharded group */
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
    void *stage_x[TG_COUNT];   /* expert all-gather output, group x piece */
    void *send_x[TG_COUNT];    /* cast of the master piece when there is no compute copy */
    float *stage_f[TG_COUNT];  /* expert reduce-scatter input, group x piece */
    float *out_f[TG_COUNT];    /* reduce-scatter output, piece */
};

/* reshard: parallel.reshard_after_forward. Installs the hooks on p->m and binds the unsharded
 * groups. */
void fsdp_init(struct fsdp *f, struct params *p, bool reshard);
void fsdp_free(struct fsdp *f);
/* After the optimizer step: every gathered copy is stale. */
void fsdp_invalidate(struct fsdp *f);

#endif
