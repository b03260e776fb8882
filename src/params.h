/* Sharded parameter state: fp32 master weights, Adam moments and reduced gradients, held only for
 * this rank's shard, plus the collectives that turn shards into the model's working weights
 * (all-gather) and working gradients into shard gradients (reduce-scatter).
 *
 * Non-expert tensors: the stage's dense working buffer (every non-expert tensor back to back, in
 * table order) is split into S equal contiguous chunks (the last padded): one all-gather and one
 * reduce-scatter per step, with no reordering. Expert tensors: each local [E/ep, d1, d2] tensor is
 * split along dim 1 across EP_FSDP (rows padded to ceil(d1 / ep_fsdp)); the shard is those row
 * blocks of every expert tensor back to back. Expert gradients are summed over EP_FSDP (the EP
 * all-to-all already brought every token's contribution to the expert's owner); non-expert
 * gradients over the stage. */
#ifndef MT_PARAMS_H
#define MT_PARAMS_H

#include "comm.h"
#include "config.h"
#include "mesh.h"
#include "model.h"

struct param_segment {      /* a run of shard elements with one optimizer treatment */
    int64_t off, len;
    bool decay, frozen;
};

struct param_group_shard {
    int64_t numel;          /* elements of this rank's shard (including padding) */
    int64_t chunk;          /* dense: elements per rank; expert: unused */
    float *master, *m1, *m2, *grad;   /* backend memory, [numel] */
    void *param_x;          /* compute-dtype copy of master, [numel] */
    void *gather_x;         /* compute-dtype receive buffer, [group size * numel] */
    float *scatter_f;       /* fp32 send buffer for the reduce-scatter, [group size * numel] */
    bool aliased;           /* group of one: param_x and grad are the model's working buffers and
                             * gather_x / scatter_f are not allocated */
    struct param_segment *seg;
    int n_seg;
};

struct params {
    struct model *m;
    struct comm *stage;     /* dense group (NULL = one rank) */
    struct comm *fsdp;      /* expert shard group (NULL = one rank) */
    int S, S_rank, F, F_rank;
    struct param_group_shard g[TG_COUNT];
    int64_t *exp_rows;      /* [tt.n] padded rows of each expert tensor's dim-1 block (0 = dense) */
    int64_t *exp_shard_off; /* [tt.n] offset of each expert tensor's block in the expert shard */
    int step;               /* optimizer steps taken */
};

void params_init(struct params *p, struct model *m, struct comm *stage, struct comm *fsdp);
void params_free(struct params *p);

/* Fill the master shards from a Hugging Face model directory (or .safetensors file), reading only
 * the tensors' parts this rank holds. false + one-line message in err on any problem. */
bool params_load_hf(struct params *p, const char *model_dir, char *err, int errcap);
/* Seeded random init as transformers does it: normal(0, initializer_range) for matrices, the
 * router and experts; 1 for norms. Each element's value depends only on (seed, tensor, index),
 * so every mesh initialises the same model. */
void params_init_random(struct params *p, uint64_t seed);

/* master shards -> working weights of the model (all-gather) */
void params_gather_weights(struct params *p);
/* model working grads -> shard grads (reduce-scatter); returns the global squared L2 norm of the
 * gradient (each element counted once), all-reduced over `world` */
double params_reduce_grads(struct params *p, struct comm *world);
/* AdamW on the shards with the given lr and gradient scale (clipping) */
void params_adamw_step(struct params *p, const struct train_config *t, float lr, float grad_scale);

/* Collective over the mesh's world: rank 0 receives every rank's fp32 master shards and assembles
 * the GLOBAL layout of the tensor table (every expert) into `global` (host buffers sized as
 * tt.group_numel; only rank 0's are written). For export and tests; pp = 1 only for now. */
void params_gather_global(const struct params *p, const struct mesh *mesh, float *const global[TG_COUNT]);

/* Copy the full working weights of the model (fp32, working layout) into host buffers; for tests
 * and verify. */
void params_working_to_host(const struct params *p, float *host[TG_COUNT]);

/* Calls fn for every run of the shard held by the rank at stage position s_rank, EP_FSDP position
 * f_rank with experts from expert0: `len` elements of tensor i starting at element `gidx` of its
 * flattened global layout sit at shard offset `soff` of group g (padding is in no run). Every
 * rank's shard has the same size and layout; only the runs' sources differ. For checkpoints and
 * tests. */
typedef void (*params_run_fn)(void *ctx, enum tensor_group g, int i, int64_t gidx, int64_t soff,
                              int64_t len);
void params_for_each_run_of(const struct params *p, int s_rank, int f_rank, int64_t expert0,
                            params_run_fn fn, void *ctx);

#endif
