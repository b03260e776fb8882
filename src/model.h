/* The Qwen3-MoE model over the backend ops: weights in working layout, saved activations, and the
 * forward and backward of one micro-batch. Backend-blind: every tensor operation goes through
 * `struct backend`. With expert parallelism a rank holds only its EP group's share of experts in
 * the working buffers and moves tokens to them through the MoE dispatch (moe_dispatch.c). */
#ifndef MT_MODEL_H
#define MT_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "comm.h"
#include "config.h"
#include "ops.h"
#include "tensors.h"

struct route_replay;
struct stash_host;

/* Per-layer MoE routing of one micro-batch (moe_dispatch.c: token-once dispatch). Sender side: this rank's
 * tokens; receiver side: the pairs (token, this rank) that arrive for this rank's experts. */
struct moe_route {
    int64_t *expert_off;     /* dev [n_local + 1]: rows of each local expert in the expert input
                              * (the route plan's; with ep = 1 the host never reads them) */
    int64_t *send_counts;    /* host [ep]: pairs sent to each EP rank (ep = 1: the T tokens) */
    int64_t *recv_counts;    /* host [ep]: pairs received from each EP rank */
    int64_t P_send, P_recv;  /* pairs sent and received */
    int64_t R_exp;           /* expert-side rows, expert_off[n_local]: T·k without pairs (the
                              * router fills every slot), with them the count exchange's sum; in
                              * the fixed exchange the capacity rows_cap (>= expert_off[n_local]) */
    /* sender side, ep > 1 */
    int32_t *pair_tok;       /* dev [T * min(k, ep)]: token of each sent pair (rank, token order) */
    int32_t *tok_pair;       /* dev [T, k]: pair of choice j's rank at its first choice, else -1 */
    int32_t *w_map;          /* dev [T, k]: where choice j's weight sits in the pairs' k slots */
    /* receiver side (ep = 1: meta_* are the layer's topk_idx/topk_w, re-sorted ascending) */
    int32_t *meta_idx;       /* dev [P_recv, k]: local expert of each pair slot, MT_NO_EXPERT = empty */
    float *meta_w;           /* dev [P_recv, k]: its routing weight */
    int32_t *exp_src;        /* dev [R_exp]: pair (token) of each expert-side row */
    int32_t *exp_slot;       /* dev [P_recv, k]: expert-side row of each slot, -1 if empty */
    int64_t cap_pairs;       /* pairs the receiver arrays hold (ep > 1) */
    bool by_token;           /* the fixed exchange's layout: pair d·T + t is token t's with rank d,
                              * so every rank's block of rows is the token rows (sent by all-gather) */
    struct moe_chunk *chunks; /* host [moe_chunks]: each chunk's plan (moe_exchange.c), or NULL */
    int64_t *chunk_off;       /* dev [moe_chunks, n_local + 1]: the chunks' expert offsets */
};

struct layer_acts {
    void *h_in;      /* [T, H]   residual stream entering the layer */
    void *a;         /* [T, H]   input_layernorm output */
    float *rstd_a;   /* [T] */
    void *q_pre;     /* [T, Hq, D]  q_proj output (before q_norm) */
    void *k_pre;     /* [T, Hkv, D] */
    float *rstd_q;   /* [T * Hq] */
    float *rstd_k;   /* [T * Hkv] */
    void *q;         /* [T, Hq, D]  after q_norm and RoPE */
    void *k;         /* [T, Hkv, D] after k_norm and RoPE */
    void *v;         /* [T, Hkv, D] */
    void *attn;      /* [T, Hq * D] attention output (before o_proj) */
    float *lse;      /* [B, Hq, S] */
    void *h_mid;     /* [T, H]   after the attention residual */
    void *m;         /* [T, H]   post_attention_layernorm output */
    float *rstd_m;   /* [T] */
    /* MoE */
    float *logits;   /* [T, E]   router logits (fp32), dlogits in the backward */
    float *probs;    /* [T, E]   router softmax (fp32) */
    int32_t *topk_idx; /* [T, k] */
    float *topk_w;   /* [T, k] */
    void *x_exp;     /* [R_max, H]  rows grouped by local expert */
    void *gu;        /* [R_max, 2I] gate|up projections (or [T, 2 Id] for a dense MLP layer) */
    void *act;       /* [R_max, I]  silu(gate) * up */
    void *y_exp;     /* [R_max, H]  expert outputs, expert-major */
    struct moe_route route;
    int64_t cap_rows;  /* rows x_exp/gu/act/y_exp can hold */
    bool rows_fixed;   /* x_exp/act may be a parked slot's (expert_wgrad_stash.direct): never regrown */
};

