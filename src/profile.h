/* Where a step's time goes (log.profile: true). A decorator backend wraps every op of the real
 * one between device synchronisations and adds the op's wall time to its category; the comm layer
 * reports its collectives the same way. Synchronising after every op removes any overlap, so a
 * profiled step runs a little slower than an unprofiled one: use it to find the big items. */
#ifndef MT_PROFILE_H
#define MT_PROFILE_H

#include <stdio.h>

#include "ops.h"

enum prof_cat {
    PROF_ATTN,        /* attention forward/backward kernels */
    PROF_EXPERT_GEMM, /* grouped expert GEMMs */
    PROF_DENSE_GEMM,  /* projections, router, lm_head */
    PROF_MOE_ROWS,    /* router softmax/top-k/stats, dispatch gathers, combine */
    PROF_COMM,        /* all-to-all, all-gather, reduce-scatter, all-reduce */
    PROF_OPTIM,       /* AdamW */
    PROF_OTHER,       /* norms, RoPE, SwiGLU, loss, embedding, casts, copies */
    PROF_COUNT
};

/* The profiling decorator of `inner` (one per process). */
const struct backend *profile_wrap(const struct backend *inner);
/* Seconds per category since the last reset; reset zeroes them. */
void profile_read(double secs[PROF_COUNT]);
void profile_reset(void);
const char *profile_cat_name(enum prof_cat c);
/* "attention 31% | expert GEMMs 28% | ... | host/idle 3%" of a step of step_s seconds */
void profile_format(char *buf, size_t cap, const double secs[PROF_COUNT], double step_s);

/* The ops of the last step (since the last reset), slowest first: name, shape key (an output width,
 * row count or sequence length; 0 where calls are pooled), calls, milliseconds, share of step_s. */
void profile_print_ops(FILE *f, double step_s);

#endif
