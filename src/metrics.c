#include "metrics.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common.h"
#include "config.h"
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

/* JSON has no NaN or infinity: a non-finite value is null */
static void json_num(FILE *f, const char *key, double v, const char *fmt)
{
    fprintf(f, ", \"%s\": ", key);
    if (isfinite(v)) fprintf(f, fmt, v);
    else fputs("null", f);
}

static void fmt_time(char *buf, size_t cap, double t, bool iso)
{
    time_t sec = (time_t)t;
    struct tm tm;
    gmtime_r(&sec, &tm);
    if (iso) {
        char base[32];
        strftime(base, sizeof base, "%Y-%m-%dT%H:%M:%S", &tm);
        snprintf(buf, cap, "%s.%03dZ", base, (int)((t - (double)sec) * 1000) % 1000);
    } else {
        strftime(buf, cap, "%H:%M:%S", &tm);
    }
}

static void fmt_count(char *buf, size_t cap, double x, const char *unit)
{
    const char *sfx[] = {"", "K", "M", "G", "T", "P"};
    int k = 0;
    while (fabs(x) >= 1000 && k < 5) x /= 1000, k++;
    snprintf(buf, cap, k ? "%.3g%s%s" : "%.0f%s%s", x, sfx[k], unit);
}

double metrics_wall_clock(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void metrics_print_config(const struct config *c, const char *metrics_path)
{
    if (mt_rank() != 0) return;
    int len = config_to_yaml(c, NULL, 0);
    char *yaml = mt_malloc((size_t)len + 1);
    config_to_yaml(c, yaml, len + 1);
    if (metrics_path && *metrics_path) {
        char path[MT_PATH_MAX + 32];
        size_t n = strlen(metrics_path);
        if (n > 6 && !strcmp(metrics_path + n - 6, ".jsonl")) n -= 6;
        snprintf(path, sizeof path, "%.*s.config.yaml", (int)n, metrics_path);
        FILE *f = mt_mkdir_parent(path) ? fopen(path, "w") : NULL;
        if (!f || fputs(yaml, f) < 0 || fclose(f) != 0)
            mt_fatal("%s: cannot write the resolved config: %s", path, strerror(errno));
        printf("  config      resolved config written to %s\n", path);
    } else {
        /* "section: k=v k=v ..." from the YAML's "section:" / "  key: value" lines */
        printf("  config");
        for (char *line = strtok(yaml, "\n"); line; line = strtok(NULL, "\n")) {
            if (line[0] == '#') continue;
            if (line[0] != ' ') printf("\n    %s", line);
            else printf(" %s", line + 2);
        }
        printf("\n");
    }
    free(yaml);
    fflush(stdout);
}

void metrics_step(struct metrics_log *ml, const struct step_metrics *s, bool print)
{
    if (mt_rank() != 0) return;
    double lmin = INFINITY, lmax = 0, ep_max = 0;
    for (int l = 0; l < s->n_layers; l++) {
        lmin = fmin(lmin, s->load_min[l]);
        lmax = fmax(lmax, s->load_max[l]);
        if (s->ep_load_max) ep_max = fmax(ep_max, s->ep_load_max[l]);
    }
    const bool warn = s->warning && *s->warning;
    if (print || warn || s->skipped || s->reruns > 0) {
        char eta[32], mfu[16], load[64] = "", extra[192] = "", when[16] = "", tok[32], mem[32];
        size_t x = 0;
        fmt_count(tok, sizeof tok, (double)s->tokens_seen, " tok");
        x += (size_t)snprintf(extra + x, sizeof extra - x, " | %s", tok);
        if (isfinite(s->val_loss)) x += (size_t)snprintf(extra + x, sizeof extra - x, " | val %.4f", s->val_loss);
        if (s->peak_mem_bytes > 0) {
            fmt_count(mem, sizeof mem, s->peak_mem_bytes, "B");
            x += (size_t)snprintf(extra + x, sizeof extra - x, " | mem %s (rank %d)", mem, s->peak_mem_rank);
        }
        if (s->skipped_steps > 0)
            x += (size_t)snprintf(extra + x, sizeof extra - x, " | %s (%d skipped)", s->skipped ? "SKIPPED" : "applied",
                                  s->skipped_steps);
        if (s->reruns > 0) x += (size_t)snprintf(extra + x, sizeof extra - x, " | ran %dx", 1 + s->reruns);
        if (s->wall_time > 0) fmt_time(when, sizeof when, s->wall_time, false);
        fmt_eta(eta, sizeof eta, s->eta_s);
        if (s->mfu >= 0) snprintf(mfu, sizeof mfu, "%5.1f%%", 100 * s->mfu);
        else snprintf(mfu, sizeof mfu, "   n/a");
        if (s->n_layers > 0) {
            int at = snprintf(load, sizeof load, " | load %.2f-%.2f", lmin, lmax);
            if (s->ep_load_max) snprintf(load + at, sizeof load - (size_t)at, " | ep load %.2f", ep_max);
        }
        printf("step %*d/%d | loss %.4f | aux %.4f | gnorm %.3f | lr %.2e | %.0f tok/s | mfu %s | "
               "%.0f ms%s%s | eta %s%s%s%s%s\n",
               (int)floor(log10(s->steps)) + 1, s->step, s->steps, s->loss, s->aux_loss, s->grad_norm,
               s->lr, s->tokens_per_s, mfu, s->step_ms, load, extra, eta, *when ? " | " : "", when,
               warn ? " | WARNING " : "", warn ? s->warning : "");
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
    if (s->wall_time > 0) {
        char iso[40];
        fmt_time(iso, sizeof iso, s->wall_time, true);
        fprintf(f, ", \"time\": \"%s\"", iso);
    }
    fprintf(f, ", \"tokens\": %lld", (long long)s->tokens_seen);
    json_num(f, "loss", s->loss, "%.8g");
    json_num(f, "ce_loss", s->ce_loss, "%.8g");
    json_num(f, "aux_loss", s->aux_loss, "%.8g");
    json_num(f, "grad_norm", s->grad_norm, "%.8g");
    json_num(f, "lr", s->lr, "%.8g");
    json_num(f, "tokens_per_s", s->tokens_per_s, "%.8g");
    json_num(f, "step_ms", s->step_ms, "%.6g");
    if (s->mfu >= 0) json_num(f, "mfu", s->mfu, "%.6g");
    json_num(f, "val_loss", s->val_loss, "%.8g");
    fprintf(f, ", \"skipped\": %s, \"skipped_steps\": %d, \"reruns\": %d", s->skipped ? "true" : "false",
            s->skipped_steps, s->reruns);
    if (s->peak_mem_bytes > 0) {
        json_num(f, "peak_mem_bytes", s->peak_mem_bytes, "%.0f");
        fprintf(f, ", \"peak_mem_rank\": %d", s->peak_mem_rank);
    }
    if (warn) fprintf(f, ", \"warning\": \"%s\"", s->warning); /* expert_watch.c writes no quotes */
    const char *names[4] = {"load_min", "load_max", "load_cv", "ep_load_max"};
    const double *vals[4] = {s->load_min, s->load_max, s->load_cv, s->ep_load_max};
    for (int k = 0; k < 4; k++) {
        if (!vals[k]) continue;
        fprintf(f, ", \"%s\": [", names[k]);
        for (int l = 0; l < s->n_layers; l++) {
            if (l) fputs(", ", f);
            if (isfinite(vals[k][l])) fprintf(f, "%.6g", vals[k][l]);
            else fputs("null", f);
        }
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
            fprintf(f, "%s%.0f", e ? ", " : "", s->expert_tokens[(size_t)l * s->n_experts + e]);
        fputc(']', f);
    }
    fputs("]}\n", f);
    if (fflush(f) != 0) mt_fatal("writing the metrics file: %s", strerror(errno));
}