/* parallel.expert_wgrad_pairs / expert_wgrad_group: one MoE layer's expert rows of a micro-step
 * whose weight gradients wait for a later micro-step's backward, where one grouped GEMM per weight
 * takes every waiting row set and its own (ops.h expert_matmul_wgrad_sets: dw is read and written
 * once for the group). The buffers are swapped with the layer's and the backward scratch, never
 * copied (moe.c). */
struct expert_rows_parked {
    void *x_exp;        /* [cap_rows, H]  gate_up input rows, expert-major */
    void *act;          /* [cap_rows, I]  down input rows (sized as layer_acts.act) */
    void *d_gu;         /* [d_cap_rows, 2I] gate_up output gradient (sized as model.d_gu) */
    void *d_y_exp;      /* [d_cap_rows, H]  down output gradient */
    int64_t cap_rows, d_cap_rows;
    int64_t *off;       /* dev [n_local + 1]: each local expert's rows in the above */
    int64_t rows;       /* the rows the above hold for it (the layer's R_exp then) */
    unsigned in_grads;  /* bit b: the b-th of x_exp, act, d_gu, d_y_exp lies in another layer's
                         * expert gradients (MT_STASH_IN_GRADS), not an allocation of its own */
};
struct expert_wgrad_stash {
    /* [n_slots] the group's parked micro-steps, [n_slots] the last one's too while its job waits */
    struct expert_rows_parked slot[MT_WGRAD_MAX_SETS];
    int n_slots;        /* the group's micro-steps - 1 (0: the layer does not group) */
    int pending;        /* slots holding micro-steps whose weight gradients are not in dw yet */
    /* expert wgrad jobs (moe_wgrad_jobs.h): slots [0, pending) make a job whose grouped weight
     * gradients run in parts at later exchanges' waits, the rest at its deadline */
    bool job;
    bool job_fresh;     /* its sums overwrite dw (exp_dw_fresh when it was queued) */
    int64_t job_seq;    /* queue order */
    int32_t *cursor;    /* backend memory [4]: the down and gate_up parts' (ops.h wgrad_part) */
    /* MT_STASH_IN_GRADS (stash_place.h): some slot buffers lie in lower layers' expert gradients,
     * so none is swapped: the forward writes its rows into slot[pending] (x_exp/act point there)
     * and the backward its output gradients (m->d_gu/d_y_exp point there while it runs) */
    bool direct;
    int n_used;         /* the slots a group fills: min(n_slots, micro-steps - 1) */
    void *own_x, *own_act; /* the layer's own x_exp / act: the group's last micro-step's rows */
};

/* One micro-batch in flight: a pipeline stage keeps several (1F1B), a stage of one keeps one. */
struct model_slot {
    int32_t *ids;               /* dev [T] */
    int32_t *targets;           /* dev [T] (shifted labels, MT_IGNORE_INDEX where none) */
    int32_t *pos;               /* dev [T] RoPE positions (t mod S unless documents are set) */
    int32_t *seg;               /* dev [T] document id per token, NULL = causal over the whole sequence
                                 * (model_set_documents) */
    struct layer_acts *layers;  /* [L]; only the stage's layers are allocated, and with recompute
                                 * only their h_in (`shared` in struct model holds the rest) */
    void *h_out;                /* [T, H] residual after the stage's last layer (the stage output;
                                 * on the last stage the input of the final norm) */
};

/* FSDP units (design.md "The grid"): unit 0 is the embedding, 1 + l decoder layer l, L + 1 the final
 * norm and lm_head (tensor_unit in tensors.h). The model announces every use of a unit's weights and
 * gradients through these hooks and never knows where the memory comes from or whether it is
 * sharded; the shard/gather module (fsdp.c) binds the pointers (model_bind). NULL hooks: every tensor
 * of the stage is bound once and stays bound. */
