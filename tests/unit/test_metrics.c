/* The metrics JSONL and step line (src/metrics.c): valid JSON whatever the values, wall-clock
 * time, cumulative tokens across a resume, the optional fields, the resolved config file. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "metrics.h"
#include "../test_util.h"

/* Non-finite values become null (JSON has no NaN); set optional fields appear, unset ones do not. */
Test(metrics, jsonl_is_valid_json_with_non_finite_values)
{
    const char *path = "/tmp/mt_metrics_unit.jsonl";
    struct metrics_log ml;
    metrics_open(&ml, path, false);
    double lmin[1] = {NAN}, lmax[1] = {1.5}, lcv[1] = {INFINITY}, tok[2] = {3, 4};
    struct step_metrics s = {.step = 7, .steps = 9, .loss = NAN, .ce_loss = INFINITY, .aux_loss = 1, .grad_norm = NAN,
                             .lr = 1e-3, .tokens_per_s = 5, .mfu = -1, .step_ms = 2, .n_layers = 1, .load_min = lmin,
                             .load_max = lmax, .load_cv = lcv, .n_experts = 2, .expert_tokens = tok,
                             .wall_time = 1767225600.25, .tokens_seen = (int64_t)7 << 33, .peak_mem_bytes = 12e9,
                             .peak_mem_rank = 3, .skipped_steps = 2, .reruns = 1, .val_loss = 2.5};
    metrics_step(&ml, &s, false);
    metrics_close(&ml);
    json_error_t je;
    json_t *o = json_load_file(path, 0, &je);
    cr_assert(o, "not JSON: %s", je.text);
    cr_expect(json_is_null(json_object_get(o, "loss")));
    cr_expect(json_is_null(json_object_get(o, "ce_loss")));
    cr_expect(json_is_null(json_array_get(json_object_get(o, "load_min"), 0)));
    cr_expect_str_eq(json_string_value(json_object_get(o, "time")), "2026-01-01T00:00:00.250Z");
    cr_expect_eq(json_integer_value(json_object_get(o, "tokens")), (json_int_t)7 << 33);
    cr_expect_eq(json_real_value(json_object_get(o, "val_loss")), 2.5);
    cr_expect_eq(json_integer_value(json_object_get(o, "skipped_steps")), 2);
    cr_expect_eq(json_integer_value(json_object_get(o, "reruns")), 1);
    cr_expect_eq(json_number_value(json_object_get(o, "peak_mem_bytes")), 12e9);
    cr_expect_eq(json_integer_value(json_object_get(o, "peak_mem_rank")), 3);
    cr_expect(!json_object_get(o, "mfu"));
    json_decref(o);
    remove(path);
}

/* A run and its resume: every JSONL line parses, tokens = step x global batch x seq_len across the
 * resume, time is ISO 8601, val_loss is null without validation; the step line shows tokens and the
 * time; the resolved config file beside the metrics loads back to the same config. */
