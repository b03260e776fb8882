/* `moetrain verify MODEL_DIR REFERENCE.safetensors`: runs the reference batch through the model
 * loaded from MODEL_DIR (a Hugging Face directory or a checkpoint) and compares logits, loss, aux
 * loss and, unless --forward-only, every parameter gradient with the reference dump (format: tests/fixtures/README.md). Relative error = ‖ours − ref‖ / ‖ref‖ (the
 * plain norm of the difference where the reference is all zeros). */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mpi.h>

#include "backend_select.h"
#include "checkpoint.h"
#include "hf_export.h"
#include "cli.h"
#include "common.h"
#include "config.h"
#include "hf_load.h"
#include "model_step.h"
#include "params.h"
#include "safetensors.h"
#include "step_maths.h"

/* One compared tensor: ‖ours − ref‖ and ‖ref‖. */
struct cmp {
    char name[256];
    double diff, ref;
    int64_t n;
};

struct verify_ctx {
    const struct st_file *ref;
    double tol;
    struct cmp *rows;
    int n_rows, cap;
};

static void compare(struct verify_ctx *v, const char *name, const float *ours, const float *ref, int64_t n)
{
    if (v->n_rows == v->cap) {
        v->cap = v->cap ? 2 * v->cap : 64;
        v->rows = mt_realloc(v->rows, (size_t)v->cap * sizeof *v->rows);
    }
    struct cmp *c = &v->rows[v->n_rows++];
    snprintf(c->name, sizeof c->name, "%s", name);
    double d = 0, r = 0;
    for (int64_t i = 0; i < n; i++) {
        double x = (double)ours[i] - ref[i];
        d += x * x;
        r += (double)ref[i] * ref[i];
    }
    c->diff = sqrt(d);
    c->ref = sqrt(r);
    c->n = n;
}

/* Prints the table and returns the number of failures. A tensor passes when its relative error is
 * within tol, or when the reference itself is rounding noise: a gradient that is exactly zero in
 * exact arithmetic (e.g. the router of a top-1 layer with norm_topk_prob, whose weight p/p is
 * constant) comes out of autograd as ~1e-10 noise. Such a tensor passes if ‖ours − ref‖ is within
 * tol × sqrt(numel) × the RMS of all reference gradients, i.e. 1e4 times smaller than a typical
 * gradient of its size. */
static int report(const struct verify_ctx *v, int first_grad, double *worst)
{
    double r2 = 0, n = 0;
    for (int i = first_grad; i < v->n_rows; i++) {
        r2 += v->rows[i].ref * v->rows[i].ref;
        n += (double)v->rows[i].n;
    }
    double rms = n > 0 ? sqrt(r2 / n) : 0;
    int failed = 0;
    *worst = 0;
    for (int i = 0; i < v->n_rows; i++) {
        const struct cmp *c = &v->rows[i];
        double rel = c->ref > 0 ? c->diff / c->ref : c->diff;
        bool ok = rel <= v->tol; /* false for NaN */
        bool noise = !ok && i >= first_grad && c->diff <= v->tol * sqrt((double)c->n) * rms;
        if (noise) {
            printf("  %-60s %10.3e  ok (reference is rounding noise: |ref| %.2e, |diff| %.2e)\n",
                   c->name, rel, c->ref, c->diff);
            continue;
        }
        printf("  %-60s %10.3e  %s\n", c->name, rel, ok ? "ok" : "FAIL");
        failed += !ok;
        if (!(rel <= *worst)) *worst = rel;
    }
    return failed;
}

/* Reads reference tensor `name` (fp32 values) into a new buffer of n elements; NULL if absent. */
static float *ref_read(const struct st_file *ref, const char *name, int64_t n)
{
    const struct st_tensor *t = st_find(ref, name);
    if (!t) return NULL;
    char err[512];
    if (t->numel != n)
        mt_user_error("%s: tensor '%s' has %lld elements, the model expects %lld", ref->path, name,
                      (long long)t->numel, (long long)n);
    float *buf = mt_malloc((size_t)n * sizeof(float));
    if (!st_read_f32(ref, t, buf, n, err, sizeof err)) mt_user_error("%s", err);
    return buf;
}