struct model_unit_hooks {
    void *ctx;
    void (*before_forward)(void *ctx, int unit);    /* weights of the unit bound */
    void (*after_forward)(void *ctx, int unit);     /* the forward is done with them */
    void (*before_backward)(void *ctx, int unit);   /* weights (also for the recompute) and the
                                                     * unit's gradients bound; gradients accumulate */
    void (*after_backward)(void *ctx, int unit);    /* the unit's gradients of this micro-batch are
                                                     * complete */
};

/* Which part of the model a rank runs (design.md "Pipeline"): layers [layer0, layer1), the
 * embedding when first, the final norm + lm_head + loss when last; n_slots micro-batches in flight. */
struct model_stage {
    int layer0, layer1;
    bool first, last;
    int n_slots;
};

/* A weight gradient held back within one backward (model_run_deferred_wgrad): dw [O, I] += doutᵀ ·
 * in, dout [N, O], in [N, I]; dw NULL = nothing pending */
struct deferred_wgrad {
    float *dw;
    const void *dout, *in;
    int N, I, O;
};

struct model {
    const struct backend *be;
    struct model_config cfg;
    struct tensor_table tt;
    int H, V, D, Hq, Hkv, E, K, I, Id, L;
    int n_moe_layers;           /* MoE layers of the whole model (the aux statistic pools them all) */
    struct model_stage st;

    /* expert parallelism */
    struct comm *ep_comm;       /* EP group (NULL = ep 1) */
    int ep, ep_rank, n_local_experts, expert0;
    /* token-once pairs and an all-to-all carry the rows: ep > 1, or MT_MOE_LOOPBACK=1 (an ep = 1
     * run through the same exchange with itself, to time it on one device) */
    bool pairs;
    int moe_chunks;             /* parallel.moe_chunks: > 1 = the overlapped exchange, moe_exchange.c */
    /* The one-chunk exchange without host waits (model_enable_fixed_exchange, parallel.
     * moe_fixed_exchange): while rows_by_capacity is set (the caller arms it around the forwards
     * whose overflow it checks), each rank sends every rank a block of T pairs, padding included,
     * and each layer's expert-side rows are held to its rows_cap, so that the host never reads a
     * count back; rows_need (dev [L, 2], ops.h moe_rows_cap) keeps the most rows each layer needed
     * and how many of its plans were cut. Off: the pair counts come to the host and cross over MPI
     * (one wait a layer). */
    bool fixed_exchange, rows_by_capacity;
    /* parallel.moe_combine_self_last (moe_dispatch.c moe_down_and_combine_self_last): the down projection of the other
     * ranks' rows first, their pair sums on their way home while this rank's own rows run; in
     * the combine's backward (moe_combine_rows_backward) this rank's own pairs first, while the
     * other ranks' dL/d(out) rows arrive; with the fixed exchange the dispatch gathers this rank's
     * own token rows from a->m while the others cross (moe_dispatch_rows), and neither all-gather
     * copies the block to self;
     * rows_split (dev [2, n_local + 1], allocated at first use) holds where each expert's own
     * rows begin and end (ops.h moe_rows_split) */
    bool combine_self_last;
    /* MT_MOE_DISPATCH=gather: moe_dispatch_rows copies x_exp as a gather by row (exp_src), each
     * source row read once per expert slot, instead of by slot (ops.h dispatch_rows; the same
     * bytes either way) */
    bool dispatch_by_gather;
    int64_t *rows_split;
    int64_t *rows_cap;          /* host [L]: expert-side rows layer l may use (its buffers hold at least this) */
    int64_t *rows_need;         /* dev [L, 2] */