Test(metrics, tokens_time_and_config_in_a_resumed_run, .timeout = 120)
{
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd,
             "rm -rf /tmp/mt_metrics && mkdir -p /tmp/mt_metrics && %s/moetrain train configs/tiny.yaml --backend cpu "
             "--set train.steps=2 --set checkpoint.dir=/tmp/mt_metrics/ck --set log.metrics=/tmp/mt_metrics/m.jsonl "
             "> /dev/null && %s/moetrain train configs/tiny.yaml --backend cpu --set train.steps=3 "
             "--set checkpoint.dir=/tmp/mt_metrics/ck --set log.metrics=/tmp/mt_metrics/m.jsonl --resume auto",
             tu_build(), tu_build());
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, "resolved config written to /tmp/mt_metrics/m.config.yaml"), "%s", out);
    const char *line = strstr(out, "step 3/3");
    cr_assert(line, "%s", out);
    cr_expect(strstr(line, "| 6.14K tok |"), "%s", line);
    FILE *f = fopen("/tmp/mt_metrics/m.jsonl", "r");
    cr_assert(f);
    char buf[1 << 14];
    int n = 0;
    while (fgets(buf, sizeof buf, f)) {
        json_error_t je;
        json_t *o = json_loads(buf, 0, &je);
        cr_assert(o, "line %d not JSON: %s", n + 1, je.text);
        json_int_t step = json_integer_value(json_object_get(o, "step"));
        cr_expect_eq(json_integer_value(json_object_get(o, "tokens")), step * 32 * 64);
        const char *t = json_string_value(json_object_get(o, "time"));
        cr_expect(t && strlen(t) == 24 && t[4] == '-' && t[10] == 'T' && t[23] == 'Z', "time %s", t ? t : "(none)");
        cr_expect(json_is_null(json_object_get(o, "val_loss")));
        json_decref(o);
        n++;
    }
    fclose(f);
    cr_expect_eq(n, 3);
    struct config a, b;
    char err[1024];
    cr_assert(config_load_checked(&a, "/tmp/mt_metrics/m.config.yaml", 0, NULL, err, sizeof err), "%s", err);
    char *sets[] = {"train.steps=3", "checkpoint.dir=/tmp/mt_metrics/ck", "log.metrics=/tmp/mt_metrics/m.jsonl"};
    cr_assert(config_load_checked(&b, "configs/tiny.yaml", 3, sets, err, sizeof err), "%s", err);
    cr_expect_eq(a.train.steps, 3);
    cr_expect_eq(memcmp(&a.model, &b.model, sizeof a.model), 0, "the written config differs in its model section");
    free(out);
    tu_run("rm -rf /tmp/mt_metrics", NULL);
}

/* width and height of a PNG from its IHDR chunk; false if the signature or chunk is not a PNG's */
static bool png_size(const char *path, unsigned *w, unsigned *h, long *bytes)
{
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    unsigned char b[24];
    bool ok = fread(b, 1, 24, f) == 24 && !memcmp(b, "\x89PNG\r\n\x1a\n", 8) && !memcmp(b + 12, "IHDR", 4);
    fseek(f, 0, SEEK_END);
    *bytes = ftell(f);
    fclose(f);
    *w = (unsigned)b[16] << 24 | (unsigned)b[17] << 16 | (unsigned)b[18] << 8 | b[19];
    *h = (unsigned)b[20] << 24 | (unsigned)b[21] << 16 | (unsigned)b[22] << 8 | b[23];
    return ok;
}

/* tools/plot.py on the JSONL of a short run writes every picture as a real PNG of plausible size;
 * a broken JSONL is a one-line error. */
Test(metrics, plot_writes_the_pictures, .timeout = 180)
{
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd,
             "rm -rf /tmp/mt_plot && mkdir -p /tmp/mt_plot && %s/moetrain train configs/tiny.yaml --backend cpu "
             "--set train.steps=6 --set log.metrics=/tmp/mt_plot/m.jsonl > /dev/null && "
             "python3 tools/plot.py /tmp/mt_plot/m.jsonl --out /tmp/mt_plot/png --steps first,3,last",
             tu_build());
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    free(out);
    const char *names[] = {"loss", "lr", "grad_norm", "throughput", "expert_load", "load_balance"};
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        char path[256];
        snprintf(path, sizeof path, "/tmp/mt_plot/png/%s.png", names[k]);
        unsigned w = 0, h = 0;
        long bytes = 0;
        cr_expect(png_size(path, &w, &h, &bytes), "%s is not a PNG", path);
        cr_expect(w >= 300 && w <= 4000 && h >= 200 && h <= 2000, "%s is %ux%u", path, w, h);
        cr_expect(bytes > 5000, "%s has only %ld bytes", path, bytes);
    }
    tu_run("echo '{\"step\": 1' >> /tmp/mt_plot/m.jsonl", NULL);
    int rc = tu_run("python3 tools/plot.py /tmp/mt_plot/m.jsonl --out /tmp/mt_plot/png", &out);
    cr_expect_neq(rc, 0);
    cr_expect(strstr(out, "/tmp/mt_plot/m.jsonl:7: not JSON"), "%s", out);
    free(out);
    tu_run("rm -rf /tmp/mt_plot", NULL);
}

