/* Per-step reporting: the step line on rank 0's stdout and one JSON object per step in the
 * metrics file (log.metrics). */
#ifndef MT_METRICS_H
#define MT_METRICS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

struct step_metrics {
    int step, steps;
    double loss;          /* ce + coef * aux (aux only with load_balance: aux) */
    double ce_loss;
    double aux_loss;      /* mean over micro-steps of the pooled aux statistic (0 if no experts) */
    double grad_norm;     /* before clipping */
    double lr;
    double tokens_per_s;  /* whole job */
    double mfu;           /* fraction of peak, < 0 when the backend has no known peak */
    double step_ms;
    double eta_s;
    int n_layers;         /* MoE layers reported in load_* */
    const double *load_min, *load_max, *load_cv; /* [n_layers]: tokens per expert / mean */
    const double *ep_load_max;    /* [n_layers]: busiest EP rank's routed tokens / the mean rank's
                                   * (expert_watch_rank_load_max); NULL with one EP rank */
    int n_experts;
    const double *expert_tokens;  /* [n_layers, n_experts]: routed tokens this step, whole job */
    const double *time_split;     /* [PROF_COUNT] seconds by category (rank 0), NULL = not profiled */
    double wall_time;     /* seconds since the Unix epoch when the step ended (0 = not set) */
    int64_t tokens_seen;  /* step * global_batch_size * seq_len: every token trained on so far */
    double peak_mem_bytes;/* largest peak device memory over the ranks (0 = not measured) */
    int peak_mem_rank;    /* the rank that had it */
    int skipped_steps;    /* steps skipped so far (non-finite gradients) */
    int reruns;           /* times this step ran again (an MoE layer outgrew the fixed exchange's rows) */
    double val_loss;      /* validation loss computed at this step; NaN = none */
    const char *warning;          /* expert collapse / overload (expert_watch.h); NULL or "" = none */
    bool skipped;                 /* the optimizer step was skipped (step_guard.h) */
};

struct metrics_log {
    FILE *jsonl;          /* NULL = no file */
};

/* Opens log.metrics on rank 0 (path "" = none); append keeps the lines of the run being resumed.
 * An unwritable path: mt_fatal. */
void metrics_open(struct metrics_log *ml, const char *path, bool append);
void metrics_close(struct metrics_log *ml);
/* Rank 0: prints the step line (when print is true; always for a skipped step or a warning) and writes the
 * JSONL record, with null for a non-finite number so every line stays valid JSON. */
void metrics_step(struct metrics_log *ml, const struct step_metrics *s, bool print);

/* Rank 0, once at start-up: the resolved config (config_to_yaml) written beside the metrics file
 * (METRICS minus .jsonl, + .config.yaml) with a one-line pointer, or printed as one line per
 * section when there is no metrics file. */
struct config;
/* seconds since the Unix epoch (for step_metrics.wall_time) */
double metrics_wall_clock(void);
void metrics_print_config(const struct config *c, const char *metrics_path);

#endif