    /* tensor i's working weight (compute dtype; for an expert tensor the local experts
     * [n_local, d1, d2]) and fp32 gradient; NULL while unbound or not on this stage */
    void **wp;                  /* [tt.n] */
    float **gp;                 /* [tt.n] */
    /* [L]: layer l's expert gradients (gate_up and down, as bound) hold nothing yet and were not
     * zeroed: its next expert backward overwrites them instead of adding (ops.h dw_overwrite),
     * saving the memset and the first read of ~2.4 GB a 30B-A3B layer. Set by whoever skipped
     * the zeroing (params_zero_grad, fsdp's before_backward), cleared by that backward. */
    bool *exp_dw_fresh;
    /* model_enable_grad_sumsq: tensor i's Σ grad² as its step's last weight-gradient pass left
     * it (backend memory [tt.n]), and whether that pass ran this step (host [tt.n]) */
    double *grad_sumsq;
    bool *grad_sumsq_taken;
    /* [L], or NULL when parallel.expert_wgrad_pairs is off (model_enable_expert_wgrad_pairs); a
     * layer whose off is NULL does not pair */
    struct expert_wgrad_stash *wstash;
    /* set by the caller of a backward: another backward of the same optimizer step follows on this
     * stage, so expert weight gradients may wait for it; cleared by every backward */
    bool more_backwards;
    /* expert wgrad jobs (parallel.expert_wgrad_jobs, moe_wgrad_jobs.h; needs wstash): a
     * grouping layer's weight gradients wait for exchange waits instead of running in its
     * backward; wgrad_job_seq numbers them */
    bool wgrad_jobs;
    int64_t wgrad_job_seq;
    /* weight gradients held back to run under the next MoE layer's backward exchanges
     * (model_enable_deferred_wgrads; NULL = off): o_wgrad_dout [T, H] keeps a layer's dL/d(o_proj
     * output), q_wgrad_dout [T, Hq*D] its dL/d(q_proj output); `deferred` holds the pending ones,
     * oldest first */
    void *o_wgrad_dout, *q_wgrad_dout;
    struct deferred_wgrad deferred[2];
    int n_deferred;
    struct model_unit_hooks hooks;
    /* model_own_weights (tests, verify without params): flat buffers behind wp / gp */
    void *own_w;
    float *own_g;

    /* activations for micro-batches of B sequences of S tokens */
    int B, S, T;
    struct model_slot *slots;   /* [st.n_slots] */
    int slot;                   /* the slot the pointers below belong to (model_use_slot) */
    int32_t *ids, *targets, *pos, *seg;   /* = slots[slot]'s */
    struct layer_acts *layers;  /* = slots[slot].layers */
    int64_t d_cap_rows;         /* rows the expert-side backward scratch (d_x_exp ...) can hold */
    bool aux_active;            /* backward adds m->aux_dp to the router gradient */
    struct layer_acts shared;   /* recompute: one layer's activations, reused by every layer */
    bool recompute;             /* activation checkpointing */
    bool router_f32;            /* router GEMM writes fp32 logits (router_fp32 or an fp32 backend) */
    bool recomputing;           /* inside a backward's recompute: router statistics are not added */
    void *h_final;              /* = slots[slot].h_out */
    /* last stage only: the head of the micro-batch being run (1F1B runs a micro-batch's head
     * forward and backward back to back, so one set serves every slot) */
    void *hf;                   /* [T, H] final norm output */
    float *rstd_f;              /* [T] */
    void *logits;               /* [T, V] (reused for dlogits in backward) */
    float *losses;              /* [T] */
    float *lse_f;               /* [T] log-sum-exp of each row of the logits (loss backward) */
    /* > 0: the next head forwards compute the loss gradient with this scale too (the training
     * loop knows it before the forward: 1 / the step's labelled tokens), in one pass over the
     * logits (ops.h cross_entropy_fused) */
    float ce_fused_scale;
    float dlogits_scale;        /* > 0: the logits buffer holds the gradient at this scale */
    /* scratch for backward */
    void *d_h;                  /* [T, H] gradient of the residual stream; a non-last stage receives
                                 * dL/d(stage output) here and the backward leaves dL/d(stage input) */
    void *d_t1, *d_t2, *d_t3;   /* [T, max(H, Hq*D)] */
    void *d_q, *d_k, *d_v;      /* q/k/v-shaped */
    void *d_logits_r;           /* [T, E] router logits / dlogits in the compute dtype (!router_f32) */
    float *d_topk_w;            /* [T, k] */
    void *d_x_exp, *d_gu, *d_act, *d_y_exp; /* [d_cap_rows, H or 2I or I] expert-side */
    /* pairs: sender-side pair rows (forward and backward), metadata and weight-gradient staging */
    void *d_x_send;             /* [T * min(k, ep), H] */
    int32_t *meta_idx_send;     /* [T * min(k, ep), k] */
    float *meta_w_send;         /* [T * min(k, ep), k] */
    float *d_w_recv;            /* [d_cap_pairs, k] */
    int64_t d_cap_pairs;
    /* parallel.moe_chunks > 1 (moe_exchange.c): the received pair rows and the routing-weight
     * gradients coming home, grown on demand */
    void *x_recv;               /* [x_recv_cap] compute dtype */
    float *d_w_home;            /* [d_w_home_cap] */
    int64_t x_recv_cap, d_w_home_cap;
    float *stats;               /* dev [L, 2, E]: per layer psum then count (the stage's layers) */
    float *stats_h;             /* host copy */
    /* train.c's step statistics (src/step_stats.c): when set, a stage forward copies its per-token
     * losses ([T]) and router statistics ([L, 2, E]) to these device buffers instead of waiting for
     * them; out->ce_sum and stats_h are then left alone */
    float *defer_losses, *defer_stats;
    /* the next backward's aux_dp was written on the device (aux_grad_from_stats) */
    bool aux_dp_ready;
    float *aux_dp;              /* dev [E] */
    float *ones;                /* dev [ones_cap] all 1.0: unit combine weights */
    int64_t ones_cap;
    float *bias;                /* dev [L, E]: aux-free balancing selection bias (NULL if unused) */
    struct route_replay *replay; /* saved (recompute) or pre-loaded routing, route_replay.h; NULL = none */
    void (*replay_free)(struct model *m); /* set with replay by route_replay.c, which sits above the
                                           * model: model_free calls it without knowing the module */
};

