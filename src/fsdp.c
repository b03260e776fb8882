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

/* gb[g]: unit u's working gradient of group g (NULL: leave the binding) */
static void bind_weights(struct fsdp *f, int u, struct fsdp_wbuf *b, struct fsdp_gbuf *const *gb)
{
    for (int g = 0; g < TG_COUNT; g++)
        params_bind_unit(f->p, (enum tensor_group)g, u, f->dyn_w[g] ? b->w[g] : NULL,
                         gb && gb[g] ? gb[g]->g : NULL);
}

static void finish_reduce(struct fsdp *f, int g, struct fsdp_gbuf *gb)
{
    params_reduce_unit_finish(f->p, (enum tensor_group)g, gb->unit, gb->g, f->stage, &gb->req, gb->into_shard);
    gb->reducing = false;
    gb->unit = -1;
}

/* A free gradient buffer of group g for unit u: the smallest that fits, finishing the oldest
 * reduction in flight when none is free. */
static struct fsdp_gbuf *grad_buf_for(struct fsdp *f, int g, int u)
{
    const int64_t need = f->p->g[g].u_work[u];
    for (;;) {
        struct fsdp_gbuf *best = NULL, *oldest = NULL;
        for (int k = 0; k < f->n_gbufs[g]; k++) {
            struct fsdp_gbuf *b = &f->gbuf[g][k];
            if (b->reducing && (!oldest || b->started < oldest->started)) oldest = b;
            if (b->unit < 0 && b->cap >= need && (!best || b->cap < best->cap)) best = b;
        }
        if (best) return best;
        MT_CHECK(oldest, "fsdp: no free gradient buffer for unit %d", u);
        finish_reduce(f, g, oldest);
    }
}

bool fsdp_group_reduces(const struct fsdp *f, enum tensor_group g) { return f->dyn_g[g]; }

void fsdp_flush(struct fsdp *f)
{
    finish_prefetch(f);   /* the experts' reduction below uses the staging */
    /* reduce_grads=step: every unit bound this step reduces now, the dense ones all in flight at
     * once (each into its own buffer), the experts' one at a time through the staging */
    for (int g = 0; g < TG_COUNT; g++) {
        if (!f->unit_g[g]) continue;
        for (int u = 0; u < f->p->n_units; u++) {
            struct fsdp_gbuf *gb = &f->unit_g[g][u];
            if (gb->unit < 0 || gb->reducing) continue;   /* reducing: started by the last backward */
            gb->into_shard = true; /* the unit's one reduction of the step */
            params_reduce_unit_start(f->p, (enum tensor_group)g, u, gb->g, f->stage, &gb->req, true);
            gb->reducing = true;
            gb->started = ++f->clock;
            f->n_reduces++;
            if (g == TG_EXPERT) finish_reduce(f, g, gb);
        }
    }
    /* then in the order started, so that each shard element adds its sums in a fixed order */
    for (;;) {
        struct fsdp_gbuf *oldest = NULL;
        int og = 0;
        for (int g = 0; g < TG_COUNT; g++) {
            const int n = f->unit_g[g] ? f->p->n_units : f->n_gbufs[g];
            for (int k = 0; k < n; k++) {
                struct fsdp_gbuf *b = f->unit_g[g] ? &f->unit_g[g][k] : &f->gbuf[g][k];
                if (b->reducing && (!oldest || b->started < oldest->started)) {
                    oldest = b;
                    og = g;
                }
            }
        }
        if (!oldest) return;
        finish_reduce(f, og, oldest);
    }
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
    struct fsdp_gbuf *gb[TG_COUNT] = {NULL};
    for (int g = 0; g < TG_COUNT; g++) {
        if (!f->dyn_g[g]) continue;
        if (f->unit_g[g]) {   /* reduce_grads=step: the unit's own buffer, zeroed at its first use */
            gb[g] = &f->unit_g[g][u];
            if (gb[g]->unit == u) continue;
        } else {
            gb[g] = grad_buf_for(f, g, u);
        }
        gb[g]->unit = u;
        const int64_t n = f->p->g[g].u_work[u];
        if (g == TG_EXPERT && model_skip_expert_grad_zeroing(f->p->m, u, n)) continue; /* overwritten */
        be_of(f)->zero(gb[g]->g, (size_t)n * sizeof(float));
    }
    bind_weights(f, u, b, gb);
    start_prefetch(f, u - 1);
}

/* reduce_grads=step: unit u's dense gradient is final once the step's last backward has passed
 * it, so its reduce-scatter can run behind the units before it (prefetch's side stream) instead of
 * in fsdp_flush. Not with a tied head: the head and the embedding add into the same shard elements,
 * and fsdp_flush's order keeps their sum the bits it was. */
