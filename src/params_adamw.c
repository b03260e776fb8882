/* The optimizer step on the shards: AdamW over every segment of both groups. By default one
 * adamw_update_multi call (one launch on the GPU) over the shard's segment list, built at the
 * first step and kept (the shard buffers and segments are fixed from params_init_opts to
 * params_free); adjacent segments with the same treatment are merged, which changes no bit since
 * the update is elementwise. MT_ADAMW_PER_TENSOR=1 takes the older path, one adamw_update (or
 * adamw_update_m16) call per segment, for benchmarking; both give the same bits. */
#include "params.h"

#include <stdlib.h>

#include "common.h"
#include "ops.h"

static void *xat(const struct backend *be, void *p, int64_t i) { return (char *)p + (size_t)i * be->x_size; }

static void build_segments(struct params *p, const struct train_config *t)
{
    const struct backend *be = p->m->be;
    int cap = 0;
    for (int k = 0; k < TG_COUNT; k++) cap += p->g[k].n_seg;
    free(p->opt_seg);
    p->opt_seg = mt_malloc((size_t)MT_MAX(cap, 1) * sizeof *p->opt_seg);
    p->n_opt_seg = 0;
    for (int k = 0; k < TG_COUNT; k++) {
        struct param_group_shard *g = &p->g[k];
        int64_t end = -1; /* end of the previous kept segment of this group */
        for (int j = 0; j < g->n_seg; j++) {
            const struct param_segment *s = &g->seg[j];
            if (s->frozen) continue;
            const float wd = s->decay ? (float)t->weight_decay : 0.0f;
            struct adamw_segment *last = p->n_opt_seg ? &p->opt_seg[p->n_opt_seg - 1] : NULL;
            if (last && s->off == end && last->weight_decay == wd) {
                last->n += (size_t)s->len;
            } else {
                /* without a compute copy the update writes the master alone */
                p->opt_seg[p->n_opt_seg++] = (struct adamw_segment){
                    .master = g->master ? g->master + s->off : NULL,
                    .master_lo = g->master_lo ? g->master_lo + s->off : NULL,
                    .param = g->param_x ? xat(be, g->param_x, s->off) : NULL,
                    .grad = g->grad + s->off,
                    .m = (char *)g->m1 + (size_t)s->off * p->mom_bytes,
                    .v = (char *)g->m2 + (size_t)s->off * p->mom_bytes,
                    .n = (size_t)s->len,
                    .weight_decay = wd,
                };
            }
            end = s->off + s->len;
        }
    }
    p->opt_seg_wd = t->weight_decay;
    p->opt_seg_built = true;
}

static void step_per_segment(struct params *p, const struct train_config *t, float lr, float grad_scale)
{
    const struct backend *be = p->m->be;
    for (int k = 0; k < TG_COUNT; k++) {
        struct param_group_shard *g = &p->g[k];
        for (int j = 0; j < g->n_seg; j++) {
            const struct param_segment *s = &g->seg[j];
            if (s->frozen) continue;
            /* without a compute copy the update writes the master alone (param = master: the
             * cast to fp32 is the identity) */
            void *param = g->param_x ? xat(be, g->param_x, s->off) : NULL;
            void *m1 = (char *)g->m1 + (size_t)s->off * p->mom_bytes, *m2 = (char *)g->m2 + (size_t)s->off * p->mom_bytes;
            const float wd = s->decay ? (float)t->weight_decay : 0.0f;
            if (p->mom_bytes == 2)
                be->adamw_update_m16(g->master + s->off, param, g->grad + s->off, m1, m2, (size_t)s->len, lr,
                                     (float)t->beta1, (float)t->beta2, (float)t->adam_eps, wd, p->step, grad_scale);
            else
                be->adamw_update(g->master + s->off, param, g->grad + s->off, m1, m2, (size_t)s->len, lr,
                                 (float)t->beta1, (float)t->beta2, (float)t->adam_eps, wd, p->step, grad_scale);
        }
    }
}

void params_adamw_step(struct params *p, const struct train_config *t, float lr, float grad_scale)
{
    p->step++;
    if (p->adamw_per_tensor && !p->split_master) { /* the per-segment ops take an fp32 master */
        step_per_segment(p, t, lr, grad_scale);
        return;
    }
    if (!p->opt_seg_built || p->opt_seg_wd != t->weight_decay) build_segments(p, t);
    p->m->be->adamw_update_multi(p->opt_seg, p->n_opt_seg, p->mom_bytes, lr, (float)t->beta1,
                                 (float)t->beta2, (float)t->adam_eps, p->step, grad_scale);
}
