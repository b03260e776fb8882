#include "expert_watch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void expert_watch_init(struct expert_watch *w, const struct model_config *mc, const struct log_config *lc)
{
    memset(w, 0, sizeof *w);
    w->E = mc->num_experts;
    for (int l = 0; l < mc->num_hidden_layers && w->E > 0; l++)
        if (config_layer_is_moe(mc, l)) w->layer_id[w->n_moe++] = l;
    w->collapse_steps = lc->collapse_steps;
    w->load_warn = lc->load_warn;
    w->zero_streak = mt_calloc((size_t)MT_MAX(w->n_moe * w->E, 1), sizeof(int));
    w->over = mt_calloc((size_t)MT_MAX(w->n_moe, 1), sizeof(bool));
}

void expert_watch_free(struct expert_watch *w)
{
    free(w->zero_streak);
    free(w->over);
    memset(w, 0, sizeof *w);
}

double expert_watch_rank_load_max(const double *tok, int E, int ep)
{
    const int per = E / ep;
    double total = 0, busiest = 0;
    for (int r = 0; r < ep; r++) {
        double sum = 0;
        for (int e = r * per; e < (r + 1) * per; e++) sum += tok[e];
        total += sum;
        busiest = sum > busiest ? sum : busiest;
    }
    return total > 0 ? busiest / (total / ep) : 1.0;
}

const char *expert_watch_step(struct expert_watch *w, const double *tok)
{
    const int E = w->E;
    int n_dead = 0, dead_k = -1, dead_e = -1, n_over = 0, over_k = -1;
    double over_ratio = 0;
    for (int k = 0; k < w->n_moe; k++) {
        const double *c = tok + (size_t)k * E;
        double sum = 0, mx = 0;
        for (int e = 0; e < E; e++) {
            sum += c[e];
            mx = c[e] > mx ? c[e] : mx;
            int *z = &w->zero_streak[(size_t)k * E + e];
            *z = c[e] > 0 ? 0 : *z + 1;
            if (w->collapse_steps > 0 && *z > 0 && *z % w->collapse_steps == 0) {
                if (n_dead++ == 0) dead_k = k, dead_e = e;
            }
        }
        const double ratio = sum > 0 ? mx / (sum / E) : 0;
        const bool over = w->load_warn > 0 && ratio > w->load_warn;
        if (over && !w->over[k] && n_over++ == 0) over_k = k, over_ratio = ratio;
        w->over[k] = over;
    }
    w->line[0] = 0;
    size_t at = 0;
    if (n_dead)
        at += (size_t)snprintf(w->line, sizeof w->line, "layer %d expert %d got no tokens for %d steps",
                               w->layer_id[dead_k], dead_e, w->zero_streak[(size_t)dead_k * E + dead_e]);
    if (n_dead > 1 && at < sizeof w->line)
        at += (size_t)snprintf(w->line + at, sizeof w->line - at, " (and %d more experts)", n_dead - 1);
    if (n_over && at < sizeof w->line)
        at += (size_t)snprintf(w->line + at, sizeof w->line - at, "%slayer %d max/mean load %.2f > %g%s",
                               at ? "; " : "", w->layer_id[over_k], over_ratio, w->load_warn,
                               n_over > 1 ? " (and more layers)" : "");
    return w->line;
}
