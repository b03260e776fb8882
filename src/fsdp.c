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

/* The free buffer unit u's weights go to: the smallest that fits, the least recently used among
 * equals; without resharding unit u's own. NULL when none is free. */
static struct fsdp_wbuf *victim_for(struct fsdp *f, int u)
{
    if (!f->reshard) return f->wbuf[u].users == 0 ? &f->wbuf[u] : NULL;
    struct fsdp_wbuf *victim = NULL;
    for (int k = 0; k < f->n_bufs; k++) {
        struct fsdp_wbuf *b = &f->wbuf[k];
        if (b->users == 0 && fits(f, b, u) &&
            (!victim || size_of(b) < size_of(victim) ||
             (size_of(b) == size_of(victim) && b->last_use < victim->last_use)))
            victim = b;
    }
    return victim;
}

static struct fsdp_wbuf *held(struct fsdp *f, int u)
{
    for (int k = 0; k < f->n_bufs; k++)
        if (f->wbuf[k].unit == u) return &f->wbuf[k];
    return NULL;
}

/* Every hook first finishes the prefetch in flight: its buffers (the working weights and the
 * expert staging) are then free for whatever this hook does. */
static void finish_prefetch(struct fsdp *f)
{
    struct fsdp_wbuf *b = f->pending.buf;
    if (!b) return;
    for (int g = 0; g < TG_COUNT; g++)
        if (f->dyn_w[g]) params_gather_unit_finish(f->p, (enum tensor_group)g, b->unit, b->w[g], f->stage, &f->pending.req[g]);
    f->pending.buf = NULL;
}

static bool p_tied(const struct fsdp *f) { return f->p->m->cfg.tie_word_embeddings; }

/* Starts gathering unit u (when it is one of the stage's, not held already, and a buffer is free). */
static void start_prefetch(struct fsdp *f, int u)
{
    if (!f->prefetch || u < 0 || u >= f->p->n_units || held(f, u)) return;
    /* a tied head holds its unit and the embedding's at once: prefetched into the large buffer, the
     * head would leave the embedding no room, so both go where on-demand placement puts them */
    if (p_tied(f) && (u == 0 || u == f->p->n_units - 1)) return;
    bool any = false;
    for (int g = 0; g < TG_COUNT; g++) any |= unit_work(f, g, u) > 0;
    struct fsdp_wbuf *b = any ? victim_for(f, u) : NULL;
    if (!b) return;
    for (int g = 0; g < TG_COUNT; g++)
        if (f->dyn_w[g]) params_gather_unit_start(f->p, (enum tensor_group)g, u, b->w[g], f->stage, &f->pending.req[g]);
    b->unit = u;
    b->prefetched = true;
    b->last_use = ++f->clock;
    f->pending.buf = b;
    f->n_gathers++;
}

/* The buffer holding unit u's weights, gathering them into a free buffer when none does. */
static struct fsdp_wbuf *weights_of(struct fsdp *f, int u)
{
    struct fsdp_wbuf *hit = held(f, u);
    if (!hit) {
        hit = victim_for(f, u);
        MT_CHECK(hit, "fsdp: no free working buffer holds unit %d", u);
        for (int g = 0; g < TG_COUNT; g++)
            if (f->dyn_w[g]) params_gather_unit(f->p, (enum tensor_group)g, u, hit->w[g], f->stage);
        hit->unit = u;
        hit->prefetched = false;
        f->n_gathers++;
    } else if (hit->prefetched) {
        hit->prefetched = false;
        f->n_prefetched++;
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
    finish_prefetch(f);
    struct fsdp_wbuf *b = weights_of(f, u);
    b->users++;
    bind_weights(f, u, b, NULL);
    start_prefetch(f, u + 1);
}

static struct fsdp_wbuf *holding(struct fsdp *f, int u)
{
    struct fsdp_wbuf *b = held(f, u);
    if (!b) mt_fatal("fsdp: unit %d released but not held", u);
    return b;
}

static void after_forward(void *ctx, int u)
{
    struct fsdp *f = ctx;
    finish_prefetch(f);
    struct fsdp_wbuf *b = holding(f, u);
    b->users--;
}

static void before_backward(void *ctx, int u)
{
    struct fsdp *f = ctx;
    finish_prefetch(f);
    struct fsdp_wbuf *b = weights_of(f, u);
    b->users++;
    struct fsdp_gbuf *gb = NULL;
    for (int k = 0; k < FSDP_GRAD_BUFS && !gb; k++)
        if (f->gbuf[k].unit < 0 && (k == 0 || p_tied(f))) gb = &f->gbuf[k];
    MT_CHECK(gb, "fsdp: no free gradient buffer for unit %d", u);
    gb->unit = u;
    for (int g = 0; g < TG_COUNT; g++) {
        if (!f->dyn_g[g]) continue;
        const int64_t n = f->p->g[g].u_work[u];
        if (g == TG_EXPERT && model_skip_expert_grad_zeroing(f->p->m, u, n)) continue; /* overwritten */
        be_of(f)->zero(gb->g[g], (size_t)n * sizeof(float));
    }
    bind_weights(f, u, b, gb);
    start_prefetch(f, u - 1);
}

static void after_backward(void *ctx, int u)
{
    struct fsdp *f = ctx;
    finish_prefetch(f);   /* before the reduce-scatter reuses the expert staging */
    struct fsdp_gbuf *gb = NULL;
    for (int k = 0; k < FSDP_GRAD_BUFS && !gb; k++)
        if (f->gbuf[k].unit == u) gb = &f->gbuf[k];
    MT_CHECK(gb, "fsdp: unit %d has no gradient buffer", u);
    for (int g = 0; g < TG_COUNT; g++)
        if (f->dyn_g[g]) params_reduce_unit(f->p, (enum tensor_group)g, u, gb->g[g], f->stage);
    gb->unit = -1;
    holding(f, u)->users--;
}

void fsdp_init(struct fsdp *f, struct params *p, bool reshard, bool prefetch)
{
    memset(f, 0, sizeof *f);
    f->p = p;
    f->reshard = reshard;
    f->prefetch = prefetch;
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
    finish_prefetch(f);
    for (int k = 0; k < f->n_bufs; k++) {
        MT_CHECK(f->wbuf[k].users == 0, "fsdp: unit %d still in use at the optimizer step", f->wbuf[k].unit);
        f->wbuf[k].unit = -1;
        f->wbuf[k].prefetched = false;
    }
}

void fsdp_free(struct fsdp *f)
{
    if (!f->p) return;
    const struct backend *be = be_of(f);
    finish_prefetch(f);
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