/* Builds the model of one pipeline stage (st = NULL: the whole model, one slot) and allocates its
 * activations for micro-batches of B sequences x S tokens. No weights: model_bind (or
 * model_own_weights) provides them. ep_comm: the EP group (NULL for ep = 1).
 * recompute (train.activation_checkpointing): keep only each layer's input and one shared set of
 * layer activations; the backward recomputes a layer's forward from its input before its backward
 * (the same deterministic ops, so the gradients are bit-identical to a run that kept everything). */
void model_init_stage(struct model *m, const struct backend *be, const struct model_config *cfg,
                      int B, int S, struct comm *ep_comm, bool recompute, const struct model_stage *st);
void model_init(struct model *m, const struct backend *be, const struct model_config *cfg,
                int B, int S, struct comm *ep_comm, bool recompute);
void model_free(struct model *m);
/* Whether tensor i lives on this stage (its layer, or the embedding / head pieces of the stage). */
bool model_has_tensor(const struct model *m, int i);
/* Binds tensor i's working weight and gradient (either may be NULL). */
void model_bind(struct model *m, int i, void *w, float *g);
/* Allocates flat buffers for every tensor of the stage and binds them (tests, tools). */
void model_own_weights(struct model *m);
void model_set_hooks(struct model *m, const struct model_unit_hooks *h);

/* Whether gradient buffer unit u (params.h) of group TG_EXPERT is layer u - 1's expert tensors
 * and nothing else, so that it need not be zeroed if marked fresh; if so, marks the layer fresh
 * and returns true. work_numel: the unit's working elements. */
bool model_skip_expert_grad_zeroing(struct model *m, int unit, int64_t work_numel);
/* Sums of squared gradients taken by the pass that writes a weight gradient last in a step (the
 * expert weight gradients' grouped pass where it overwrites: ops.h expert_matmul_wgrad_sets'
 * dw_sumsq, summed from the kernel's accumulators), so that the gradient norm need not read those
 * tensors again. enable allocates them; reset (at each step's start, a re-run's too) forgets what
 * was taken; slot: where the pass that is tensor (role, l)'s last of the step writes its sum,
 * marked taken (NULL: off, or another backward follows); taken: h[i] = tensor i's sum this step,
 * NAN where none was taken (one download), and how many were (0: h untouched). The caller
 * knows whether the gradients are still as those passes left them (not reduced). */
