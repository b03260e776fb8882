#include "router_opts.h"

#include <ctype.h>
#include <stdio.h>
#include <string.h>

struct router_opts router_opts_of(const struct model_config *mc)
{
    struct router_opts o = {
        .sigmoid = mc->scoring == MT_SCORE_SIGMOID,
        .norm_topk = mc->norm_topk_prob,
        .route_scale = (float)mc->route_scale,
        .n_group = mc->n_group,
        .topk_group = mc->topk_group > 0 ? mc->topk_group : mc->n_group,
        .force_balance = mc->debug_force_balance,
    };
    return o;
}

bool router_opts_check(const struct model_config *mc, char *err, size_t cap)
{
    const int E = mc->num_experts, G = mc->n_group;
    if (E == 0) return true;
    /* the CUDA router keeps the chosen groups in one 64-bit mask */
    if (G > 64 || E % G != 0) {
        snprintf(err, cap, "model.n_group (%d) must divide model.num_experts (%d) and be <= 64", G, E);
        return false;
    }
    if (mc->topk_group > G) {
        snprintf(err, cap, "model.topk_group (%d) must be <= model.n_group (%d)", mc->topk_group, G);
        return false;
    }
    const int tg = mc->topk_group > 0 ? mc->topk_group : G;
    if (mc->num_experts_per_tok > tg * (E / G)) {
        snprintf(err, cap, "model.num_experts_per_tok (%d) must be <= the experts of model.topk_group "
                 "(%d) groups of %d", mc->num_experts_per_tok, tg, E / G);
        return false;
    }
    return true;
}

static const char *const module_names[ND_COUNT] = { "gate", "norm", "embed", "lm_head", "attn",
                                                    "experts", "mlp" };

bool no_decay_parse(const char *text, unsigned *mask, char *err, size_t cap)
{
    *mask = 0;
    const char *p = text, *end = text + strlen(text);
    while (p < end && isspace((unsigned char)*p)) p++;
    while (end > p && isspace((unsigned char)end[-1])) end--;
    if (p < end && (*p == '[' || end[-1] == ']')) {
        if (end - p < 2 || *p != '[' || end[-1] != ']') {
            snprintf(err, cap, "train.no_decay_modules expects a list like [gate, norm], got '%s'", text);
            return false;
        }
        p++;
        end--;
    }
    bool blank = true;
    for (const char *q = p; q < end; q++) blank = blank && isspace((unsigned char)*q);
    if (blank) return true; /* [] */
    for (;;) {
        const char *comma = memchr(p, ',', (size_t)(end - p));
        const char *s = p, *t = comma ? comma : end;
        while (s < t && isspace((unsigned char)*s)) s++;
        while (t > s && isspace((unsigned char)t[-1])) t--;
        int found = -1;
        for (int i = 0; i < ND_COUNT; i++)
            if ((size_t)(t - s) == strlen(module_names[i]) && !strncmp(s, module_names[i], (size_t)(t - s)))
                found = i;
        if (found < 0 || (*mask >> found & 1u)) {
            snprintf(err, cap, "train.no_decay_modules: %s module '%.*s' (known: gate, norm, embed, "
                     "lm_head, attn, experts, mlp)", found < 0 ? "unknown" : "repeated",
                     (int)(t - s), s);
            return false;
        }
        *mask |= 1u << found;
        if (!comma) return true;
        p = comma + 1;
    }
}

static enum no_decay_module module_of(const struct tensor_spec *s)
{
    switch (s->role) {
    case TR_ROUTER: return ND_GATE;
    case TR_EMBED: return ND_EMBED;
    case TR_LM_HEAD: return ND_LM_HEAD;
    case TR_Q: case TR_K: case TR_V: case TR_O: return ND_ATTN;
    case TR_EXP_GATE_UP: case TR_EXP_DOWN: return ND_EXPERTS;
    case TR_MLP_GATE_UP: case TR_MLP_DOWN: return ND_MLP;
    default: return ND_NORM; /* the five RMSNorm roles */
    }
}

void no_decay_apply(struct tensor_table *tt, const char *list)
{
    unsigned mask;
    char err[256];
    /* config validation parsed it already: a failure here is broken state */
    MT_CHECK(no_decay_parse(list, &mask, err, sizeof err), "%s", err);
    if (mask == 0) return;
    for (int i = 0; i < tt->n; i++) tt->t[i].decay = !(mask >> module_of(&tt->t[i]) & 1u);
}

void no_decay_describe(const struct tensor_table *tt, char *buf, size_t cap)
{
    unsigned seen = 0;
    int n = 0;
    for (int i = 0; i < tt->n; i++)
        if (!tt->t[i].decay) {
            seen |= 1u << module_of(&tt->t[i]);
            n++;
        }
    size_t at = 0;
    buf[0] = 0;
    for (int m = 0; m < ND_COUNT && at < cap; m++)
        if (seen >> m & 1u) at += (size_t)snprintf(buf + at, cap - at, "%s%s", at ? ", " : "", module_names[m]);
    if (at < cap) snprintf(buf + at, cap - at, "%s(%d tensors)", n ? " " : "nothing ", n);
}
