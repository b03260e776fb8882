/* The training step's pieces (lr schedule, FLOPs, aux loss, aux-free bias) and whole runs of the
 * binary: verify on the transformers fixture, a loss that falls on the synthetic corpus, and the
 * mesh invariance of design.md (same losses and final parameters on every mesh). */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <unistd.h>

#include "../test_util.h"
#include "config.h"
#include "flops.h"
#include "ops.h"
#include "safetensors.h"
#include "step_maths.h"

#define FIXTURE "tests/fixtures/qwen3moe-tiny"

Test(train, lr_schedule_warmup_then_cosine)
{
    struct config c;
    config_defaults(&c);
    c.train.lr = 1e-3;
    c.train.min_lr = 1e-4;
    c.train.warmup_steps = 10;
    c.train.steps = 110;
    cr_expect_float_eq(train_lr_at(&c.train, 1), 1e-4, 1e-12);
    cr_expect_float_eq(train_lr_at(&c.train, 5), 5e-4, 1e-12);
    cr_expect_float_eq(train_lr_at(&c.train, 10), 1e-3, 1e-12);
    /* halfway through the decay the cosine is at its midpoint */
    cr_expect_float_eq(train_lr_at(&c.train, 60), 0.5 * (1e-3 + 1e-4), 1e-12);
    cr_expect_float_eq(train_lr_at(&c.train, 110), 1e-4, 1e-12);
    for (int s = 11; s < 110; s++) cr_expect(train_lr_at(&c.train, s + 1) <= train_lr_at(&c.train, s));
}

Test(train, flops_match_the_spec_for_qwen3_30b_a3b)
{
    struct config c;
    config_defaults(&c);
    struct model_config *m = &c.model;
    m->vocab_size = 151936;
    m->hidden_size = 2048;
    m->num_hidden_layers = 48;
    m->num_attention_heads = 32;
    m->num_key_value_heads = 4;
    m->head_dim = 128;
    m->num_experts = 128;
    m->num_experts_per_tok = 8;
    m->moe_intermediate_size = 768;
    /* spec §9: N = 3,041,656,832 matmul parameters per token; 6N + 1,179,648·(S+1) at S = 4096 */
    cr_expect_eq((long long)flops_matmul_params_per_token(m), 3041656832LL);
    cr_expect_float_eq(flops_train_per_token(m, 4096), 6.0 * 3041656832.0 + 1179648.0 * 4097, 1.0);
}

static void tiny_model(struct model_config *m, int L, int E)
{
    struct config c;
    config_defaults(&c);
    *m = c.model;
    m->num_hidden_layers = L;
    m->num_experts = E;
    m->num_experts_per_tok = 2;
}

Test(train, aux_is_top_k_for_perfectly_uniform_routing)
{
    /* spec §6: with uniform routing aux = k */
    struct model_config m;
    tiny_model(&m, 3, 8);
    const int E = 8, L = 3, T = 40, k = 2;
    float stats[3 * 2 * 8];
    for (int l = 0; l < L; l++)
        for (int e = 0; e < E; e++) {
            stats[l * 2 * E + e] = (float)T / E;          /* psum: probs average 1/E */
            stats[l * 2 * E + E + e] = (float)T * k / E;  /* count: k choices spread evenly */
        }
    double aux;
    aux_from_stats(stats, L, &m, T, &aux, NULL);
    cr_expect_float_eq(aux, 2.0, 1e-9);
}

Test(train, aux_gradient_matches_finite_differences_of_the_statistic)
{
    struct model_config m;
    tiny_model(&m, 2, 8);
    const int E = 8, L = 2, T = 16;
    float stats[2 * 2 * 8];
    unsigned s = 7;
    for (int l = 0; l < L; l++)
        for (int e = 0; e < E; e++) {
            s = s * 1103515245u + 12345u;
            stats[l * 2 * E + e] = 0.5f + (float)(s >> 16) / 65536.0f * 3.0f;
            stats[l * 2 * E + E + e] = (float)((s >> 8) % 7);
        }
    double aux, cnt[8];
    aux_from_stats(stats, L, &m, T, &aux, cnt);
    float g[8];
    aux_grad_from_counts(cnt, E, L, T, 1.0, g);
    for (int e = 0; e < E; e++) {
        /* aux is linear in each psum entry: a finite difference is exact up to rounding */
        const float h = 0.25f;
        float saved = stats[e];
        stats[e] = saved + h;
        double up;
        aux_from_stats(stats, L, &m, T, &up, NULL);
        stats[e] = saved;
        cr_expect(fabs((up - aux) / h - g[e]) <= 1e-6 + 1e-4 * fabs(g[e]), "expert %d: fd %g vs %g", e,
                  (up - aux) / h, (double)g[e]);
    }
}

