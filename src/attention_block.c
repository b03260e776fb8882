/* The attention half of a decoder layer: pre-norm, q/k/v projections, per-head q_norm/k_norm,
 * RoPE, causal GQA attention (within documents when m->seg is set), o_proj and the residual add. */
#include "layer.h"
#include "model.h"


void attention_forward(struct model *m, int l)
{
    const struct backend *be = m->be;
    struct layer_acts *a = model_acts(m, l);
    const int T = m->T, H = m->H, D = m->D, Hq = m->Hq, Hkv = m->Hkv;
    const float eps = (float)m->cfg.rms_norm_eps, theta = (float)m->cfg.rope_theta;

    be->rmsnorm_forward(a->a, a->rstd_a, a->h_in, weight_of(m, TR_ATTN_NORM, l), T, H, eps);
    be->matmul_forward(a->q_pre, a->a, weight_of(m, TR_Q, l), T, H, Hq * D);
    be->matmul2_forward(a->k_pre, a->v, a->a, weight_of(m, TR_K, l), weight_of(m, TR_V, l), T, H, Hkv * D);
    be->rmsnorm_rope_forward(a->q, a->rstd_q, a->q_pre, weight_of(m, TR_QNORM, l), m->pos, T, Hq, D, eps,
                             theta);
    be->rmsnorm_rope_forward(a->k, a->rstd_k, a->k_pre, weight_of(m, TR_KNORM, l), m->pos, T, Hkv, D, eps,
                             theta);
    be->attention_forward(a->attn, a->lse, a->q, a->k, a->v, m->B, m->S, Hq, Hkv, D, m->seg);
    be->matmul_forward_residual(a->h_mid, a->attn, weight_of(m, TR_O, l), a->h_in, T, Hq * D, H);
}

void attention_backward(struct model *m, int l)
{
    const struct backend *be = m->be;
    struct layer_acts *a = model_acts(m, l);
    const int T = m->T, H = m->H, D = m->D, Hq = m->Hq, Hkv = m->Hkv;
    const float theta = (float)m->cfg.rope_theta;

    /* d_t1 = dL/d attn. The o_proj and q_proj weight gradients now, or (model_enable_deferred_wgrads)
     * from their output gradients, kept aside, once the next MoE layer's exchanges are under way */
    model_run_deferred_wgrads(m, -1);
    float *dw_o = grad_of(m, TR_O, l), *dw_q = grad_of(m, TR_Q, l);
    const bool defer = m->o_wgrad_dout && m->more_backwards && dw_o && dw_q;
    /* the deferred gradient keeps dL/d h_mid, which the norm's backward below adds to in place:
     * a copy engine copies it while the SMs run the attention's backward (joined before the add;
     * the deferred gradients above, readers of the copy's destination, are queued already) */
    if (defer) be->copy_aside(m->o_wgrad_dout, m->d_h, (size_t)T * H * be->x_size);
    be->matmul_backward(m->d_t1, defer ? NULL : dw_o, m->d_h, a->attn, weight_of(m, TR_O, l), T, Hq * D, H, false);
    if (defer) model_defer_wgrad(m, &(struct deferred_wgrad){dw_o, m->o_wgrad_dout, a->attn, T, Hq * D, H});
    /* the logits (and the gradient the head wrote over them) are dead until the next forward */
    void *work = m->st.last ? m->logits : NULL;
    const size_t work_bytes = work ? (size_t)T * m->V * be->x_size : 0;
    be->attention_backward(m->d_q, m->d_k, m->d_v, m->d_t1, a->q, a->k, a->v, a->attn, a->lse,
                           m->B, m->S, Hq, Hkv, D, m->seg, work, work_bytes);
    /* dL/d q_pre (into the deferred gradient's own buffer when deferring, d_t2 otherwise), then
     * d_t3 = dL/d a accumulated over q, k, v */
    void *d_qpre = defer ? m->q_wgrad_dout : m->d_t2;
    be->rmsnorm_rope_backward(d_qpre, grad_of(m, TR_QNORM, l), m->d_q, a->q_pre, weight_of(m, TR_QNORM, l),
                              a->rstd_q, m->pos, T, Hq, D, theta);
    be->matmul_backward(m->d_t3, defer ? NULL : dw_q, d_qpre, a->a, weight_of(m, TR_Q, l), T, H, Hq * D, false);
    if (defer) model_defer_wgrad(m, &(struct deferred_wgrad){dw_q, d_qpre, a->a, T, H, Hq * D});
    be->rmsnorm_rope_backward(m->d_t2, grad_of(m, TR_KNORM, l), m->d_k, a->k_pre, weight_of(m, TR_KNORM, l),
                              a->rstd_k, m->pos, T, Hkv, D, theta);
    be->matmul2_backward(m->d_t3, grad_of(m, TR_K, l), grad_of(m, TR_V, l), m->d_t2, m->d_v, a->a,
                         weight_of(m, TR_K, l), weight_of(m, TR_V, l), T, H, Hkv * D, true);
    /* residual: dL/dh_in = dL/dh_mid + norm backward */
    if (defer) be->copy_aside_join();
    be->rmsnorm_backward(m->d_h, grad_of(m, TR_ATTN_NORM, l), m->d_t3, a->h_in, weight_of(m, TR_ATTN_NORM, l),
                         a->rstd_a, T, H, true);
}
