/* Sharded parameter state (design.md "The grid", "Memory layout"): fp32 master weights, Adam moments
 * and reduced gradients held only for this rank's shard, cut per FSDP unit (tensor_unit: the
 * embedding, each decoder layer, the final norm + lm_head), plus the unit-at-a-time collectives
 * that turn a unit's shard pieces into its working weights (all-gather) and its working gradients
 * into shard gradients (reduce-scatter, accumulated into the shard) -- fsdp.c drives them.
 *
 * Non-expert tensors of unit u (those on this rank's stage, back to back in table order: the
 * unit's dense working buffer of w_u elements) are split into S equal contiguous chunks of
 * ceil(w_u / S) (the last padded): the all-gather of the chunks IS the working buffer. Expert
 * tensors of unit u ([E/ep, d1, d2] local experts each) are split along dim 1 across EP_FSDP (rows
 * padded to ceil(d1 / ep_fsdp)); the piece is those row blocks of the unit's expert tensors back to
 * back, reordered into the working layout after the gather. A rank's shard is its pieces of every
 * unit of the stage, in unit order. A group of one (S = 1 or ep_fsdp = 1) holds every unit whole:
 * its shard layout equals the working layout, so the working weights and gradients ARE the shard's
 * compute copy and gradient (no gathers, no copies). Expert gradients are summed over EP_FSDP (the
 * EP all-to-all already brought every token's contribution to the expert's owner); non-expert
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
    float *master, *grad;   /* backend memory, fp32 [numel] */
    void *m1, *m2;          /* Adam moments [numel], fp32 or bf16 (train.optimizer_state_dtype) */
    /* compute-dtype copy of master [numel] that AdamW keeps current, or NULL when every gather
     * casts from master (train.weight_copy); the same memory as master when the compute dtype is
     * fp32 */
    void *param_x;
    /* train.master_weights split (params.split_master): the master's low halves [numel]; its high
     * halves are param_x, and master is NULL (master_split.h; params_master_read / _write) */
    uint16_t *master_lo;
    bool aliased;           /* group of one: the working weights/grads are the shard's */
    int group_size;
    /* per unit (n_units): the piece's offset and padded size in the shard (equal on every rank of
     * the group), and the unit's working elements (dense: group_size x piece, the tail padding) */
    int64_t *u_off, *u_piece, *u_work;
    struct param_segment *seg;
    int n_seg;
};

