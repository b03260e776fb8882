#include "fsdp.h"

#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "mem_track.h"

static const struct backend *be_of(const struct fsdp *f) { return f->p->m->be; }

static bool any_dynamic(const struct fsdp *f)
{
    return f->dyn_w[TG_DENSE] || f->dyn_w[TG_EXPERT] || f->dyn_g[TG_DENSE] || f->dyn_g[TG_EXPERT];
}

static int64_t unit_work(const struct fsdp *f, int g, int u) { return f->dyn_w[g] ? f->p->g[g].u_work[u] : 0; }

static bool fits(const struct fsdp *f, const struct fsdp_wbuf *b, int u)
{
    for (int g = 0; g < TG_COUNT; g++)
        if (unit_work(f, g, u) > b->cap[g]) return false;
    return true;
}

static int64_t size_of(const struct fsdp_wbuf *b) { return b->cap[TG_DENSE] + b->cap[TG_EXPERT]; }

/* The buffer holding unit u's weights, building them into a free buffer when none does: the
 * smallest that fits, the least recently used among equals. Without resharding every unit has a
 * buffer of its own. */
static struct fsdp_wbuf *weights_of(struct fsdp *f, int u)
{
    struct fsdp_wbuf *hit = NULL, *victim = NULL;
    if (!f->reshard) {
        hit = &f->wbuf[u];
        if (hit->unit != u) victim = hit, hit = NULL;
    } else {
        for (int k = 0; k < f->n_bufs; k++) {
            struct fsdp_wbuf *b = &f->wbuf[k];
            if (b->unit == u) hit = b;
            else if (b->users == 0 && fits(f, b, u) &&
                     (!victim || size_of(b) < size_of(victim) ||
                      (size_of(b) == size_of(victim) && b->last_use < victim->last_use)))
                victim = b;
        }
    }
    if (!hit) {
        MT_CHECK(victim, "fsdp: no free working buffer holds unit %d", u);
        for (int g = 0; g < TG_COUNT; g++)
            if (f->dyn_w[g]) params_gather_unit(f->p, (enum tensor_group)g, u, victim->w[g], f->stage);
        victim->unit = u;
        hit = victim;
    }
    hit->last_use = ++f->clock;
    return hit;
}

static void bind_weights(struct fsdp *f, int u, struct fsdp_wbuf *b, struct fsdp_gbuf *gb)
{
    for (int g = 0; g < TG_COUNT; g++)
        params_bind_unit(f->p, (enum tensor_group)g, u, f->dyn_w[g] ? b->w[g] : NULL,
                         gb && f->dyn_g[g] ? gb->g[g] : NULL);
}

static void before_forward(void *ctx, int u)
{
    struct fsdp *f = ctx;
    struct fsdp_wbuf *b = weights_of(f, u);
    b->users++;
    bind_weights(f, u, b, NULL);
}

static struct fsdp_wbuf *holding(struct fsdp *f, int u)
{
    for (int k = 0; k < f->n_bufs; k++)
        if (f->wbuf[k].unit == u) return &f->wbuf[k];
    mt_fatal("fsdp: unit %d released but not held", u);
}

static void after_forward(void *ctx, int u)
{
    struct fsdp *f = ctx;
    struct fsdp_wbuf *b = holding(f, u);
    b->users--;
}

static bool p_tied(const struct fsdp *f) { return f->p->m->cfg.tie_word_embeddings; }

static void before_backward(void *ctx, int u)
{
    struct fsdp *f = ctx;
    struct fsdp_wbuf *b = weights_of(f, u);
    b->users++;
    struct fsdp_gbuf *gb = NULL;
    for (int k = 0; k < FSDP_GRAD_BUFS && !gb; k++)
        if (f->gbuf[k].unit < 0 && (k == 0 || p_tied(f))) gb = &f->gbuf[k];
    MT_CHECK(gb, "fsdp: no free gradient buffer for unit %d", u);
    gb->unit = u;
    for (int g = 0; g < TG_COUNT; g++)
        if (f->dyn_g[g])
            be_of(f)->zero(gb->g[g], (size_t)f->p->g[g].u_work[u] * sizeof(float));
    bind_weights(f, u, b, gb);
}