static bool reduce_now_per_step(const struct fsdp *f, int g, int u)
{
    return g == TG_DENSE && f->prefetch && !f->p->m->more_backwards && !p_tied(f) &&
           f->unit_g[g][u].unit == u && !f->unit_g[g][u].reducing;
}

static void after_backward(void *ctx, int u)
{
    struct fsdp *f = ctx;
    finish_prefetch(f);   /* before the reduce-scatter reuses the expert staging */
    for (int g = 0; g < TG_COUNT; g++) {
        if (!f->dyn_g[g]) continue;
        if (f->unit_g[g]) {   /* reduce_grads=step: fsdp_flush reduces, or now in the last backward */
            if (reduce_now_per_step(f, g, u)) {
                struct fsdp_gbuf *gb = &f->unit_g[g][u];
                gb->into_shard = true;
                params_reduce_unit_start(f->p, (enum tensor_group)g, u, gb->g, f->stage, &gb->req, true);
                gb->reducing = true;
                gb->started = ++f->clock;
                f->n_reduces++;
                f->n_reduces_overlapped++;
            }
            continue;
        }
        struct fsdp_gbuf *gb = NULL;
        for (int k = 0; k < f->n_gbufs[g] && !gb; k++)
            if (f->gbuf[g][k].unit == u && !f->gbuf[g][k].reducing) gb = &f->gbuf[g][k];
        MT_CHECK(gb, "fsdp: unit %d has no gradient buffer", u);
        gb->into_shard = false; /* one reduction a micro-step: each adds to the shard */
        params_reduce_unit_start(f->p, (enum tensor_group)g, u, gb->g, f->stage, &gb->req, false);
        gb->reducing = true;
        gb->started = ++f->clock;
        f->n_reduces++;
        if (g == TG_DENSE && f->overlap_reduce) f->n_reduces_overlapped++;
        else finish_reduce(f, g, gb);   /* the experts' staging is the gathers' too */
    }
    holding(f, u)->users--;
}

void fsdp_init(struct fsdp *f, struct params *p, bool reshard, bool prefetch, bool reduce_per_step)
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
    for (int g = 0; g < TG_COUNT; g++)
        for (int k = 0; k < FSDP_GRAD_BUFS; k++) f->gbuf[g][k].unit = -1;
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
        if (f->dyn_g[g] && reduce_per_step) {
            mem_track_set(MEM_GRADS);
            f->unit_g[g] = mt_calloc((size_t)p->n_units, sizeof *f->unit_g[g]);
            for (int u = 0; u < p->n_units; u++) {
                struct fsdp_gbuf *gb = &f->unit_g[g][u];
                gb->unit = -1;
                gb->cap = p->g[g].u_work[u];
                gb->g = be->alloc((size_t)MT_MAX(gb->cap, 1) * sizeof(float));
            }
        } else if (f->dyn_g[g]) {
            mem_track_set(MEM_GRADS);
            /* the dense group's extra buffer, for the largest layer: the reduction of one unit
             * runs while the next is computed into the other buffer (the head's and the
             * embedding's large units alternate with layers) */
            const bool extra = g == TG_DENSE && prefetch;
            f->overlap_reduce |= extra;
            f->n_gbufs[g] = n_gbufs + extra;
            for (int k = 0; k < f->n_gbufs[g]; k++) {
                struct fsdp_gbuf *gb = &f->gbuf[g][k];
                gb->cap = k < n_gbufs ? work : params_layer_unit_max(p, (enum tensor_group)g);
                gb->g = be->alloc((size_t)MT_MAX(gb->cap, 1) * sizeof(float));
            }
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

bool fsdp_dense_grads_persist(const struct fsdp *f)
{
    return !f->dyn_g[TG_DENSE] || f->unit_g[TG_DENSE] != NULL;
}

void fsdp_invalidate(struct fsdp *f)
{
    finish_prefetch(f);
    fsdp_flush(f);
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
    fsdp_flush(f);
    model_set_hooks(f->p->m, NULL);
    for (int g = 0; g < TG_COUNT; g++) {
        for (int k = 0; k < f->n_bufs; k++)
            if (f->wbuf[k].w[g]) be->free(f->wbuf[k].w[g]);
        for (int k = 0; k < FSDP_GRAD_BUFS; k++)
            if (f->gbuf[g][k].g) be->free(f->gbuf[g][k].g);
        for (int u = 0; f->unit_g[g] && u < f->p->n_units; u++) be->free(f->unit_g[g][u].g);
        free(f->unit_g[g]);
    }
    if (f->stage) be->free(f->stage);
    free(f->wbuf);
    memset(f, 0, sizeof *f);
}
