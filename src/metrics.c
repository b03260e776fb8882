#include "metrics.h"

#include <errno.h>
#include <math.h>
#include <string.h>

#include "common.h"
#include "profile.h"

void metrics_open(struct metrics_log *ml, const char *path, bool append)
{
    ml->jsonl = NULL;
    if (mt_rank() != 0 || !path || !*path) return;
    ml->jsonl = fopen(path, append ? "a" : "w");
    if (!ml->jsonl) mt_fatal("%s: cannot open the metrics file for writing: %s", path, strerror(errno));
}

void metrics_close(struct metrics_log *ml)
{
    if (ml->jsonl && fclose(ml->jsonl) != 0) mt_fatal("closing the metrics file: %s", strerror(errno));
    ml->jsonl = NULL;
}

static void fmt_eta(char *buf, size_t cap, double s)
{
    if (s < 0 || !isfinite(s)) s = 0;
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(buf, cap, "%ldh%02ldm", t / 3600, (t / 60) % 60);
    else snprintf(buf, cap, "%ldm%02lds", t / 60, t % 60);
}

void metrics_step(struct metrics_log *ml, const struct step_metrics *s, bool print)
{
    if (mt_rank() != 0) return;
    double lmin = INFINITY, lmax = 0;
    for (int l = 0; l < s->n_layers; l++) {
        lmin = fmin(lmin, s->load_min[l]);
        lmax = fmax(lmax, s->load_max[l]);
    }
    if (print) {
        char eta[32], mfu[16], load[48] = "";
        fmt_eta(eta, sizeof eta, s->eta_s);
        if (s->mfu >= 0) snprintf(mfu, sizeof mfu, "%5.1f%%", 100 * s->mfu);
        else snprintf(mfu, sizeof mfu, "   n/a");
        if (s->n_layers > 0) snprintf(load, sizeof load, " | load %.2f-%.2f", lmin, lmax);
        char val[32] = "";
        if (s->has_val) snprintf(val, sizeof val, " | val %.4f", s->val_loss);
        printf("step %*d/%d | loss %.4f%s | aux %.4f | gnorm %.3f | lr %.2e | %.0f tok/s | mfu %s | "
               "%.0f ms%s | eta %s\n",
               (int)floor(log10(s->steps)) + 1, s->step, s->steps, s->loss, val, s->aux_loss, s->grad_norm,
               s->lr, s->tokens_per_s, mfu, s->step_ms, load, eta);
        if (s->time_split) {
            char split[512];
            profile_format(split, sizeof split, s->time_split, s->step_ms / 1e3);
            printf("    time: %s\n", split);
        }
        fflush(stdout);
    }
    if (!ml->jsonl) return;
    FILE *f = ml->jsonl;
    fprintf(f, "{\"step\": %d, \"loss\": %.8g, \"ce_loss\": %.8g, \"aux_loss\": %.8g, "
               "\"grad_norm\": %.8g, \"lr\": %.8g, \"tokens_per_s\": %.8g, \"step_ms\": %.6g",
            s->step, s->loss, s->ce_loss, s->aux_loss, s->grad_norm, s->lr, s->tokens_per_s, s->step_ms);
    if (s->mfu >= 0) fprintf(f, ", \"mfu\": %.6g", s->mfu);
    if (s->has_val) fprintf(f, ", \"val_loss\": %.8g", s->val_loss);
    const char *names[3] = {"load_min", "load_max", "load_cv"};
    const double *vals[3] = {s->load_min, s->load_max, s->load_cv};
    for (int k = 0; k < 3; k++) {
        fprintf(f, ", \"%s\": [", names[k]);
        for (int l = 0; l < s->n_layers; l++) fprintf(f, "%s%.6g", l ? ", " : "", vals[k][l]);
        fputc(']', f);
    }
    if (s->time_split) {
        fputs(", \"time_split_s\": {", f);
        for (int c = 0; c < PROF_COUNT; c++)
            fprintf(f, "%s\"%s\": %.6g", c ? ", " : "", profile_cat_name((enum prof_cat)c), s->time_split[c]);
        fputc('}', f);
    }
    fputs(", \"expert_tokens\": [", f);
    for (int l = 0; l < s->n_layers; l++) {
        fputs(l ? ", [" : "[", f);
        for (int e = 0; e < s->n_experts; e++)
            fprintf(f, "%s%.0f", e ? ", " : "", s->expert_tokens[(size_t)l * s->n_experts + e]);
        fputc(']', f);
    }
    fputs("]}\n", f);
    if (fflush(f) != 0) mt_fatal("writing the metrics file: %s", strerror(errno));
}