/* The backend's aux_grad_from_stats (the device-side path of src/step_stats.h) gives the host
 * formula's bits: aux_from_stats' counts over the MoE layers, then aux_grad_from_counts. */
Test(train, aux_grad_from_stats_is_the_host_formula)
{
    struct model_config m;
    tiny_model(&m, 3, 8);
    m.n_mlp_only_layers = 1, m.mlp_only_layers[0] = 1; /* layer 1 dense: its statistics stay zero */
    const int E = 8, L = 3;
    const int64_t T = 48;
    float stats[3 * 2 * 8] = {0};
    unsigned s = 11;
    for (int l = 0; l < L; l++)
        for (int e = 0; l != 1 && e < E; e++) {
            s = s * 1103515245u + 12345u;
            stats[l * 2 * E + e] = 0.25f + (float)(s >> 16) / 65536.0f * 9.0f;
            stats[l * 2 * E + E + e] = (float)((s >> 8) % 29);
        }
    double aux, cnt[8];
    aux_from_stats(stats, L, &m, T, &aux, cnt);
    float want[8], got[8];
    const double scale = 0.001 / 7;
    aux_grad_from_counts(cnt, E, 2, T, scale, want);
    backend_cpu()->aux_grad_from_stats(got, stats, L, E, scale, 2.0 * (double)T);
    for (int e = 0; e < E; e++) cr_expect(got[e] == want[e], "expert %d: %.9g vs %.9g", e, (double)got[e], (double)want[e]);
}

/* Every line's ep_load_max[l] is the busiest of the ep ranks' sums of expert_tokens[l] (experts
 * [r E/ep, (r+1) E/ep) on rank r) over their mean, recomputed here from the logged counts. */
static void check_ep_load_against_expert_tokens(const char *path, int ep)
{
    FILE *f = fopen(path, "r");
    cr_assert(f, "%s", path);
    static char line[1 << 20];
    int lines = 0;
    while (fgets(line, sizeof line, f)) {
        json_error_t je;
        json_t *o = json_loads(line, 0, &je);
        cr_assert(o, "%s: %s", path, je.text);
        json_t *ep_load = json_object_get(o, "ep_load_max"), *tok = json_object_get(o, "expert_tokens");
        cr_assert(json_array_size(ep_load) > 0 && json_array_size(tok) == json_array_size(ep_load));
        for (size_t l = 0; l < json_array_size(tok); l++) {
            json_t *row = json_array_get(tok, l);
            const size_t E = json_array_size(row), per = E / (size_t)ep;
            double sums[8] = {0}, total = 0, busiest = 0;
            for (size_t e = 0; e < E; e++) sums[e / per] += json_number_value(json_array_get(row, e));
            for (int r = 0; r < ep; r++) total += sums[r], busiest = fmax(busiest, sums[r]);
            const double want = busiest / (total / ep), got = json_number_value(json_array_get(ep_load, l));
            cr_expect(fabs(got - want) <= 1e-5 * want, "line %d layer %zu: ep_load_max %.8g, from the counts %.8g",
                      lines + 1, l, got, want);
        }
        json_decref(o);
        lines++;
    }
    fclose(f);
    cr_expect(lines > 0);
}

/* src/step_stats.h: fetching the step's losses and router statistics once at the step's end (the
 * statistics summed over the stage's ranks by the backend's collective, the aux gradient made by
 * the backend) trains bit for bit as the per-micro-step host path (MT_STEP_SYNC=1): loss, aux loss,
 * gradient norm and expert loads of every step, on one rank, two data-parallel ranks and EP = 2
 * (with the ep load against the logged expert counts there). */
