/* What the train loop needs around the 1F1B schedule (pipeline.h) when pp > 1: the router
 * statistics that travel with the activations, the tied embedding's gradient shared by the first
 * and last stage, and the gradient norm counting each parameter once. */
#ifndef MT_TRAIN_PIPELINE_H
#define MT_TRAIN_PIPELINE_H

#include <stdint.h>

#include "comm.h"
#include "config.h"
#include "mesh.h"
#include "model.h"
#include "params.h"

/* transformers' pooled load-balancing statistic from the per-expert sums over every MoE layer of
 * one global micro-batch: psum[E] and count[E] (each summed layer by layer in layer order, as
 * aux_from_stats does, so the two agree bit for bit). */
double pipe_aux_pooled(const double *psum, const double *count, int E, int n_moe, int64_t tokens);

/* Adds layers [l0, l1)'s router statistics stats[(l - l0)][2][E] (psum then count, already summed
 * over the stage) to the pooled sums carried from the earlier stages, MoE layers only. */
void pipe_pool_stats(const struct model_config *mc, const float *stats, int l0, int l1, double *psum,
                     double *count);

/* With tied embeddings and pp > 1 the first and last stage each hold the embedding (the last for
 * its LM head) as FSDP unit 0, sharded the same way on both: sums the two shard gradients of that
 * unit over `ends` (mesh.ends_comm in the backend's memory) so both stages apply the same update
 * to the same weights. No-op otherwise. */
void pipe_tie_grads(struct params *p, const struct mesh *mesh, struct comm *ends);

/* The squared L2 norm of the reduced shard gradient of the tensors this rank keeps but does not
 * own (mesh_stage_owns: the last stage's tied embedding). params_grad_sumsq counts them on every
 * stage that keeps them; subtract the world sum of this to count each parameter once. */
double pipe_unowned_grad_sq(const struct params *p, const struct mesh *mesh);

/* After the step's backwards: ties the embedding's gradient and returns the squared global
 * gradient norm, each parameter counted once (world: host comm over every rank). */
double pipe_grad_sumsq(struct params *p, const struct mesh *mesh, struct comm *ends, struct comm *world);

/* The model's stage for this rank: its layers, first/last, and the 1F1B slots it needs. */
struct model_stage pipe_model_stage(const struct mesh *mesh, int n_micro);

struct step_batch;
struct pipe_schedule;
/* One rank's pipelined training step (pp > 1): the 1F1B schedule over the micro-batches of a step
 * with the activations, the pooled router statistics [2, E] (f64) carried forward, and dL/dh with
 * the aux-loss gradient aux_dp [E] carried back. */
struct pipe_train {
    const struct config *c;
    const struct mesh *mesh;
    struct model *m;
    const struct step_batch *sb; /* the step's micro-batches of this rank's data-parallel index */
    struct comm *stage_h;      /* host, the stage's ranks (router statistics) */
    struct comm *pp;           /* the backend's, this rank's pipeline */
    struct comm *pp_h, *world_h; /* host: the pipeline, every rank */
    struct pipe_schedule *sched;
    int n_micro, step;
    int64_t tokens_micro_global, n_valid_global;
    bool use_aux;
    const float *aux_fixed;    /* host [E] or NULL: the step's aux_dp for every micro-batch
                                * (train.aux_loss_scope: global_batch, from its pre-pass) */
    double **carry;            /* [n_slots] backend [2E] f64: pooled psum then count */
    float **aux_dev;           /* [n_slots] backend [E] */
    float **aux_host;          /* [n_slots] host [E] */
    void **grad_in, **grad_out; /* [n_slots] backend [T, H]: dL/d(output) received, dL/d(input) sent
                                 * (the model's d_h is one buffer for every slot) */
    double *pool;              /* host [2E] */
    /* the step's results on this rank */
    double ce_local, aux_sum;  /* aux_sum: Σ over micro-batches of aux, on the last stage */
    int64_t valid_local;
    double *layer_counts;      /* [L, E] of this stage's layers (others 0) */
    /* over the run: seconds in the 1F1B schedules, and of them waiting for a neighbour's transfer */
    double run_s, wait_s;
};
void pipe_train_init(struct pipe_train *t, const struct config *c, const struct mesh *mesh, struct model *m,
                     struct comm *stage_h, struct comm *pp, int n_micro);
/* Runs the step's forwards and backwards on sb (loaded for this step, with the step's labelled
 * count); then the results above are this rank's. */
void pipe_train_step(struct pipe_train *t, int step, const struct step_batch *sb);
/* Collective over every rank: rank 0 prints each stage's measured idle share of its 1F1B schedules
 * (run_s, wait_s; the mean over the stage's ranks) beside the 1F1B bubble (pp-1)/(m+pp-1). Only
 * meaningful where waits block the host (the CPU backend, or log.profile on a GPU): `measured`
 * false prints that instead. */
void pipe_train_report_idle(const struct pipe_train *t, bool measured);
/* The step's results as the single-stage loop has them: ce and labelled tokens of this rank (the
 * last stage's; the caller sums them over the world), aux summed over micro-batches (the same on
 * every rank), layer_counts [L, E] of every layer (the same on every rank of the stage). */
void pipe_train_results(struct pipe_train *t, double *ce_local, int64_t *valid_local, double *aux_sum,
                        double *layer_counts);
void pipe_train_free(struct pipe_train *t);

#endif
