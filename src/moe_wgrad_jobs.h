/* Expert weight-gradient jobs: with EP, a rank whose experts got fewer rows waits at the layer's
 * exchanges for the busier rank. A grouping layer's grouped weight gradients (model.h struct
 * expert_wgrad_stash) can fill those waits: instead of running in the backward that completes the
 * group, they become a job over the parked row sets (the last micro-step's parked too), and each
 * later exchange wait launches the oldest job's parts (ops.h expert_matmul_wgrad_part), whose CTAs
 * stop taking tiles once the exchange's rows have arrived (comm.h comm_exchange_arrival). What is
 * left runs at the job's deadline: the layer's next backward, inside its first exchange. The job
 * holds the stash's slots until then, plus one for the last micro-step's rows (memory_estimate.c
 * counts it). Every
 * tile adds its sum to dw once, so the bits are those of the grouped weight gradient in place.
 * Only while another backward of the step follows (model.h more_backwards), so that the step's last
 * backward leaves no job behind. */
#ifndef MT_MOE_WGRAD_JOBS_H
#define MT_MOE_WGRAD_JOBS_H

#include <stdbool.h>

struct model;
struct layer_acts;
struct comm_p2p_req;

/* Turns jobs on for the layers that group (model.h wstash); parallel.expert_wgrad_jobs in train.c */
void model_enable_wgrad_jobs(struct model *m);
/* Layer l's grouped weight gradients become a job over its stash's slots [0, pending) (the
 * current micro-step's rows parked last, in slot n_slots); fresh: the sums overwrite dw. */
void moe_wgrad_job_queue(struct model *m, int l, bool fresh);
/* Layer l's job, if any, finishes now (its deadline: the layer's next backward, whose stash
 * needs the slots); they are free after. */
void moe_wgrad_job_finish(struct model *m, int l);
/* At the wait of the exchange r (started, not yet waited for): the oldest job's parts, taking
 * tiles until the rows have arrived. */
void moe_wgrad_jobs_fill(struct model *m, const struct comm_p2p_req *r);

#endif