/* tools/plot.py --tensorboard: the event files hold the JSONL's losses at the JSONL's steps, read
 * back through TensorBoard's own record format (tests/tools/tb_events.py). */
Test(metrics, tensorboard_events_hold_the_jsonl_scalars, .timeout = 180)
{
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd,
             "rm -rf /tmp/mt_tb && mkdir -p /tmp/mt_tb && %s/moetrain train configs/tiny.yaml --backend cpu "
             "--set train.steps=5 --set log.metrics=/tmp/mt_tb/m.jsonl > /dev/null && "
             "python3 tools/plot.py /tmp/mt_tb/m.jsonl --out /tmp/mt_tb/png --tensorboard /tmp/mt_tb/tb > /dev/null && "
             "python3 tests/tools/tb_events.py /tmp/mt_tb/tb",
             tu_build());
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    double loss[8];
    cr_assert_eq(tu_read_losses("/tmp/mt_tb/m.jsonl", loss, 8), 5);
    int seen = 0;
    for (const char *line = out; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        int step = 0;
        double v = 0;
        if (sscanf(line, "loss %d %lf", &step, &v) != 2) continue;
        cr_assert(step >= 1 && step <= 5, "event at step %d", step);
        cr_expect(fabs(v - loss[step - 1]) <= 1e-6 * fabs(loss[step - 1]), "step %d: event %.9g, JSONL %.9g", step, v,
                  loss[step - 1]);
        seen++;
    }
    cr_expect_eq(seen, 5, "%d loss events:\n%s", seen, out);
    cr_expect(!strstr(out, "ep_load_max"), "one EP rank, yet an ep load event:\n%s", out);
    free(out);

    /* EP=2: an ep_load_max event a step, the largest of the step's per-layer values in the JSONL */
    snprintf(cmd, sizeof cmd,
             "rm -rf /tmp/mt_tb && mkdir -p /tmp/mt_tb && timeout 100 %s -np 2 %s/moetrain train configs/tiny.yaml "
             "--backend cpu --set train.steps=3 --set parallel.expert_parallel_size=2 "
             "--set log.metrics=/tmp/mt_tb/m.jsonl > /dev/null && "
             "python3 tools/plot.py /tmp/mt_tb/m.jsonl --out /tmp/mt_tb/png --tensorboard /tmp/mt_tb/tb > /dev/null && "
             "python3 tests/tools/tb_events.py /tmp/mt_tb/tb",
             tu_mpirun(), tu_build());
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    double want[3] = {0, 0, 0};
    FILE *f = fopen("/tmp/mt_tb/m.jsonl", "r");
    cr_assert(f);
    static char line[1 << 20];
    for (int i = 0; i < 3 && fgets(line, sizeof line, f); i++) {
        json_t *o = json_loads(line, 0, NULL), *a = json_object_get(o, "ep_load_max");
        cr_assert(json_array_size(a) > 0, "line %d: no ep_load_max", i + 1);
        for (size_t l = 0; l < json_array_size(a); l++) want[i] = fmax(want[i], json_number_value(json_array_get(a, l)));
        json_decref(o);
    }
    fclose(f);
    seen = 0;
    for (const char *ln = out; ln && *ln; ln = strchr(ln, '\n') ? strchr(ln, '\n') + 1 : NULL) {
        int step = 0;
        double v = 0;
        if (sscanf(ln, "ep_load_max %d %lf", &step, &v) != 2) continue;
        cr_assert(step >= 1 && step <= 3, "event at step %d", step);
        cr_expect(fabs(v - want[step - 1]) <= 1e-6 * want[step - 1], "step %d: event %.9g, JSONL %.9g", step, v,
                  want[step - 1]);
        seen++;
    }
    cr_expect_eq(seen, 3, "%d ep_load_max events:\n%s", seen, out);
    free(out);
    tu_run("rm -rf /tmp/mt_tb", NULL);
}
