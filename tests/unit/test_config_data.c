/* The data section's structured keys: data.path as a YAML list, data.sources as a list of
 * {path, weight}, data.validation as a mapping, and the cross-field checks of document masking. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "config.h"

static char dir[64], errbuf[2048];

static void setup(void)
{
    strcpy(dir, "/tmp/mt_cfgdata_XXXXXX");
    cr_assert(mkdtemp(dir));
}

static void teardown(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

TestSuite(config_data, .init = setup, .fini = teardown);

static const char *put(const char *text)
{
    static char p[128];
    snprintf(p, sizeof p, "%s/c.yaml", dir);
    FILE *f = fopen(p, "w");
    cr_assert(f);
    fputs(text, f);
    fclose(f);
    return p;
}

static bool load(struct config *c, const char *text, int n, char **sets)
{
    errbuf[0] = 0;
    return config_load_checked(c, put(text), n, sets, errbuf, sizeof errbuf);
}

static void fails(const char *text, const char *want)
{
    struct config c;
    cr_assert_not(load(&c, text, 0, NULL), "loaded:\n%s", text);
    cr_expect(strstr(errbuf, want) && !strchr(errbuf, '\n'), "expected '%s' in: %s", want, errbuf);
}

Test(config_data, defaults)
{
    struct config c;
    config_defaults(&c);
    cr_expect_eq(c.data.eos_id, -1);
    cr_expect(!c.data.shuffle && !c.data.document_masking && c.data.loss_after_eos);
    cr_expect_eq(c.data.seed, 1);
    cr_expect(!c.data.sources[0] && !c.data.validation_path[0]);
    cr_expect_eq(c.data.validation_interval, 100);
    cr_expect_eq(c.data.validation_batches, 1);
}

Test(config_data, structured_values_flatten_and_round_trip)
{
    struct config c;
    cr_assert(load(&c, "data:\n  kind: tokens\n  path: [a/, 'b-*.bin', c.bin]\n  shuffle: true\n"
                       "  seed: 7\n  eos_id: 3\n  document_masking: true\n  loss_after_eos: false\n"
                       "  validation: {path: v/, interval: 5, batches: 2}\n", 0, NULL), "%s", errbuf);
    cr_expect_str_eq(c.data.path, "a/,b-*.bin,c.bin");
    cr_expect_str_eq(c.data.validation_path, "v/");
    cr_expect_eq(c.data.validation_interval, 5);
    cr_expect_eq(c.data.validation_batches, 2);
    cr_expect(c.data.shuffle && c.data.document_masking && !c.data.loss_after_eos);
    cr_expect_eq(c.data.seed, 7);
    cr_expect_eq(c.data.eos_id, 3);
    /* config_to_yaml writes the flat form, which loads back to the same values */
    int n = config_to_yaml(&c, NULL, 0);
    char *y = malloc((size_t)n + 1);
    config_to_yaml(&c, y, n + 1);
    struct config d;
    cr_assert(load(&d, y, 0, NULL), "%s\n%s", errbuf, y);
    cr_expect(memcmp(&c.data, &d.data, sizeof c.data) == 0, "data section changed:\n%s", y);
    free(y);

    cr_assert(load(&c, "data:\n  kind: tokens\n  sources:\n    - {path: web/, weight: 0.7}\n"
                       "    - path: books.bin\n      weight: 3\n", 0, NULL), "%s", errbuf);
    cr_expect_str_eq(c.data.sources, "web/:0.7,books.bin:3");
    char *sets[] = {"data.sources=x.bin:1,y.bin:2", "data.validation_path=h.bin"};
    cr_assert(load(&c, "data:\n  kind: tokens\n", 2, sets), "%s", errbuf);
    cr_expect_str_eq(c.data.sources, "x.bin:1,y.bin:2");
    cr_expect_str_eq(c.data.validation_path, "h.bin");
}

Test(config_data, errors_are_one_line)
{
    fails("data:\n  kind: tokens\n  path: a.bin\n  document_masking: true\n",
          "data.document_masking: true needs data.eos_id");
    fails("data:\n  kind: tokens\n  path: a.bin\n  loss_after_eos: false\n",
          "data.loss_after_eos: false needs data.eos_id");
    fails("data:\n  kind: tokens\n  path: a.bin\n  eos_id: 600\n", "data.eos_id (600) must be < model.vocab_size (512)");
    fails("data:\n  kind: tokens\n  path: a.bin\n  eos_id: -2\n", "data.eos_id");
    fails("data:\n  kind: tokens\n  path: a.bin\n  sources: [{path: b.bin, weight: 1}]\n",
          "data.path and data.sources are both set");
    fails("data:\n  sources: [{path: b.bin, weight: 1}]\n", "data.sources needs data.kind: tokens");
    fails("data:\n  validation: {path: v.bin}\n", "data.validation_path needs data.kind: tokens");
    fails("data:\n  kind: tokens\n  sources: [{path: b.bin}]\n", "needs both path and weight");
    fails("data:\n  kind: tokens\n  sources: [{path: b.bin, weight: 1, extra: 2}]\n",
          "unknown key 'extra' in a data.sources entry");
    fails("data:\n  kind: tokens\n  sources: [b.bin]\n", "expects a list of {path, weight} mappings");
    fails("data:\n  kind: tokens\n  path: [[a]]\n", "data.path expects a list of paths");
    fails("data:\n  kind: tokens\n  path: ['a,b']\n", "contains a ','");
    fails("data:\n  kind: tokens\n  path: a.bin\n  validation: {path: v, every: 3}\n",
          "unknown key 'every' under data.validation");
    fails("data:\n  kind: tokens\n  path: a.bin\n  validation: {interval: 0}\n",
          "data.validation_interval");
    fails("data:\n  kind: tokens\n  path: a.bin\n  validation_interval: 2\n  validation: {interval: 3}\n",
          "data.validation_interval is set twice");
}