Test(train, step_statistics_at_the_step_end_change_nothing, .timeout = 600)
{
    const struct {
        int np;
        const char *tag, *opts;
    } runs[] = {{1, "one", ""},
                {2, "dp2", ""},
                {2, "ep2", "--set parallel.expert_parallel_size=2"}};
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        char cmd[1024], *out = NULL, m0[64], m1[64];
        snprintf(m0, sizeof m0, "/tmp/mt_ss_%s_0.jsonl", runs[r].tag);
        snprintf(m1, sizeof m1, "/tmp/mt_ss_%s_1.jsonl", runs[r].tag);
        snprintf(cmd, sizeof cmd,
                 "for v in 0 1; do MT_STEP_SYNC=$v timeout 240 %s -np %d %s/moetrain train configs/tiny.yaml "
                 "--backend cpu --set train.steps=3 --set log.metrics=/tmp/mt_ss_%s_$v.jsonl %s > /dev/null || exit 1; "
                 "done",
                 tu_mpirun(), runs[r].np, tu_build(), runs[r].tag, runs[r].opts);
        cr_assert_eq(tu_run(cmd, &out), 0, "%s: %s", runs[r].tag, out);
        free(out);
        const char *fields[] = {"loss", "ce_loss", "aux_loss", "grad_norm", "load_max", "load_cv"};
        for (int f = 0; f < 6; f++) {
            double a[4], b[4];
            cr_assert_eq(tu_read_metric(m0, fields[f], a, 4), 3);
            cr_assert_eq(tu_read_metric(m1, fields[f], b, 4), 3);
            for (int i = 0; i < 3; i++)
                cr_expect(a[i] == b[i], "%s: %s step %d: %.17g vs %.17g", runs[r].tag, fields[f], i + 1, a[i], b[i]);
        }
        cr_expect(tu_read_metric(m0, "aux_loss", (double[4]){0}, 4) == 3, "%s: aux loss logged", runs[r].tag);
        /* the busiest EP rank's share: logged with EP only, 1 (balanced) to ep (one rank takes all) */
        double ep_load[4];
        const int n_ep_load = tu_read_metric(m0, "ep_load_max", ep_load, 4);
        cr_expect_eq(n_ep_load, strcmp(runs[r].tag, "ep2") ? 0 : 3, "%s: ep_load_max on %d steps", runs[r].tag, n_ep_load);
        for (int i = 0; i < n_ep_load; i++)
            cr_expect(ep_load[i] >= 1 && ep_load[i] <= 2, "%s step %d: ep_load_max %g", runs[r].tag, i + 1, ep_load[i]);
        if (n_ep_load) check_ep_load_against_expert_tokens(m0, 2);
        unlink(m0);
        unlink(m1);
    }
}

Test(train, bias_update_moves_toward_balance)
{
    struct model_config m;
    tiny_model(&m, 1, 4);
    float bias[4] = {0, 0, 0, 0};
    double counts[4] = {10, 30, 20, 20}; /* mean 20 */
    balance_bias_update(bias, counts, &m, 0.5);
    cr_expect_float_eq(bias[0], 0.5f, 0);
    cr_expect_float_eq(bias[1], -0.5f, 0);
    cr_expect_float_eq(bias[2], 0.0f, 0);
    cr_expect_float_eq(bias[3], 0.0f, 0);
}

Test(train, verify_passes_on_the_transformers_fixture, .timeout = 120)
{
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s/moetrain verify %s %s/reference.safetensors --backend cpu", tu_build(),
             FIXTURE, FIXTURE);
    int rc = tu_run(cmd, &out);
    cr_expect_eq(rc, 0, "verify failed:\n%s", out);
    cr_expect(strstr(out, "PASSED: 28 of 28 tensors") != NULL, "%s", out);
    free(out);
}

/* Fixtures made by tools/make_reference.py with transformers for config variants (README there). */
static void verify_passes(const char *dir)
{
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s/moetrain verify %s %s/reference.safetensors --backend cpu", tu_build(),
             dir, dir);
    int rc = tu_run(cmd, &out);
    cr_expect_eq(rc, 0, "verify of %s failed:\n%s", dir, out);
    cr_expect(strstr(out, "PASSED:") != NULL, "%s", out);
    free(out);
}