void model_enable_grad_sumsq(struct model *m);
void model_grad_sumsq_reset(struct model *m);
double *model_grad_sumsq_slot(struct model *m, enum tensor_role r, int l);
int model_grad_sumsq_taken(struct model *m, double *h /*[tt.n]*/);
/* The fixed exchange (fixed_exchange above): grows the sender-side pair buffers to ep blocks of T
 * and sets every layer's rows_cap to 25% over the mean rows a rank receives (T·k), or `fraction` of
 * the mean when > 0 (MT_MOE_ROW_CAPACITY, a testing switch that forces re-run steps). Needs pairs
 * and moe_chunks 1. */
void model_enable_fixed_exchange(struct model *m, double fraction);
/* After an armed step's forwards (one download): need[l] (host [L]) = the rows layer l needed where
 * one of its route plans was cut, else 0; rows_need is zeroed again. Returns whether any was cut. */
bool model_fixed_exchange_overflow(struct model *m, int64_t *need);
/* For the step's re-run: every layer gets room for 25% over the largest need[l]. Not each layer its
 * own: the bench's fresh router (2x H200, 2026-11-28) then made other layers outgrow 1.25x the mean
 * in 3 of the next 5 steps, each a re-run (EP=2 at 72% of one GPU instead of 96%). */
void model_fixed_exchange_grow(struct model *m, const int64_t *need);

/* parallel.expert_wgrad_pairs (struct expert_wgrad_stash): enable makes the stage's first n_layers
 * MoE layers pair (stash records; their buffers grow at first use; needs moe_chunks 1); pending: a
 * stash still holds a micro-step whose expert weight gradients are not in dw (an error at a step's
 * end). */
void model_enable_expert_wgrad_pairs(struct model *m, int n_layers);
/* ... and groups of `group` micro-steps (2 .. MT_WGRAD_MAX_SETS) in the first n_group of them, of
 * which the first n_big take groups of big_group instead */
void model_enable_expert_wgrad_groups(struct model *m, int n_layers, int n_group, int group, int n_big, int big_group);
bool model_expert_wgrad_pending(const struct model *m);
/* Whether layer l's expert gradients are first written in the last backward of a step of n_micro
 * micro-steps: its group parks all the others (stash_place.h's hosts). */
bool model_expert_grads_written_last(const struct model *m, int l, int n_micro);
/* MT_STASH_IN_GRADS (stash_place.h): places the grouping layers' parked rows of a step of n_micro
 * micro-steps in the hosts (host h's memory at host_mem[h]); a layer with a buffer there parks in
 * place from then on (expert_wgrad_stash.direct). Whole experts a rank (with EP the fixed exchange,
 * whose capacity sizes the buffers, and no wgrad jobs), no pipeline, no recompute, moe_chunks 1.
 * Returns the bytes placed. */
int64_t model_place_expert_stash(struct model *m, int n_micro, const struct stash_host *hosts, void *const *host_mem,
                                 int n_hosts);
/* ... undone, with no micro-step parked: each layer back to its own buffers, the buffers of its own
 * freed. With EP a step that runs again with more rows (model_fixed_exchange_grow) places them
 * again at the new capacity. */
void model_unplace_expert_stash(struct model *m);
/* Lets a backward that another follows (more_backwards) hold each layer's o_proj and q_proj weight
 * gradients back until the next MoE layer's backward exchanges have started (the first, the rows
 * to the experts: o_proj; the last, the rows home: q_proj), in a [T, H] and a [T, Hq*D] buffer.
 * Only where a layer's gradient stays put until the step's last backward: not recomputed
 * activations, gradients not reduced per micro-step (the caller knows); ep > 1 or the loopback,
 * where the exchanges exist. Same bits: the same GEMMs on the same inputs, later. */
void model_enable_deferred_wgrads(struct model *m);
/* Runs up to max (< 0: all) of the pending deferred weight gradients, oldest first (the MoE
 * backward while its rows move; every layer's attention backward and the end of a backward run
 * all, so that none is ever left behind). */
