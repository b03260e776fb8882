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
    if (!mt_mkdir_parent(path))
        mt_fatal("%s: cannot create the directory of the metrics file: %s", path, strerror(errno));
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

/* JSON has no NaN or Infinity: a non-finite number is written as null */
static void json_num(FILE *f, const char *key, const char *fmt, double v)
{
    fprintf(f, ", \"%s\": ", key);
    if (isfinite(v)) fprintf(f, fmt, v);
    else fputs("null", f);
}

static void json_list_item(FILE *f, int i, const char *fmt, double v)
{
    if (i) fputs(", ", f);
    if (isfinite(v)) fprintf(f, fmt, v);
    else fputs("null", f);
}

void metrics_step(struct metrics_log *ml, const struct step_metrics *s, bool print)
{
    if (mt_rank() != 0) return;
    double lmin = INFINITY, lmax = 0;
    for (int l = 0; l < s->n_layers; l++) {
        lmin = fmin(lmin, s->load_min[l]);
        lmax = fmax(lmax, s->load_max[l]);
    }
    if (print || s->skipped) {
        char eta[32], mfu[16], load[48] = "";
        fmt_eta(eta, sizeof eta, s->eta_s);
        if (s->mfu >= 0) snprintf(mfu, sizeof mfu, "%5.1f%%", 100 * s->mfu);
        else snprintf(mfu, sizeof mfu, "   n/a");
        if (s->n_layers > 0) snprintf(load, sizeof load, " | load %.2f-%.2f", lmin, lmax);
        printf("step %*d/%d | loss %.4f | aux %.4f | gnorm %.3f | lr %.2e | %.0f tok/s | mfu %s | "
               "%.0f ms%s | eta %s",
               (int)floor(log10(s->steps)) + 1, s->step, s->steps, s->loss, s->aux_loss, s->grad_norm,
               s->lr, s->tokens_per_s, mfu, s->step_ms, load, eta);
        if (s->skipped_steps > 0)
            printf(" | %s (%d skipped)", s->skipped ? "SKIPPED" : "applied", s->skipped_steps);
        putchar('\n');
        if (s->time_split) {
            char split[512];
            profile_format(split, sizeof split, s->time_split, s->step_ms / 1e3);
            printf("    time: %s\n", split);
        }
        fflush(stdout);
    }
    if (!ml->jsonl) return;
    FILE *f = ml->jsonl;
    fprintf(f, "{\"step\": %d", s->step);
    json_num(f, "loss", "%.8g", s->loss);
    json_num(f, "ce_loss", "%.8g", s->ce_loss);
    json_num(f, "aux_loss", "%.8g", s->aux_loss);
    json_num(f, "grad_norm", "%.8g", s->grad_norm);
    json_num(f, "lr", "%.8g", s->lr);
    json_num(f, "tokens_per_s", "%.8g", s->tokens_per_s);
    json_num(f, "step_ms", "%.6g", s->step_ms);
    fprintf(f, ", \"skipped\": %s, \"skipped_steps\": %d", s->skipped ? "true" : "false", s->skipped_steps);
    if (s->mfu >= 0) json_num(f, "mfu", "%.6g", s->mfu);
    const char *names[3] = {"load_min", "load_max", "load_cv"};
    const double *vals[3] = {s->load_min, s->load_max, s->load_cv};
    for (int k = 0; k < 3; k++) {
        fprintf(f, ", \"%s\": [", names[k]);
        for (int l = 0; l < s->n_layers; l++) json_list_item(f, l, "%.6g", vals[k][l]);
        fputc(']', f);
    }
    if (s->time_split) {
        fputs(", \"time_split_s\": {", f);
        for (int c = 0; c < PROF_COUNT; c++)
            fprintf(f, "%s\"%s\": %.6g", c ? ", " : "", profile_cat_name((enum prof_cat)c),
                    isfinite(s->time_split[c]) ? s->time_split[c] : 0.0);
        fputc('}', f);
    }
    fputs(", \"expert_tokens\": [", f);
    for (int l = 0; l < s->n_layers; l++) {
        fputs(l ? ", [" : "[", f);
        for (int e = 0; e < s->n_experts; e++)
            json_list_item(f, e, "%.0f", s->expert_tokens[(size_t)l * s->n_experts + e]);
        fputc(']', f);
    }
    fputs("]}\n", f);
    if (fflush(f) != 0) mt_fatal("writing the metrics file: %s", strerror(errno));
}
