/* The MoE layer's dispatch and combine of rows between the token side and the expert side
 * (moe_dispatch.c has the layout), for moe.c's one-exchange path; parallel.moe_chunks > 1 is
 * moe_exchange.c. */
#ifndef MT_MOE_DISPATCH_H
#define MT_MOE_DISPATCH_H

#include <stdbool.h>
#include <stdint.h>

#include "comm.h"
#include "model.h"

/* The fixed exchange's token rows on every EP rank (an all-gather into the inbox), started where
 * the rows exist: moe_forward starts it before the router, so that the rows cross while the router
 * and the route plan run. */
struct token_rows {
    const void *rows; /* the inbox: rank s's T rows at s·T, once req is waited for */
    struct comm_p2p_req req;
};

/* Builds the dispatch plan of layer l from the router's top-k (a->route) */
void moe_route_layer(struct model *m, struct layer_acts *a, int l);
/* the fixed exchange's token rows cross as an all-gather (started early: moe_token_rows_start) */
bool moe_rows_by_token(const struct model *m);
void moe_token_rows_start(struct model *m, const void *x, struct token_rows *tr);
/* token side -> expert side: a->x_exp */
void moe_dispatch_rows(struct model *m, struct layer_acts *a, struct token_rows *early);
/* expert side -> token side: out (+ resid) from a->y_exp */
void moe_combine_rows(struct model *m, struct layer_acts *a, void *out, const void *resid);
/* the down projection of a->act and moe_combine_rows, the other ranks' rows first */
void moe_down_and_combine_self_last(struct model *m, struct layer_acts *a, int l, void *out, const void *resid);
/* backward of moe_combine_rows, its routing-weight gradients finished by moe_combine_weights_home */
const float *moe_combine_rows_backward(struct model *m, struct layer_acts *a, int finish, struct comm_p2p_req *w_req);
void moe_combine_weights_home(struct model *m, struct layer_acts *a, const float *d_w, struct comm_p2p_req *w_req);
/* backward of moe_dispatch_rows in two halves: the pair rows leave, then the token side sums them */
const void *moe_dispatch_rows_backward_send(struct model *m, struct layer_acts *a, struct comm_p2p_req *req);
void moe_dispatch_rows_backward_sum(struct model *m, struct layer_acts *a, const void *d_pairs,
                                    struct comm_p2p_req *req);

#endif
