/* The synthetic corpus: a sparse random Markov chain over the vocabulary whose entropy rate is known,
 * so a training run can be judged against the best loss reachable (docs/data.md).
 *
 * Each state (the previous token) has `branching` distinct successors. Successor 0 follows one random
 * cycle through every token, which makes the chain irreducible whatever the other successors are; the
 * other branching-1 are uniform random tokens. Transition probabilities are normalised random weights
 * 0.05 + Exp(1) (a Dirichlet(1)-like spread, bounded away from 0 so no successor is unreachable). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "common.h"
#include "data_internal.h"

/* The tables are vocab*branching entries of 12 bytes; beyond this the start-up cost and memory on
 * every rank stop being small. */
#define SYNTH_MAX_TRANSITIONS (1LL << 24)
/* Power iteration stops once an iteration moves pi by less than this (L1), or after the cap. */
#define SYNTH_PI_TOL 1e-14
#define SYNTH_PI_MAX_ITERS 200000

struct synth_chain {
    int vocab, branching;
    uint64_t seed;
    int32_t *succ;      /* [vocab, branching] successor ids, distinct within a row */
    double *cdf;        /* [vocab, branching] cumulative transition probabilities, row ends at 1 */
    double *pi_cdf;     /* [vocab] cumulative stationary distribution, ends at 1 */
    double entropy_rate;
};

/* A 64-bit finaliser (splitmix64's) used to derive independent seeds from (seed, purpose, index). */
static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Distinct streams for the table and for each sequence, so the table draws never correlate with a
 * sequence's draws even for small q. */
#define SYNTH_TABLE_STREAM 0x7461626c65ULL      /* "table" */
#define SYNTH_SEQ_STREAM 0x73657173ULL          /* "seqs" */

static uint64_t stream_seed(uint64_t seed, uint64_t stream, uint64_t index)
{
    return mix64(mix64(seed ^ mix64(stream)) + 0x9e3779b97f4a7c15ULL * (index + 1));
}

static int rng_below(mt_rng *r, int n)
{
    return (int)(mt_rng_uniform(r) * n);   /* n << 2^53, bias negligible */
}

/* Smallest i in [0, n) with u < cdf[i]; cdf[n-1] == 1 > u guarantees one. */
static int cdf_search(const double *cdf, int n, double u)
{
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (u < cdf[mid]) hi = mid; else lo = mid + 1;
    }
    return lo;
}

/* Stationary distribution by power iteration on the lazy chain (P + I)/2: it has the same stationary
 * distribution as P and is aperiodic whatever P's cycle structure, so the iteration converges for
 * the irreducible P built here. A chain with branching 1 is a permutation: the uniform start is
 * already stationary and the loop ends after one iteration. */
static void stationary(const struct synth_chain *c, const double *prob, double *pi)
{
    int V = c->vocab, B = c->branching;
    double *next = mt_malloc(sizeof(double) * V);
    for (int s = 0; s < V; s++) pi[s] = 1.0 / V;
    for (int it = 0; it < SYNTH_PI_MAX_ITERS; it++) {
        for (int s = 0; s < V; s++) next[s] = 0.5 * pi[s];
        for (int s = 0; s < V; s++) {
            double w = 0.5 * pi[s];
            for (int i = 0; i < B; i++) next[c->succ[(int64_t)s * B + i]] += w * prob[(int64_t)s * B + i];
        }
        double sum = 0, diff = 0;
        for (int s = 0; s < V; s++) sum += next[s];
        for (int s = 0; s < V; s++) {
            next[s] /= sum;   /* rounding drift only */
            diff += fabs(next[s] - pi[s]);
            pi[s] = next[s];
        }
        if (diff < SYNTH_PI_TOL) break;
    }
    free(next);
}