Test(train, verify_passes_with_a_dense_layer_between_moe_layers, .timeout = 120)
{
    verify_passes("tests/fixtures/qwen3moe-dense-mixed");
}

Test(train, verify_passes_with_tied_embeddings_and_unnormalised_top_k, .timeout = 120)
{
    verify_passes("tests/fixtures/qwen3moe-untied-free");
}

Test(train, verify_passes_with_sparse_step_top1_and_ignored_labels, .timeout = 120)
{
    verify_passes("tests/fixtures/qwen3moe-sparse-step");
}

/* A model directory whose weights differ from the fixture's in one expert: verify must fail. */
Test(train, verify_fails_when_one_expert_weight_is_wrong, .timeout = 120)
{
    char dir[] = "/tmp/mt_verify_XXXXXX", path[512], cmd[2048], err[512], *out = NULL;
    cr_assert(mkdtemp(dir));
    struct st_file *f = st_open(FIXTURE "/model.safetensors", err, sizeof err);
    cr_assert(f, "%s", err);
    struct st_writer *w = st_writer_new();
    float **bufs = calloc((size_t)f->n, sizeof(float *));
    for (int i = 0; i < f->n; i++) {
        const struct st_tensor *t = &f->t[i];
        bufs[i] = malloc((size_t)t->numel * sizeof(float));
        cr_assert(st_read_f32(f, t, bufs[i], t->numel, err, sizeof err), "%s", err);
        if (!strcmp(t->name, "model.layers.1.mlp.experts.3.up_proj.weight"))
            for (int64_t j = 0; j < t->numel; j++) bufs[i][j] *= 1.01f;
        st_writer_add_f32(w, t->name, ST_F32, t->ndim, t->shape, bufs[i]);
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    cr_assert(st_writer_finish(w, path, err, sizeof err), "%s", err);
    snprintf(cmd, sizeof cmd, "cp %s/config.json %s/ && %s/moetrain verify %s %s/reference.safetensors "
             "--backend cpu", FIXTURE, dir, tu_build(), dir, FIXTURE);
    int rc = tu_run(cmd, &out);
    cr_expect_neq(rc, 0, "verify accepted a wrong model:\n%s", out);
    cr_expect(strstr(out, "grad.model.layers.1.mlp.experts.gate_up_proj") && strstr(out, "FAIL"), "%s", out);
    free(out);
    for (int i = 0; i < f->n; i++) free(bufs[i]);
    free(bufs);
    st_close(f);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    tu_run(cmd, NULL);
}

Test(train, loss_falls_toward_the_corpus_entropy, .timeout = 300)
{
    char cmd[1024], *out = NULL;
    const char *metrics = "/tmp/mt_loss_falls.jsonl";
    snprintf(cmd, sizeof cmd, "%s/moetrain train configs/tiny.yaml --backend cpu --set train.steps=150 "
             "--set log.interval=50 --set log.metrics=%s", tu_build(), metrics);
    int rc = tu_run(cmd, &out);
    cr_assert_eq(rc, 0, "%s", out);
    double loss[200];
    int n = tu_read_losses(metrics, loss, 200);
    cr_assert_eq(n, 150);
    /* At init the model is close to uniform over 512 tokens: ln 512 = 6.24. The corpus entropy rate
     * is printed in the start-up table (~1.13 nats for tiny.yaml's chain). We require the mean loss
     * of the last 10 steps to have fallen by more than 3.5 nats and to be within 1 nat of it. */
    const char *h = strstr(out, "entropy rate ");
    cr_assert(h, "%s", out);
    double entropy = strtod(h + strlen("entropy rate "), NULL);
    double tail = 0;
    for (int i = n - 10; i < n; i++) tail += loss[i] / 10;
    cr_expect(loss[0] > 6.0, "initial loss %g", loss[0]);
    cr_expect(loss[0] - tail > 3.5, "loss fell only from %g to %g", loss[0], tail);
    cr_expect(tail < entropy + 1.0, "final loss %g vs entropy rate %g", tail, entropy);
    free(out);
    unlink(metrics);
}

/* Same global batch on every mesh: per-step losses and the exported final weights must equal the
 * single-rank run's to 1e-5 relative. The global micro-batch (8 sequences) is the same on every
 * mesh, so the pooled aux statistic is too (design.md). */
static void run_mesh(int np, int ep, const char *tag, const char *extra, const char *mesh_extra)
{
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd, "rm -rf /tmp/mt_mesh_%s && timeout 240 %s -np %d %s/moetrain train configs/tiny.yaml "
             "--backend cpu --set train.steps=5 --set train.micro_batch_size=%d "
             "--set parallel.expert_parallel_size=%d --set log.metrics=/tmp/mt_mesh_%s.jsonl "
             "--set checkpoint.export_hf=/tmp/mt_mesh_%s --set checkpoint.export_dtype=fp32 %s %s",
             tag, tu_mpirun(), np, tu_build(), 8 / np, ep, tag, tag, extra, mesh_extra ? mesh_extra : "");
    int rc = tu_run(cmd, &out);
    cr_assert_eq(rc, 0, "mesh %s failed:\n%s", tag, out);
    free(out);
}