/* Returns the number of tensors the reference lacks. */
static int compare_grads(struct verify_ctx *v, const struct model *m)
{
    char name[256];
    int missing = 0;
    for (int i = 0; i < m->tt.n; i++) {
        const struct tensor_spec *s = &m->tt.t[i];
        float *ours = mt_malloc((size_t)s->numel * sizeof(float));
        m->be->download(ours, model_grad(m, i), (size_t)s->numel * sizeof(float));
        snprintf(name, sizeof name, "grad.%s", s->name);
        float *ref = ref_read(v->ref, name, s->numel);
        if (ref) {
            compare(v, name, ours, ref, s->numel);
            free(ref);
            free(ours);
            continue;
        }
        /* a fused dense tensor: the reference holds its hub parts (e.g. mlp.gate_proj / up_proj) */
        bool found = s->n_hf == 2 && s->kind != TK_EXPERT;
        int64_t part = s->numel / 2;
        for (int p = 0; found && p < 2; p++) {
            snprintf(name, sizeof name, "grad.%s", s->hf_name[p]);
            ref = ref_read(v->ref, name, part);
            if (!ref) {
                found = false;
                break;
            }
            compare(v, name, ours + p * part, ref, part);
            free(ref);
        }
        if (!found) {
            printf("  %-60s %10s  MISSING from the reference\n", s->name, "-");
            missing++;
        }
        free(ours);
    }
    return missing;
}

/* A checkpoint's config is its manifest's, on one process (the mesh it was saved on does not
 * matter to a forward pass). */
static bool checkpoint_config(const char *dir, const struct cli *a, struct config *c, char *err, int cap)
{
    static char *own[] = {"model.hf_config=", "parallel.pipeline_parallel_size=1", "parallel.expert_parallel_size=1",
                          "checkpoint.dir=", "checkpoint.export_hf=", "log.metrics="};
    const int n_own = (int)(sizeof own / sizeof own[0]);
    char **sets = mt_malloc((size_t)(n_own + a->n_sets) * sizeof(char *));
    for (int i = 0; i < n_own; i++) sets[i] = own[i];
    for (int i = 0; i < a->n_sets; i++) sets[n_own + i] = a->sets[i];
    bool ok = ckpt_read_config(dir, n_own + a->n_sets, sets, c, err, cap);
    free(sets);
    return ok;
}

/* The weights (and balancing bias, when the directory has one) of a Hugging Face directory or a
 * checkpoint into p and m.bias. */
static void load_weights(const char *dir, bool is_ckpt, const struct config *c, struct params *p, struct model *m)
{
    char err[1024];
    const int L = m->L, E = m->E;
    float *bias = mt_calloc((size_t)L * MT_MAX(E, 1), sizeof(float));
    bool have_bias = false;
    if (is_ckpt) {
        struct mesh one;
        memset(&one, 0, sizeof one);
        one.world_comm = MPI_COMM_NULL;
        one.d.world = 1;
        if (!ckpt_load_checked(dir, p, &one, c, bias, NULL, true, err, sizeof err)) mt_user_error("%s", err);
        for (int i = 0; i < L * E && !have_bias; i++) have_bias = bias[i] != 0;
    } else {
        int rows = 0;
        if (!params_load_hf(p, dir, err, sizeof err) || !hf_load_bias(dir, &c->model, bias, &rows, err, sizeof err))
            mt_user_error("%s", err);
        have_bias = rows > 0;
    }
    if (have_bias && E > 0) {
        m->bias = m->be->alloc((size_t)L * E * sizeof(float));
        m->be->upload(m->bias, bias, (size_t)L * E * sizeof(float));
        printf("  routing with the aux-loss-free balancing bias stored in %s\n", dir);
    }
    free(bias);
}