struct synth_chain *synth_chain_build(int vocab, int branching, uint64_t seed, char *err, int errcap)
{
    if (vocab < 1) {
        snprintf(err, errcap, "synthetic data: vocab_size %d must be positive", vocab);
        return NULL;
    }
    if (branching < 1 || branching > vocab) {
        snprintf(err, errcap, "data.synthetic_branching %d must be between 1 and the vocab size %d",
                 branching, vocab);
        return NULL;
    }
    if ((int64_t)vocab * branching > SYNTH_MAX_TRANSITIONS) {
        snprintf(err, errcap,
                 "data.synthetic_branching %d x vocab %d = %lld transitions is more than the synthetic "
                 "source supports (%lld); lower data.synthetic_branching",
                 branching, vocab, (long long)vocab * branching, (long long)SYNTH_MAX_TRANSITIONS);
        return NULL;
    }
    int V = vocab, B = branching;
    int64_t VB = (int64_t)V * B;
    struct synth_chain *c = mt_calloc(1, sizeof *c);
    c->vocab = V;
    c->branching = B;
    c->seed = seed;
    c->succ = mt_malloc(sizeof(int32_t) * VB);
    c->cdf = mt_malloc(sizeof(double) * VB);
    c->pi_cdf = mt_malloc(sizeof(double) * V);
    double *prob = mt_malloc(sizeof(double) * VB);   /* [V, B] */
    double *pi = mt_malloc(sizeof(double) * V);
    int32_t *order = mt_malloc(sizeof(int32_t) * V);
    int32_t *used_by = mt_malloc(sizeof(int32_t) * V);   /* row that last took token x */

    mt_rng r;
    mt_rng_seed(&r, stream_seed(seed, SYNTH_TABLE_STREAM, 0));
    for (int s = 0; s < V; s++) order[s] = s;
    for (int s = V - 1; s > 0; s--) {
        int j = rng_below(&r, s + 1);
        int32_t tmp = order[s]; order[s] = order[j]; order[j] = tmp;
    }
    for (int s = 0; s < V; s++) used_by[s] = -1;
    for (int k = 0; k < V; k++) {
        int s = order[k];
        int32_t *row = c->succ + (int64_t)s * B;
        row[0] = order[(k + 1) % V];
        used_by[row[0]] = s;
        for (int i = 1; i < B; i++) {
            int x;
            do x = rng_below(&r, V); while (used_by[x] == s);
            used_by[x] = s;
            row[i] = x;
        }
    }
    for (int s = 0; s < V; s++) {
        double *p = prob + (int64_t)s * B, total = 0;
        for (int i = 0; i < B; i++) {
            p[i] = 0.05 - log(1.0 - mt_rng_uniform(&r));
            total += p[i];
        }
        double acc = 0;
        for (int i = 0; i < B; i++) {
            p[i] /= total;
            acc += p[i];
            c->cdf[(int64_t)s * B + i] = acc;
        }
        c->cdf[(int64_t)s * B + B - 1] = 1.0;
    }

    stationary(c, prob, pi);
    double acc = 0, h = 0;
    for (int s = 0; s < V; s++) {
        double hs = 0;
        for (int i = 0; i < B; i++) {
            double p = prob[(int64_t)s * B + i];
            hs -= p * log(p);
        }
        h += pi[s] * hs;
        acc += pi[s];
        c->pi_cdf[s] = acc;
    }
    c->pi_cdf[V - 1] = 1.0;
    c->entropy_rate = h;

    free(prob);
    free(pi);
    free(order);
    free(used_by);
    return c;
}

void synth_chain_free(struct synth_chain *c)
{
    if (!c) return;
    free(c->succ);
    free(c->cdf);
    free(c->pi_cdf);
    free(c);
}

double synth_chain_entropy_rate(const struct synth_chain *c) { return c->entropy_rate; }

void synth_chain_sequence(const struct synth_chain *c, int64_t q, int seq_len, int32_t *out)
{
    mt_rng r;
    mt_rng_seed(&r, stream_seed(c->seed, SYNTH_SEQ_STREAM, (uint64_t)q));
    int B = c->branching;
    int s = cdf_search(c->pi_cdf, c->vocab, mt_rng_uniform(&r));
    out[0] = s;
    for (int t = 1; t < seq_len; t++) {
        int64_t row = (int64_t)s * B;
        s = c->succ[row + cdf_search(c->cdf + row, B, mt_rng_uniform(&r))];
        out[t] = s;
    }
}