static double tensor_rel_diff(const struct st_file *a, const struct st_file *b, const struct st_tensor *ta)
{
    char err[512];
    const struct st_tensor *tb = st_find(b, ta->name);
    cr_assert(tb && tb->numel == ta->numel, "tensor %s missing", ta->name);
    float *x = malloc((size_t)ta->numel * sizeof(float)), *y = malloc((size_t)ta->numel * sizeof(float));
    cr_assert(st_read_f32(a, ta, x, ta->numel, err, sizeof err) && st_read_f32(b, tb, y, tb->numel, err, sizeof err));
    double d = 0, r = 0;
    for (int64_t i = 0; i < ta->numel; i++) {
        d += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
        r += (double)x[i] * x[i];
    }
    free(x);
    free(y);
    return sqrt(d / r);
}

/* Runs the single-rank reference and the given meshes with `extra` options; compares losses,
 * gradient norms (each element counted once) and the final weights. */
static void check_meshes_ex(int n, const int (*meshes)[2], const char *const *names, const char *ref_name,
                            const char *extra, const char *const *mesh_extra)
{
    double ref[8], got[8], gref[8], ggot[8];
    char err[512], path[256];
    run_mesh(1, 1, ref_name, extra, NULL);
    snprintf(path, sizeof path, "/tmp/mt_mesh_%s.jsonl", ref_name);
    cr_assert_eq(tu_read_losses(path, ref, 8), 5);
    cr_assert_eq(tu_read_metric(path, "grad_norm", gref, 8), 5);
    snprintf(path, sizeof path, "/tmp/mt_mesh_%s/model.safetensors", ref_name);
    struct st_file *a = st_open(path, err, sizeof err);
    cr_assert(a, "%s", err);
    for (int k = 0; k < n; k++) {
        run_mesh(meshes[k][0], meshes[k][1], names[k], extra, mesh_extra ? mesh_extra[k] : NULL);
        snprintf(path, sizeof path, "/tmp/mt_mesh_%s.jsonl", names[k]);
        cr_assert_eq(tu_read_losses(path, got, 8), 5);
        cr_assert_eq(tu_read_metric(path, "grad_norm", ggot, 8), 5);
        for (int s = 0; s < 5; s++) {
            cr_expect(fabs(got[s] - ref[s]) <= 1e-5 * fabs(ref[s]), "mesh %s step %d: loss %.8f vs %.8f",
                      names[k], s + 1, got[s], ref[s]);
            cr_expect(fabs(ggot[s] - gref[s]) <= 1e-5 * fabs(gref[s]),
                      "mesh %s step %d: grad norm %.8f vs %.8f", names[k], s + 1, ggot[s], gref[s]);
        }
        snprintf(path, sizeof path, "/tmp/mt_mesh_%s/model.safetensors", names[k]);
        struct st_file *b = st_open(path, err, sizeof err);
        cr_assert(b, "%s", err);
        cr_expect_eq(a->n, b->n);
        for (int i = 0; i < a->n; i++) {
            double rel = tensor_rel_diff(a, b, &a->t[i]);
            cr_expect(rel <= 1e-5, "mesh %s: %s differs by %.3g", names[k], a->t[i].name, rel);
        }
        st_close(b);
    }
    st_close(a);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf /tmp/mt_mesh_%s*", ref_name);
    for (int k = 0; k < n; k++)
        snprintf(cmd + strlen(cmd), sizeof cmd - strlen(cmd), " /tmp/mt_mesh_%s*", names[k]);
    tu_run(cmd, NULL);
}