struct params {
    struct model *m;
    struct comm *stage;     /* dense group (NULL = one rank) */
    struct comm *fsdp;      /* expert shard group (NULL = one rank) */
    int S, S_rank, F, F_rank;
    int n_units;            /* L + 2 */
    struct param_group_shard g[TG_COUNT];
    int64_t *t_off;         /* [tt.n] offset of tensor i in its unit's working buffer of its
                             * group (-1: not on this stage) */
    int64_t *exp_rows;      /* [tt.n] padded rows of each expert tensor's dim-1 block (0 = dense) */
    int64_t *exp_piece_off; /* [tt.n] offset of an expert tensor's row blocks in its unit's piece */
    int step;               /* optimizer steps taken */
    size_t mom_bytes;       /* 4 (fp32 moments) or 2 (bf16) */
    bool split_master;      /* train.master_weights: split (bf16 compute copy kept) */
    /* params_adamw.c: every group's unfrozen segments for adamw_update_multi, built at the first
     * step with weight decay opt_seg_wd */
    struct adamw_segment *opt_seg;
    int n_opt_seg;
    bool opt_seg_built;
    double opt_seg_wd;
    bool adamw_per_tensor;  /* MT_ADAMW_PER_TENSOR=1: one AdamW call per segment (benchmarking) */
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

/* keep_copy: hold the compute copy (train.weight_copy); bf16_moments: train.optimizer_state_dtype;
 * split_master: train.master_weights split (needs the copy, in bf16). */
void params_init_opts(struct params *p, struct model *m, struct comm *stage, struct comm *fsdp,
                      bool keep_copy, bool bf16_moments, bool split_master);
/* Elements [off, off + n) of group g's fp32 master to / from fp32 host memory: a download or an
 * upload, or with a split master its two halves joined / split on the host (the write sets the
 * compute copy with them: no params_refresh_copy needed, though harmless). For checkpoints,
 * initialisation and export. */
void params_master_read(const struct params *p, enum tensor_group g, int64_t off, int64_t n, float *host);
void params_master_write(struct params *p, enum tensor_group g, int64_t off, int64_t n, const float *host);
/* Moment k (1 or 2) of group g to / from fp32 host memory [numel] (bf16 moments widen exactly;
 * fp32 values narrow to nearest-even bf16), and zeroing. For checkpoints. */
void params_moment_to_host(const struct params *p, enum tensor_group g, int k, float *host);
void params_moment_from_host(struct params *p, enum tensor_group g, int k, const float *host);
void params_moments_zero(struct params *p);
/* Makes the compute copy (if any) equal the master after the masters were written (load, init). */
void params_refresh_copy(struct params *p);
/* Every unit of a group of one is bound for good; the others through fsdp.c. Without fsdp.c
 * (tests, verify: params_init with NULL comms) everything is a group of one. */
void params_bind_aliased(struct params *p);
/* MT_STASH_IN_GRADS (stash_place.h): the layers whose expert gradients are the shard's own (group
 * of one) and first written in a step's last backward (model_expert_grads_written_last), as hosts
 * with their memory; room for L. Returns how many. */
struct stash_host;
int params_expert_grad_hosts(struct params *p, int n_micro, struct stash_host *hosts, void **mem);
/* Unit u of group g: its working weights from every rank's piece into `work` (compute dtype,
 * [g->u_work[u]]), and its working gradient `work_g` (fp32 [u_work], padding zero; clobbered)
 * reduce-scattered and added to the shard gradient. `stage`: expert scratch of group_size x piece
 * fp32 elements (unused for the dense group). */
void params_gather_unit(struct params *p, enum tensor_group g, int u, void *work, void *stage);
/* The gather in two halves, for prefetching: between them the collective is in flight and
 * neither `work` nor `stage` may be touched (finish reorders the experts from `stage`). */
void params_gather_unit_start(struct params *p, enum tensor_group g, int u, void *work, void *stage,
                              struct comm_p2p_req *r);
void params_gather_unit_finish(struct params *p, enum tensor_group g, int u, void *work, void *stage,
                               struct comm_p2p_req *r);
void params_reduce_unit(struct params *p, enum tensor_group g, int u, float *work_g, float *stage);
/* The reduction in two halves, for overlapping it with the next unit's backward: between them
 * neither `work_g` nor `stage` may be touched; finish adds the rank's sum to the shard. With
 * into_shard (both halves alike) the sum is written over the unit's part of the shard's gradient
 * instead, by the reduce-scatter itself (nothing left to add; neither may that part be touched in
 * between): for a unit's only reduction of a step, into a shard zeroed at the step's start (the
 * same values: 0 + x is x). */
void params_reduce_unit_start(struct params *p, enum tensor_group g, int u, float *work_g, float *stage,
                              struct comm_p2p_req *r, bool into_shard);
void params_reduce_unit_finish(struct params *p, enum tensor_group g, int u, float *work_g, float *stage,
                               struct comm_p2p_req *r, bool into_shard);
/* Largest working elements of group g over the decoder layers' units alone. */
int64_t params_layer_unit_max(const struct params *p, enum tensor_group g);
/* Group of one with a compute copy: its weights are bound for good. */
bool params_static_weights(const struct params *p, enum tensor_group g);
/* Binds unit u's tensors of group g to working buffers (NULL leaves that binding as it is). */
void params_bind_unit(struct params *p, enum tensor_group g, int u, void *work, float *work_g);
/* Largest per-unit sizes of group g: working elements and piece. */
void params_unit_max(const struct params *p, enum tensor_group g, int64_t *work, int64_t *piece);
void params_zero_grad(struct params *p);
/* Global squared L2 norm of the shard gradients (each element counted once), all-reduced over
 * `world`. */
double params_grad_sumsq(struct params *p, struct comm *world);
/* The same with some groups' sums already taken (known[g]; NAN: take it now), added in the same
 * order: the same bits. */
double params_grad_sumsq_with(struct params *p, const double *known /*[TG_COUNT]*/, struct comm *world);
/* One group's sum of squared gradients on this rank (waits for it) */
double params_group_grad_sumsq(struct params *p, enum tensor_group g);
/* The same where some tensors' sums are known already (known[i], tensor i of the table; NAN: not
 * known; NULL: none): a unit whose tensors of g all have sums adds them in table order, the runs
 * of units between are read in one pass each. Groups of one only (the shard is the working
 * layout); others take the plain pass. */
double params_group_grad_sumsq_known(struct params *p, enum tensor_group g, const double *known /*[tt.n]*/);
/* AdamW on the shards with the given lr and gradient scale (clipping): one adamw_update_multi
 * call over the shard, or one call per segment under MT_ADAMW_PER_TENSOR=1 (the same bits) */
void params_adamw_step(struct params *p, const struct train_config *t, float lr, float grad_scale);
/* For single-process tools and tests: the model's working weights from the masters (every group
 * of one; a no-op when aliased). */
void params_gather_weights(struct params *p);

/* Collective over the mesh's world: rank 0 receives every rank's fp32 master shards and assembles
 * the GLOBAL layout of the tensor table (every expert) into `global` (host buffers sized as
 * tt.group_numel; only rank 0's are written). For export and tests; pp = 1 only for now. */
void params_gather_global(const struct params *p, const struct mesh *mesh, float *const global[TG_COUNT]);

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
