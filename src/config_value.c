/* Typed values of config keys: parsing the text of a scalar or list into its field of struct config
 * (with the row's bounds), checking bounds of values filled by other means, and formatting a field
 * back to YAML text that parses to the same bits. Separate from config_table.c so that file stays
 * the table of keys (where new keys are added) and its name lookups. */
#include "config_table.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* ---- typed scalars ---------------------------------------------------------------------- */

/* Copy of s without leading/trailing blanks (a --set value may carry them). */
static void trim(const char *s, char *out, size_t cap)
{
    while (*s && isspace((unsigned char)*s)) s++;
    size_t n = strlen(s);
    while (n > 0 && isspace((unsigned char)s[n - 1])) n--;
    if (n >= cap) n = cap - 1;
    memcpy(out, s, n);
    out[n] = 0;
}

/* The user's text, shortened for a one-line message. */
static const char *shown(const char *text, char *buf, size_t cap)
{
    size_t n = strlen(text);
    if (n < cap) return text;
    snprintf(buf, cap, "%.*s...", (int)(cap - 4), text);
    return buf;
}

static void bounds_text(const struct cfg_key *k, char *buf, size_t cap)
{
    char lo[40], hi[40];
    snprintf(lo, sizeof lo, "%.15g", k->lo);
    snprintf(hi, sizeof hi, "%.15g", k->hi);
    bool has_lo = k->bounds & CFG_LO, has_hi = k->bounds & CFG_HI;
    if (has_lo && has_hi)
        snprintf(buf, cap, "in %s%s, %s%s", k->bounds & CFG_LO_OPEN ? "(" : "[", lo, hi,
                 k->bounds & CFG_HI_OPEN ? ")" : "]");
    else if (has_lo)
        snprintf(buf, cap, "%s %s", k->bounds & CFG_LO_OPEN ? ">" : ">=", lo);
    else
        snprintf(buf, cap, "%s %s", k->bounds & CFG_HI_OPEN ? "<" : "<=", hi);
}

static bool in_bounds(const struct cfg_key *k, double v)
{
    if (k->bounds & CFG_LO) {
        if (k->bounds & CFG_LO_OPEN ? !(v > k->lo) : !(v >= k->lo)) return false;
    }
    if (k->bounds & CFG_HI) {
        if (k->bounds & CFG_HI_OPEN ? !(v < k->hi) : !(v <= k->hi)) return false;
    }
    return true;
}

static bool bounds_error(const struct cfg_key *k, const char *what, char *msg, size_t cap)
{
    char b[96];
    bounds_text(k, b, sizeof b);
    snprintf(msg, cap, "%s.%s%s must be %s (got %s)", k->section, k->key,
             k->type == CFG_INT_LIST ? " elements" : "", b, what);
    return false;
}

static bool parse_ll(const char *t, long long *out)
{
    if (!*t) return false;
    errno = 0;
    char *end = NULL;
    long long v = strtoll(t, &end, 10);
    if (end == t || *end || errno) return false;
    *out = v;
    return true;
}

static bool parse_int(const struct cfg_key *k, const char *t, int *out, char *msg, size_t cap)
{
    long long v;
    char sb[72];
    if (!parse_ll(t, &v)) {
        /* distinguish "12345678901234567890" (too big) from "ten" (not a number) */
        bool digits = *t != 0;
        for (const char *p = (*t == '-' || *t == '+') ? t + 1 : t; *p; p++)
            if (!isdigit((unsigned char)*p)) digits = false;
        if (digits) {
            snprintf(msg, cap, "%s.%s is out of range for a 32-bit integer (got %s)", k->section,
                     k->key, shown(t, sb, sizeof sb));
            return false;
        }
        snprintf(msg, cap, "%s.%s expects an integer, got '%s'", k->section, k->key,
                 shown(t, sb, sizeof sb));
        return false;
    }
    if (v < -INT_MAXD - 1 || v > INT_MAXD) {
        snprintf(msg, cap, "%s.%s is out of range for a 32-bit integer (got %s)", k->section, k->key,
                 t);
        return false;
    }
    if (!in_bounds(k, (double)v)) return bounds_error(k, t, msg, cap);
    *out = (int)v;
    return true;
}

static bool parse_bool(const char *t, bool *out)
{
    static const char *const yes[] = { "true", "yes", "on" }, *const no[] = { "false", "no", "off" };
    for (int i = 0; i < 3; i++) {
        if (strcasecmp(t, yes[i]) == 0) { *out = true; return true; }
        if (strcasecmp(t, no[i]) == 0) { *out = false; return true; }
    }
    return false;
}

bool cfg_list_clear(const struct cfg_key *k, struct config *c)
{
    *(int *)((char *)c + k->count_offset) = 0;
    return true;
}