static void check_meshes(int n, const int (*meshes)[2], const char *const *names, const char *ref_name,
                         const char *extra)
{
    check_meshes_ex(n, meshes, names, ref_name, extra, NULL);
}

/* Pipeline stages (1F1B) with EP and EP_FSDP inside them: micro_batch_size keeps 8 sequences per
 * global micro-batch (8 / ranks per stage). */
Test(train, pipelines_train_the_same_model, .timeout = 900)
{
    const int meshes[][2] = {{4, 2}, {8, 2}};
    const char *names[] = {"pp2ep2", "pp2ep2fsdp2"};
    /* activation checkpointing changes no number, so it may differ from the reference */
    const char *extra[] = {"--set parallel.pipeline_parallel_size=2 --set train.micro_batch_size=4",
                           "--set parallel.pipeline_parallel_size=2 --set train.micro_batch_size=2 "
                           "--set train.activation_checkpointing=true"};
    check_meshes_ex(2, meshes, names, "pp_ref1x1", "", extra);
}

/* Aux-loss-free balancing: the bias update needs every stage's per-layer token counts. */
Test(train, pipelines_with_bias_balancing, .timeout = 600)
{
    const int meshes[][2] = {{4, 2}};
    const char *names[] = {"bias_pp2ep2"};
    const char *extra[] = {"--set parallel.pipeline_parallel_size=2 --set train.micro_batch_size=4"};
    check_meshes_ex(1, meshes, names, "bias_pp_ref1x1", "--set train.load_balance=bias --set train.bias_update_rate=0.05",
                    extra);
}

/* One layer per stage on a 4-layer model, and a tied embedding shared by the first and the last
 * stage (its gradient summed over both, counted once in the norm), uneven pipeline_layers. */
Test(train, pipelines_of_one_layer_per_stage_and_tied_embeddings, .timeout = 900)
{
    const int m4[][2] = {{4, 1}};
    const char *n4[] = {"pp4"}, *e4[] = {"--set parallel.pipeline_parallel_size=4 --set train.micro_batch_size=8"};
    check_meshes_ex(1, m4, n4, "pp4_ref1x1", "--set model.num_hidden_layers=4", e4);
    const int mt[][2] = {{2, 1}, {6, 2}};
    const char *nt[] = {"pp2tied", "pp3tied_ep2"};
    const char *et[] = {"--set parallel.pipeline_parallel_size=2 --set train.micro_batch_size=8",
                        "--set parallel.pipeline_parallel_size=3 --set parallel.pipeline_layers=[1,2,1] "
                        "--set train.micro_batch_size=4"};
    check_meshes_ex(2, mt, nt, "tied_ref1x1", "--set model.num_hidden_layers=4 --set model.tie_word_embeddings=true", et);
}

Test(train, every_mesh_trains_the_same_model, .timeout = 900)
{
    const int meshes[][2] = {{2, 2}, {2, 1}, {4, 4}, {4, 2}, {8, 4}}; /* (ranks, ep) */
    const char *names[] = {"ep2", "fsdp2", "ep4", "ep2fsdp2", "ep4fsdp2"};
    check_meshes(5, meshes, names, "plain1x1", "");
}

/* Aux-loss-free balancing pools token counts over the whole step and every rank: mesh-invariant
 * too. The rate is large so the bias changes the routing within 5 steps. */
Test(train, bias_balancing_is_mesh_invariant, .timeout = 600)
{
    const int meshes[][2] = {{4, 2}, {8, 4}};
    const char *names[] = {"bias_ep2fsdp2", "bias_ep4fsdp2"};
    check_meshes(2, meshes, names, "bias1x1", "--set train.load_balance=bias --set train.bias_update_rate=0.05");
}

/* With the router frozen its weights stay at their initial values: 1 and 3 steps give the same
 * router and different everything else. */