static void after_backward(void *ctx, int u)
{
    struct fsdp *f = ctx;
    struct fsdp_gbuf *gb = NULL;
    for (int k = 0; k < FSDP_GRAD_BUFS && !gb; k++)
        if (f->gbuf[k].unit == u) gb = &f->gbuf[k];
    MT_CHECK(gb, "fsdp: unit %d has no gradient buffer", u);
    for (int g = 0; g < TG_COUNT; g++)
        if (f->dyn_g[g]) params_reduce_unit(f->p, (enum tensor_group)g, u, gb->g[g], f->stage);
    gb->unit = -1;
    holding(f, u)->users--;
}

void fsdp_init(struct fsdp *f, struct params *p, bool reshard)
{
    memset(f, 0, sizeof *f);
    f->p = p;
    f->reshard = reshard;
    const struct backend *be = p->m->be;
    params_bind_aliased(p);
    for (int g = 0; g < TG_COUNT; g++) {
        f->dyn_w[g] = !params_static_weights(p, (enum tensor_group)g);
        f->dyn_g[g] = !p->g[g].aliased;
    }
    for (int k = 0; k < FSDP_GRAD_BUFS; k++) f->gbuf[k].unit = -1;
    if (!any_dynamic(f)) return;
    f->n_bufs = reshard ? 2 : p->n_units;
    f->wbuf = mt_calloc((size_t)f->n_bufs, sizeof *f->wbuf);
    /* a tied head binds the embedding's gradients beside the final norm's */
    const int n_gbufs = p->m->cfg.tie_word_embeddings ? 2 : 1;
    const enum mem_cat was = mem_track_set(MEM_WEIGHTS);
    for (int g = 0; g < TG_COUNT; g++) {
        int64_t work, piece;
        params_unit_max(p, (enum tensor_group)g, &work, &piece);
        if (f->dyn_w[g]) {
            mem_track_set(MEM_WEIGHTS);
            for (int k = 0; k < f->n_bufs; k++) {
                /* without resharding buffer k is unit k's; with it, one buffer for the largest
                 * unit and one for the largest layer */
                int64_t n = !reshard ? p->g[g].u_work[k] : k == 0 ? work : params_layer_unit_max(p, (enum tensor_group)g);
                f->wbuf[k].cap[g] = n;
                f->wbuf[k].w[g] = be->alloc((size_t)MT_MAX(n, 1) * be->x_size);
            }
        }
        if (f->dyn_g[g]) {
            mem_track_set(MEM_GRADS);
            for (int k = 0; k < n_gbufs; k++) f->gbuf[k].g[g] = be->alloc((size_t)MT_MAX(work, 1) * sizeof(float));
        }
        if (g == TG_EXPERT && p->g[g].group_size > 1 && (f->dyn_w[g] || f->dyn_g[g])) {
            mem_track_set(MEM_BUFFERS);
            f->stage = be->alloc((size_t)MT_MAX(piece * p->g[g].group_size, 1) * sizeof(float));
        }
    }
    mem_track_set(was);
    for (int k = 0; k < f->n_bufs; k++) f->wbuf[k].unit = -1;
    struct model_unit_hooks h = {f, before_forward, after_forward, before_backward, after_backward};
    model_set_hooks(p->m, &h);
}

void fsdp_invalidate(struct fsdp *f)
{
    for (int k = 0; k < f->n_bufs; k++) {
        MT_CHECK(f->wbuf[k].users == 0, "fsdp: unit %d still in use at the optimizer step", f->wbuf[k].unit);
        f->wbuf[k].unit = -1;
    }
}

void fsdp_free(struct fsdp *f)
{
    if (!f->p) return;
    const struct backend *be = be_of(f);
    model_set_hooks(f->p->m, NULL);
    for (int g = 0; g < TG_COUNT; g++) {
        for (int k = 0; k < f->n_bufs; k++)
            if (f->wbuf[k].w[g]) be->free(f->wbuf[k].w[g]);
        for (int k = 0; k < FSDP_GRAD_BUFS; k++)
            if (f->gbuf[k].g[g]) be->free(f->gbuf[k].g[g]);
    }
    if (f->stage) be->free(f->stage);
    free(f->wbuf);
    memset(f, 0, sizeof *f);
}
