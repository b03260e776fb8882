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

/* The buffer holding unit u's weights, gathering them into the least recently used free buffer
 * when none does. Without resharding every unit has a buffer of its own. */
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
            else if (b->users == 0 && (!victim || b->unit < 0 || (victim->unit >= 0 && b->last_use < victim->last_use)))
                victim = b;
        }
    }
    if (!hit) {
        MT_CHECK(victim, "fsdp: every working buffer is in use (unit %d)", u);
        for (int g = 0; g < TG_COUNT; g++)
            if (f->dyn_w[g])
                params_gather_unit(f->p, (enum tensor_group)g, u, victim->w[g], f->stage_x[g], f->send_x[g]);
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
        if (f->dyn_g[g])
            params_reduce_unit(f->p, (enum tensor_group)g, u, gb->g[g], f->stage_f[g], f->out_f[g]);
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
        const int gs = p->g[g].group_size;
        if (f->dyn_w[g]) {
            mem_track_set(MEM_WEIGHTS);
            for (int k = 0; k < f->n_bufs; k++) {
                /* without resharding buffer k is unit k's, sized for it */
                int64_t n = reshard ? work : p->g[g].u_work[k];
                f->wbuf[k].w[g] = be->alloc((size_t)MT_MAX(n, 1) * be->x_size);
            }
            mem_track_set(MEM_BUFFERS);
            if (g == TG_EXPERT && gs > 1) f->stage_x[g] = be->alloc((size_t)MT_MAX(piece * gs, 1) * be->x_size);
            if (!p->g[g].param_x && gs > 1) f->send_x[g] = be->alloc((size_t)MT_MAX(piece, 1) * be->x_size);
        }
        if (f->dyn_g[g]) {
            mem_track_set(MEM_GRADS);
            for (int k = 0; k < n_gbufs; k++) f->gbuf[k].g[g] = be->alloc((size_t)MT_MAX(work, 1) * sizeof(float));
            mem_track_set(MEM_BUFFERS);
            if (g == TG_EXPERT) f->stage_f[g] = be->alloc((size_t)MT_MAX(piece * gs, 1) * sizeof(float));
            f->out_f[g] = be->alloc((size_t)MT_MAX(piece, 1) * sizeof(float));
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
        void *bufs[] = {f->stage_x[g], f->send_x[g], f->stage_f[g], f->out_f[g]};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
            if (bufs[i]) be->free(bufs[i]);
    }
    free(f->wbuf);
    memset(f, 0, sizeof *f);
}