bool cfg_list_append(const struct cfg_key *k, struct config *c, const char *text, char *msg,
                     size_t cap)
{
    int *n = (int *)((char *)c + k->count_offset);
    int *arr = (int *)((char *)c + k->offset);
    int cap_elems = (int)(k->size / sizeof(int));
    char t[128], sb[72];
    trim(text, t, sizeof t);
    long long v;
    if (!parse_ll(t, &v)) {
        snprintf(msg, cap, "%s.%s expects a list of integers, got element '%s'", k->section, k->key,
                 shown(t, sb, sizeof sb));
        return false;
    }
    if (!in_bounds(k, (double)v)) return bounds_error(k, t, msg, cap);
    if (*n >= cap_elems) {
        snprintf(msg, cap, "%s.%s has more than %d elements", k->section, k->key, cap_elems);
        return false;
    }
    arr[(*n)++] = (int)v;
    return true;
}

/* "[1, 2]", "1,2", "3", "[]" or "" */
static bool parse_list_text(const struct cfg_key *k, struct config *c, const char *t, char *msg,
                            size_t cap)
{
    cfg_list_clear(k, c);
    size_t n = strlen(t);
    char sb[72];
    if (n > 0 && (t[0] == '[' || t[n - 1] == ']')) {
        if (n < 2 || t[0] != '[' || t[n - 1] != ']') {
            snprintf(msg, cap, "%s.%s expects a list like [1, 2], got '%s'", k->section, k->key,
                     shown(t, sb, sizeof sb));
            return false;
        }
        t++;
        n -= 2;
    }
    bool blank = true;
    for (size_t i = 0; i < n; i++)
        if (!isspace((unsigned char)t[i])) blank = false;
    if (blank) return true;  /* [] */
    /* split on every comma, so "1,,2" and "1," show up as empty elements */
    size_t start = 0;
    for (size_t i = 0; i <= n; i++) {
        if (i < n && t[i] != ',') continue;
        char elem[64];
        size_t len = i - start;
        if (len >= sizeof elem) {
            snprintf(msg, cap, "%s.%s has an element longer than %zu characters", k->section,
                     k->key, sizeof elem - 1);
            return false;
        }
        memcpy(elem, t + start, len);
        elem[len] = 0;
        if (!cfg_list_append(k, c, elem, msg, cap)) return false;
        start = i + 1;
    }
    return true;
}

bool cfg_parse_scalar(const struct cfg_key *k, struct config *c, const char *text, bool is_null,
                      char *msg, size_t cap)
{
    void *field = (char *)c + k->offset;
    char sb[72];
    if (k->type == CFG_STRING) {
        /* strings keep their inner blanks: they are paths */
        if (is_null) text = "";
        if (!mt_strlcpy(field, text, k->size)) {
            snprintf(msg, cap, "%s.%s is longer than %zu bytes", k->section, k->key, k->size - 1);
            return false;
        }
        return true;
    }
    if (k->type == CFG_INT_LIST && is_null) return cfg_list_clear(k, c);

    size_t tl = strlen(text) + 1;
    char *t = mt_malloc(tl);
    trim(text, t, tl);
    bool ok = true;
    switch (k->type) {
    case CFG_INT:
        ok = parse_int(k, t, field, msg, cap);
        break;
    case CFG_U64: {
        errno = 0;
        char *end = NULL;
        unsigned long long v = strtoull(t, &end, 10);
        if (!*t || *t == '-' || end == t || *end || errno) {
            snprintf(msg, cap, "%s.%s expects an unsigned 64-bit integer, got '%s'", k->section,
                     k->key, shown(t, sb, sizeof sb));
            ok = false;
        } else {
            *(uint64_t *)field = (uint64_t)v;
        }
        break;
    }
    case CFG_DOUBLE: {
        char *end = NULL;
        double v = *t ? strtod(t, &end) : 0.0;
        if (!*t || end == t || *end || !isfinite(v)) {
            snprintf(msg, cap, "%s.%s expects a number, got '%s'", k->section, k->key,
                     shown(t, sb, sizeof sb));
            ok = false;
        } else if (!in_bounds(k, v)) {
            ok = bounds_error(k, t, msg, cap);
        } else {
            *(double *)field = v;
        }
        break;
    }
    case CFG_BOOL:
        if (is_null || !parse_bool(t, field)) {
            snprintf(msg, cap, "%s.%s expects a boolean (true/false/yes/no/on/off), got '%s'",
                     k->section, k->key, shown(t, sb, sizeof sb));
            ok = false;
        }
        break;
    case CFG_TRI: {
        bool b;
        if (!is_null && strcasecmp(t, "auto") == 0) {
            *(int *)field = MT_TRI_AUTO;
        } else if (!is_null && parse_bool(t, &b)) {
            *(int *)field = b ? MT_TRI_TRUE : MT_TRI_FALSE;
        } else {
            snprintf(msg, cap, "%s.%s expects a boolean (true/false/yes/no/on/off) or auto, got '%s'",
                     k->section, k->key, shown(t, sb, sizeof sb));
            ok = false;
        }
        break;
    }
    case CFG_ENUM: {
        int found = -1;
        for (int i = 0; i < k->n_names; i++)
            if (strcasecmp(t, k->names[i]) == 0) found = i;
        if (found < 0) {
            char opts[128];
            snprintf(msg, cap, "%s.%s expects %s, got '%s'", k->section, k->key,
                     cfg_type_desc(k, opts, sizeof opts), shown(t, sb, sizeof sb));
            ok = false;
        } else {
            *(int *)field = found;
        }
        break;
    }
    case CFG_INT_LIST:
        ok = parse_list_text(k, c, t, msg, cap);
        break;
    case CFG_STRING:
        break;
    }
    free(t);
    return ok;
}

