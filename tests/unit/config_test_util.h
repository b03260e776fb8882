/* The config tests' scaffolding (test_config.c, test_config_hf.c): a fresh temporary directory per
 * test (each file's suite runs make_tmp / remove_tmp around its tests), YAML written into it, and
 * loads whose one-line errors the tests read. Header-only, static: each file has its own copy of
 * the state and these short names stay inside it. */
#ifndef MT_TESTS_CONFIG_TEST_UTIL_H
#define MT_TESTS_CONFIG_TEST_UTIL_H

#include <criterion/criterion.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"

static char tmpdir[256];  /* short, so "tmpdir/name" always fits a PATH_MAX buffer */
static char errbuf[2048];

static inline void make_tmp(void)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/mt_test_config_XXXXXX");
    cr_assert_not_null(mkdtemp(tmpdir));
}

static inline void remove_tmp(void)
{
    char cmd[PATH_MAX + 16];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0) cr_log_warn("could not remove %s", tmpdir);
}

/* Writes text to tmpdir/name and returns the path (static storage, a few at a time). */
static inline const char *put(const char *name, const char *text)
{
    static char paths[8][PATH_MAX];
    static int next;
    char *p = paths[next++ % 8];
    snprintf(p, PATH_MAX, "%s/%s", tmpdir, name);
    FILE *f = fopen(p, "w");
    cr_assert_not_null(f, "fopen %s", p);
    cr_assert_eq(fputs(text, f) >= 0, true);
    cr_assert_eq(fclose(f), 0);
    return p;
}

static inline bool load(struct config *c, const char *path, int n, char **sets)
{
    errbuf[0] = 0;
    return config_load_checked(c, path, n, sets, errbuf, sizeof errbuf);
}

/* Loads text that must fail; returns the message. */
static inline const char *fails(const char *text)
{
    struct config c;
    const char *p = put("bad.yaml", text);
    cr_assert_not(load(&c, p, 0, NULL), "loaded but should fail:\n%s", text);
    cr_assert_null(strchr(errbuf, '\n'), "message is not one line: %s", errbuf);
    return errbuf;
}

static inline void expect(const char *msg, const char *part)
{
    cr_assert_not_null(strstr(msg, part), "expected '%s' in: %s", part, msg);
}

/* "FILE:LINE:COL:" of bad.yaml */
static inline void expect_at(const char *msg, int line, int col)
{
    char want[PATH_MAX + 32];
    snprintf(want, sizeof want, "%s/bad.yaml:%d:%d: ", tmpdir, line, col);
    cr_assert_eq(strncmp(msg, want, strlen(want)), 0, "expected prefix '%s' in: %s", want, msg);
}

static inline char *yaml_of(const struct config *c)
{
    int n = config_to_yaml(c, NULL, 0);
    char *buf = malloc((size_t)n + 1);
    cr_assert_eq(config_to_yaml(c, buf, n + 1), n);
    return buf;
}

/* config_to_yaml without its first line (which names the file loaded from) */
static inline char *body_of(const struct config *c)
{
    char *y = yaml_of(c);
    char *nl = strchr(y, '\n');
    memmove(y, nl + 1, strlen(nl + 1) + 1);
    return y;
}

#endif