int cmd_verify(const struct cli *a)
{
    char dir[PATH_MAX], err[1024], yaml[PATH_MAX + 64];
    if (!realpath(a->model_dir, dir)) mt_user_error("%s: no such model directory", a->model_dir);
    const bool is_ckpt = ckpt_is_checkpoint(dir);
    struct config c;
    if (is_ckpt) {
        if (!checkpoint_config(dir, a, &c, err, sizeof err)) mt_user_error("%s", err);
    } else {
        snprintf(yaml, sizeof yaml, "model:\n  hf_config: \"%s/config.json\"\n", dir);
        if (!config_load_string_checked(&c, "verify", yaml, strlen(yaml), a->n_sets, a->sets, err, sizeof err))
            mt_user_error("%s", err);
    }
    c.parallel.backend = backend_choice_from_cli(a->backend, c.parallel.backend);
    struct st_file *ref = st_open(a->reference, err, sizeof err);
    if (!ref) mt_user_error("%s", err);
    const struct st_tensor *tid = st_find(ref, "input_ids");
    if (!tid || tid->ndim != 2)
        mt_user_error("%s: no 2-D tensor 'input_ids' (see tests/fixtures/README.md)", a->reference);
    const int B = (int)tid->shape[0], S = (int)tid->shape[1], T = B * S;
    int64_t *ids64 = mt_malloc((size_t)T * sizeof(int64_t)), *lab64 = mt_malloc((size_t)T * sizeof(int64_t));
    int32_t *ids = mt_malloc((size_t)T * sizeof(int32_t)), *labels = mt_malloc((size_t)T * sizeof(int32_t));
    if (!st_read_i64(ref, tid, ids64, T, err, sizeof err)) mt_user_error("%s", err);
    const struct st_tensor *tlab = st_find(ref, "labels");
    if (tlab && !st_read_i64(ref, tlab, lab64, T, err, sizeof err)) mt_user_error("%s", err);
    for (int t = 0; t < T; t++) {
        ids[t] = (int32_t)ids64[t];
        labels[t] = (int32_t)(tlab ? lab64[t] : ids64[t]);
        if (ids64[t] < 0 || ids64[t] >= c.model.vocab_size)
            mt_user_error("%s: input_ids[%d] = %lld is outside the vocabulary of %d", a->reference, t,
                          (long long)ids64[t], c.model.vocab_size);
    }

    const struct backend *be = backend_select(c.parallel.backend, c.model.precision, 0);
    struct model m;
    model_init(&m, be, &c.model, B, S, NULL, false);
    struct params p;
    params_init(&p, &m, NULL, NULL);
    printf("moetrain verify %s against %s (backend %s, batch %dx%d, tolerance %.1e%s)\n", dir,
           a->reference, be->name, B, S, a->tolerance, a->forward_only ? ", forward only" : "");
    load_weights(dir, is_ckpt, &c, &p, &m);
    params_gather_weights(&p);

    struct model_step_out o;
    model_forward(&m, ids, labels, &o);
    float *logits = mt_malloc((size_t)T * m.V * sizeof(float));
    float *tmp = be->alloc((size_t)T * m.V * sizeof(float));
    be->cast_x_to_f32(tmp, m.logits, (size_t)T * m.V);
    be->download(logits, tmp, (size_t)T * m.V * sizeof(float));
    be->free(tmp);

    /* the reference's loss includes coef · aux exactly when it carries an aux_loss */
    bool with_aux = st_find(ref, "aux_loss") != NULL && m.E > 0;
    double aux = 0, *cnt = mt_calloc((size_t)MT_MAX(m.E, 1), sizeof(double));
    float *aux_dp = mt_calloc((size_t)MT_MAX(m.E, 1), sizeof(float));
    if (m.E > 0) {
        aux_from_stats(m.stats_h, m.L, &c.model, T, &aux, cnt);
        aux_grad_from_counts(cnt, m.E, m.n_moe_layers, T, c.model.router_aux_loss_coef, aux_dp);
    }
    if (o.n_valid == 0) mt_user_error("%s: every label is ignored; the loss is undefined", a->reference);
    double ce = o.ce_sum / o.n_valid;
    double loss = ce + (with_aux ? c.model.router_aux_loss_coef * aux : 0);
    if (!a->forward_only) model_backward(&m, (float)(1.0 / o.n_valid), with_aux ? aux_dp : NULL);

    struct verify_ctx v = {.ref = ref, .tol = a->tolerance};
    int first_grad;
    printf("  %-60s %10s\n", "tensor", "rel error");
    float *rl = ref_read(ref, "logits", (int64_t)T * m.V);
    if (!rl) mt_user_error("%s: no tensor 'logits'", a->reference);
    compare(&v, "logits", logits, rl, (int64_t)T * m.V);
    free(rl);
    /* a forward-only dump may carry logits alone: the loss is then printed, not compared */
    float *rloss = ref_read(ref, "loss", 1);
    if (!rloss && !a->forward_only) mt_user_error("%s: no tensor 'loss'", a->reference);
    float floss = (float)loss;
    if (rloss) compare(&v, "loss", &floss, rloss, 1);
    if (with_aux) {
        float *raux = ref_read(ref, "aux_loss", 1), faux = (float)aux;
        compare(&v, "aux_loss", &faux, raux, 1);
        free(raux);
    }
    printf("  loss %.6f = ce %.6f + %.3g x aux %.6f", loss, ce, with_aux ? c.model.router_aux_loss_coef : 0.0, aux);
    if (rloss) printf("; reference %.6f\n", rloss[0]);
    else printf("; the reference has no loss\n");
    free(rloss);
    first_grad = v.n_rows;

    int missing = a->forward_only ? 0 : compare_grads(&v, &m);
    double worst;
    int failed = report(&v, first_grad, &worst) + missing;
    int checked = v.n_rows + missing;
    printf("%s: %d of %d tensors within %.1e (worst %.3e)\n", failed ? "FAILED" : "PASSED",
           checked - failed, checked, v.tol, worst);

    free(logits); free(cnt); free(aux_dp); free(ids64); free(lab64); free(ids); free(labels);
    params_free(&p);
    model_free(&m);
    free(v.rows);
    st_close(ref);
    return failed ? 1 : 0;
}