Test(train, freeze_router_keeps_router_weights, .timeout = 300)
{
    char cmd[1024], err[512], *out = NULL;
    snprintf(cmd, sizeof cmd, "rm -rf /tmp/mt_frz1 /tmp/mt_frz3; for s in 1 3; do %s/moetrain train "
             "configs/tiny.yaml --backend cpu --set train.steps=$s --set model.freeze_router=true "
             "--set checkpoint.export_hf=/tmp/mt_frz$s --set checkpoint.export_dtype=fp32 || exit 1; done", tu_build());
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    free(out);
    struct st_file *a = st_open("/tmp/mt_frz1/model.safetensors", err, sizeof err);
    struct st_file *b = st_open("/tmp/mt_frz3/model.safetensors", err, sizeof err);
    cr_assert(a && b, "%s", err);
    for (int i = 0; i < a->n; i++) {
        double rel = tensor_rel_diff(a, b, &a->t[i]);
        if (strstr(a->t[i].name, "mlp.gate.weight")) cr_expect(rel == 0, "%s moved by %g", a->t[i].name, rel);
        else cr_expect(rel > 0, "%s did not train", a->t[i].name);
    }
    st_close(a);
    st_close(b);
    tu_run("rm -rf /tmp/mt_frz1 /tmp/mt_frz3", NULL);
}

/* log.profile: the step line is followed by the time split and the metrics carry it. */
Test(train, profile_reports_a_time_split, .timeout = 120)
{
    char cmd[1024], *out = NULL;
    const char *metrics = "/tmp/mt_profile.jsonl";
    snprintf(cmd, sizeof cmd, "%s/moetrain train configs/tiny.yaml --backend cpu --set train.steps=2 "
             "--set log.profile=true --set log.metrics=%s", tu_build(), metrics);
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, "    time: attention ") && strstr(out, "| host/idle "), "%s", out);
    double att[4], gemm[4];
    cr_expect_eq(tu_read_metric(metrics, "attention", att, 4), 2);
    cr_expect_eq(tu_read_metric(metrics, "expert GEMMs", gemm, 4), 2);
    cr_expect(att[0] > 0 && gemm[0] > 0, "attention %g s, expert GEMMs %g s", att[0], gemm[0]);
    /* the per-op table of the last step: a header, then rows with the attention backward in them */
    cr_expect(strstr(out, "    op ") && strstr(out, "    attention_backward "), "%s", out);
    free(out);
    unlink(metrics);
}

/* train.activation_checkpointing recomputes each layer's forward in the backward with the same
 * deterministic ops: losses, gradient norms and final weights must be bit-identical to a run that
 * kept every activation (here on 4 ranks with EP=2 and a dense layer between MoE layers). */
Test(train, activation_checkpointing_changes_nothing, .timeout = 300)
{
    char cmd[2048], *out = NULL, err[512];
    snprintf(cmd, sizeof cmd, "rm -rf /tmp/mt_ac_*; for ac in false true; do timeout 240 %s -np 4 %s/moetrain train "
             "configs/tiny.yaml --backend cpu --set train.steps=3 --set parallel.expert_parallel_size=2 "
             "--set model.num_hidden_layers=3 --set model.mlp_only_layers=[1] "
             "--set train.activation_checkpointing=$ac --set log.metrics=/tmp/mt_ac_$ac.jsonl "
             "--set checkpoint.export_hf=/tmp/mt_ac_$ac --set checkpoint.export_dtype=fp32 || exit 1; done", tu_mpirun(), tu_build());
    cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
    free(out);
    double a[4], b[4];
    const char *fields[] = {"loss", "aux_loss", "grad_norm"};
    for (int f = 0; f < 3; f++) {
        cr_assert_eq(tu_read_metric("/tmp/mt_ac_false.jsonl", fields[f], a, 4), 3);
        cr_assert_eq(tu_read_metric("/tmp/mt_ac_true.jsonl", fields[f], b, 4), 3);
        for (int s = 0; s < 3; s++) cr_expect(a[s] == b[s], "%s step %d: %.9g vs %.9g", fields[f], s + 1, a[s], b[s]);
    }
    struct st_file *x = st_open("/tmp/mt_ac_false/model.safetensors", err, sizeof err);
    struct st_file *y = st_open("/tmp/mt_ac_true/model.safetensors", err, sizeof err);
    cr_assert(x && y, "%s", err);
    for (int i = 0; i < x->n; i++)
        cr_expect(tensor_rel_diff(x, y, &x->t[i]) == 0, "%s differs", x->t[i].name);
    st_close(x);
    st_close(y);
    tu_run("rm -rf /tmp/mt_ac_*", NULL);
}

