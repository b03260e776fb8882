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
 * its LM head): sums their working-layout gradients over `ends` (mesh.ends_comm, in the backend's
 * memory) so both apply the same update. No-op otherwise. */
void pipe_tie_grads(struct model *m, const struct mesh *mesh, struct comm *ends);

/* The squared L2 norm of the reduced shard gradient of the tensors this rank keeps but does not
 * own (mesh_stage_owns: the last stage's tied embedding). params_reduce_grads counts them on
 * every stage that keeps them; subtract the world sum of this to count each parameter once. */
double pipe_unowned_grad_sq(const struct params *p, const struct mesh *mesh);

#endif