bool cfg_check_bounds(const struct cfg_key *k, const struct config *c, char *msg, size_t cap)
{
    const void *field = (const char *)c + k->offset;
    char v[48];
    switch (k->type) {
    case CFG_INT:
        snprintf(v, sizeof v, "%d", *(const int *)field);
        return in_bounds(k, *(const int *)field) || bounds_error(k, v, msg, cap);
    case CFG_DOUBLE:
        cfg_format_double(*(const double *)field, v, sizeof v);
        return in_bounds(k, *(const double *)field) || bounds_error(k, v, msg, cap);
    case CFG_INT_LIST: {
        int n = *(const int *)((const char *)c + k->count_offset);
        for (int i = 0; i < n; i++) {
            int e = ((const int *)field)[i];
            snprintf(v, sizeof v, "%d", e);
            if (!in_bounds(k, e)) return bounds_error(k, v, msg, cap);
        }
        return true;
    }
    case CFG_TRI: {
        int e = *(const int *)field;
        if (e < MT_TRI_FALSE || e > MT_TRI_AUTO) {
            snprintf(msg, cap, "%s.%s holds an invalid value %d", k->section, k->key, e);
            return false;
        }
        return true;
    }
    case CFG_ENUM: {
        int e = *(const int *)field;
        if (e < 0 || e >= k->n_names) {
            snprintf(msg, cap, "%s.%s holds an invalid value %d", k->section, k->key, e);
            return false;
        }
        return true;
    }
    default:
        return true;
    }
}

void cfg_format_double(double d, char *buf, size_t cap)
{
    char tmp[64];
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*g", prec, d);
        if (strtod(tmp, NULL) == d) break;
    }
    if (isfinite(d) && !strpbrk(tmp, ".e")) {
        snprintf(buf, cap, "%s.0", tmp);
    } else if (isfinite(d) && strchr(tmp, 'e') && !strchr(tmp, '.')) {
        /* "1e-06" -> "1.0e-06": YAML 1.1 readers (PyYAML) need the dot to see a float */
        char *e = strchr(tmp, 'e');
        snprintf(buf, cap, "%.*s.0%s", (int)(e - tmp), tmp, e);
    } else {
        snprintf(buf, cap, "%s", tmp);
    }
}

/* Double-quoted YAML scalar: paths may hold ':' '#' or leading blanks that plain style would eat. */
static int format_string(const char *s, char *buf, size_t cap)
{
    size_t n = 0;
#define PUT(ch) do { if (n + 1 < cap) buf[n] = (ch); n++; } while (0)
    PUT('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') {
            PUT('\\');
            PUT((char)*p);
        } else if (*p < 0x20) {
            char esc[8];
            snprintf(esc, sizeof esc, "\\x%02x", *p);
            for (char *e = esc; *e; e++) PUT(*e);
        } else {
            PUT((char)*p);
        }
    }
    PUT('"');
#undef PUT
    if (cap) buf[MT_MIN(n, cap - 1)] = 0;
    return (int)n;
}

int cfg_format_value(const struct cfg_key *k, const struct config *c, char *buf, size_t cap)
{
    const void *field = (const char *)c + k->offset;
    char d[64];
    switch (k->type) {
    case CFG_INT:
        return snprintf(buf, cap, "%d", *(const int *)field);
    case CFG_U64:
        return snprintf(buf, cap, "%" PRIu64, *(const uint64_t *)field);
    case CFG_DOUBLE:
        cfg_format_double(*(const double *)field, d, sizeof d);
        return snprintf(buf, cap, "%s", d);
    case CFG_BOOL:
        return snprintf(buf, cap, "%s", *(const bool *)field ? "true" : "false");
    case CFG_TRI: {
        int e = *(const int *)field;
        return snprintf(buf, cap, "%s", e == MT_TRI_AUTO ? "auto" : e == MT_TRI_TRUE ? "true" : "false");
    }
    case CFG_STRING:
        return format_string(field, buf, cap);
    case CFG_ENUM: {
        int e = *(const int *)field;
        return snprintf(buf, cap, "%s", e >= 0 && e < k->n_names ? k->names[e] : "invalid");
    }
    case CFG_INT_LIST: {
        int n = *(const int *)((const char *)c + k->count_offset);
        int total = 0;
        for (int i = 0; i <= n; i++) {
            char piece[24];
            if (i == n) snprintf(piece, sizeof piece, "%s]", n == 0 ? "[" : "");
            else snprintf(piece, sizeof piece, "%s%d", i ? ", " : "[", ((const int *)field)[i]);
            size_t used = MT_MIN((size_t)total, cap);
            total += snprintf(buf + used, cap - used, "%s", piece);
        }
        return total;
    }
    }
    return 0;
}