/* model.init_from a Hugging Face directory: each rank reads only its shard's parts (its experts,
 * its rows); 4 ranks as EP=2 x EP_FSDP=2 start from, and train like, the single-rank run. */
Test(train, init_from_hf_is_the_same_model_on_every_mesh, .timeout = 300)
{
    char cmd[2048], *out = NULL;
    double one[4], four[4];
    for (int np = 1; np <= 4; np += 3) {
        snprintf(cmd, sizeof cmd, "timeout 240 %s -np %d %s/moetrain train configs/tiny.yaml --backend cpu "
                 "--set model.hf_config=" FIXTURE "/config.json --set model.init_from=" FIXTURE " "
                 "--set parallel.expert_parallel_size=%d --set train.steps=3 --set train.global_batch_size=8 "
                 "--set train.micro_batch_size=%d --set log.metrics=/tmp/mt_hfinit_%d.jsonl",
                 tu_mpirun(), np, tu_build(), np == 1 ? 1 : 2, 8 / np, np);
        cr_assert_eq(tu_run(cmd, &out), 0, "%s", out);
        cr_expect(strstr(out, "weights from " FIXTURE), "%s", out);
        free(out);
    }
    cr_assert_eq(tu_read_losses("/tmp/mt_hfinit_1.jsonl", one, 4), 3);
    cr_assert_eq(tu_read_losses("/tmp/mt_hfinit_4.jsonl", four, 4), 3);
    for (int s = 0; s < 3; s++)
        cr_expect(fabs(one[s] - four[s]) <= 1e-5 * one[s], "step %d: %.8f vs %.8f", s + 1, one[s], four[s]);
    tu_run("rm -f /tmp/mt_hfinit_*.jsonl", NULL);
}

Test(train, init_from_a_missing_directory_is_one_line_on_every_rank, .timeout = 120)
{
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd, "timeout 100 %s -np 2 %s/moetrain train configs/tiny.yaml --backend cpu "
             "--set model.init_from=/nonexistent/model --set parallel.expert_parallel_size=2",
             tu_mpirun(), tu_build());
    int rc = tu_run(cmd, &out);
    cr_expect(rc != 0 && rc != 124, "rc %d:\n%s", rc, out);
    const char *hit = strstr(out, "moetrain: error: /nonexistent/model");
    cr_expect(hit && !strstr(hit + 1, "moetrain: error:"), "expected exactly one error line:\n%s", out);
    free(out);
}

/* `moetrain export`: a checkpoint saved by 4 ranks (EP=2 x EP_FSDP=2) becomes the same Hugging Face
 * files, byte for byte, as the training run's own export of the same step. */
Test(train, export_a_checkpoint_to_hf, .timeout = 300)
{
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd, "rm -rf /tmp/mt_export && timeout 240 %s -np 4 %s/moetrain train configs/tiny.yaml "
             "--backend cpu --set train.steps=3 --set parallel.expert_parallel_size=2 "
             "--set checkpoint.dir=/tmp/mt_export/ck --set checkpoint.export_hf=/tmp/mt_export/final && "
             "%s/moetrain export /tmp/mt_export/ck/step_00000003 /tmp/mt_export/conv && "
             "cmp /tmp/mt_export/conv/model.safetensors /tmp/mt_export/final/model.safetensors && "
             "%s/moetrain export /tmp/mt_export/ck /tmp/mt_export/bad", tu_mpirun(), tu_build(), tu_build(), tu_build());
    int rc = tu_run(cmd, &out);
    /* everything up to the last command succeeds; exporting the checkpoint ROOT is a one-line error */
    cr_expect_eq(rc, 1, "%s", out);
    cr_expect(strstr(out, "exported step 3 of /tmp/mt_export/ck/step_00000003"), "%s", out);
    cr_expect(strstr(out, "moetrain: error: /tmp/mt_export/ck is not a complete checkpoint"), "%s", out);
    free(out);
    tu_run("rm -rf /tmp/mt_export", NULL);
}