void model_run_deferred_wgrads(struct model *m, int max);
/* Queues one (attention_block.c) */
void model_defer_wgrad(struct model *m, const struct deferred_wgrad *d);
/* The activations of layer l in the current slot: its own, or the shared set holding layer l's
 * input when recomputing. */
struct layer_acts *model_acts(struct model *m, int l);
void model_use_slot(struct model *m, int slot);
/* Makes m->ones hold at least n ones. */
void model_ensure_ones(struct model *m, int64_t n);

/* Pointers to tensor i's working weight (compute dtype) and gradient (bound ones). */
void *model_weight(const struct model *m, int i);
float *model_grad(const struct model *m, int i);
/* The same for layer l's tensor of a role (the layer passes' lookups) */
static inline void *weight_of(const struct model *m, enum tensor_role r, int l)
{
    return model_weight(m, tensor_lookup(&m->tt, r, l));
}
static inline float *grad_of(const struct model *m, enum tensor_role r, int l)
{
    return model_grad(m, tensor_lookup(&m->tt, r, l));
}
int64_t model_work_numel_of(const struct model *m, int i);   /* numel in working layout */

/* A stage's input rows of micro-batch `slot` (received before its forward) and output rows
 * (model_step.h) */
void *model_stage_input(struct model *m, int slot);    /* [T, H]; NULL on the first stage */
void *model_stage_output(struct model *m, int slot);   /* [T, H] */
/* Document masking for micro-batch `slot` (model_documents.c), kept until set again: pos_host,
 * seg_host HOST [B, S] per-token RoPE positions and document ids (attention stays inside a
 * document). Both NULL restores positions t mod S and attention over the whole sequence. */
void model_set_documents(struct model *m, int slot, const int32_t *pos_host, const int32_t *seg_host);
/* Zeroes every bound gradient. */
void model_zero_grad(struct model *m);

/* Compute-dtype pointer arithmetic. */
#define MT_XP(m, p, i) ((void *)((char *)(p) + (size_t)(i) * (m)->be->x_size))

/* Testing hooks (moe.c; used by tests/mpi/dispatch_check.c, never by the model): MoE layer l's
 * dispatch and combine driven by a routing the caller chooses instead of the router. Thin
 * wrappers over what moe_forward / moe_backward run. Pointers other than *_host are backend memory.
 *  - moe_dispatch_for_test: topk_idx/topk_w HOST [T, k] (any order of a token's k distinct
 *    experts) and rows x [T, H] -> the route m->layers[l].route (re-sorted top-k included), the
 *    expert-major rows m->layers[l].x_exp [R_exp, H] with route.expert_off; returns R_exp.
 *  - moe_combine_for_test: expert outputs y_exp [R_exp, H] (expert-major, as x_exp) -> out [T, H].
 *  - moe_combine_backward_for_test: dL/d out [T, H] -> m->d_y_exp [R_exp, H] (expert-major) and
 *    m->d_topk_w [T, k] (in the re-sorted order the route plan leaves in the layer's topk_idx).
 *  - moe_dispatch_backward_for_test: dL/d x_exp [R_exp, H] -> dx [T, H] (overwritten). */
int64_t moe_dispatch_for_test(struct model *m, int l, const int32_t *topk_idx_host,
                              const float *topk_w_host, const void *x);
void moe_combine_for_test(struct model *m, int l, const void *y_exp, void *out);
void moe_combine_backward_for_test(struct model *m, int l, const void *dout);
void moe_dispatch_backward_for_test(struct model *m, int l, const void *d_x_exp, void *dx);
/*  - moe_experts_for_test: the whole expert part of layer l (route plan, dispatch, expert SwiGLU,
 *    combine; chunked when m->moe_chunks > 1) on a chosen routing (HOST [T, k]) and norm output x
 *    [T, H] -> out [T, H]; moe_experts_backward_for_test: dL/d out [T, H] -> dx [T, H] (through
 *    the experts), m->d_topk_w [T, k] (re-sorted order) and the experts' weight gradients (+=). */
void moe_experts_for_test(struct model *m, int l, const int32_t *topk_idx_host, const float *topk_w_host,
                          const void *x, void *out);
void moe_experts_backward_for_test(struct model *m, int l, const void *dout, void *dx);

#endif
