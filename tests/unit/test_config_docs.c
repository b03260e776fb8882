/* docs/config.md against the key table (src/config_table.c): every key has exactly one row in its
 * section's table, and every row names a key of that section, so the user's reference can neither
 * miss a key nor keep a stale or duplicated one. Rows are lines "| `key` | ..." under "## section". */
#include <criterion/criterion.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config_table.h"

#define DOC "docs/config.md"
#define MAX_ROWS 512

struct doc_row {
    char section[32];
    char key[64];
    bool mapping; /* type column "mapping": YAML's nested form of the keys <key>_<field> */
    int line;
};

/* the rows of every "## <section>" table whose section is one of the config's */
static int read_rows(struct doc_row *rows)
{
    FILE *f = fopen(DOC, "r");
    cr_assert(f, "%s: cannot open (tests run from the repository root)", DOC);
    char line[8192], section[32] = "";
    int n = 0, ln = 0;
    while (fgets(line, sizeof line, f)) {
        ln++;
        if (!strncmp(line, "## ", 3)) {
            section[0] = 0;
            char name[32];
            if (sscanf(line + 3, "%31s", name) == 1)
                for (int s = 0; s < cfg_n_sections; s++)
                    if (!strcmp(name, cfg_sections[s])) strcpy(section, name);
            continue;
        }
        if (!section[0] || strncmp(line, "| `", 3)) continue;
        const char *k = line + 3, *end = strchr(k, '`');
        cr_assert(end && end - k < 64, "%s:%d: a row's key is not closed by a backquote", DOC, ln);
        cr_assert(n < MAX_ROWS, "%s: more than %d rows", DOC, MAX_ROWS);
        strcpy(rows[n].section, section);
        memcpy(rows[n].key, k, (size_t)(end - k));
        rows[n].key[end - k] = 0;
        rows[n].mapping = !strncmp(end, "` | mapping |", 13);
        rows[n].line = ln;
        n++;
    }
    fclose(f);
    return n;
}

Test(config_docs, every_key_has_one_row_in_its_section)
{
    static struct doc_row rows[MAX_ROWS];
    const int n = read_rows(rows);
    cr_assert(n > 0, "%s: no key rows found", DOC);
    int keys = 0;
    for (int i = 0; i < cfg_n_keys; i++) {
        if (cfg_keys[i].alias) continue;
        keys++;
        int found = 0, first = 0;
        for (int r = 0; r < n; r++)
            if (!strcmp(rows[r].section, cfg_keys[i].section) && !strcmp(rows[r].key, cfg_keys[i].key)) {
                if (!found) first = rows[r].line;
                found++;
            }
        cr_expect_eq(found, 1, "%s.%s: %d rows in %s (first at line %d), want 1", cfg_keys[i].section,
                     cfg_keys[i].key, found, DOC, first);
    }
    cr_assert(keys > 50, "only %d keys in the table", keys);
}

Test(config_docs, every_row_names_a_key_of_its_section)
{
    static struct doc_row rows[MAX_ROWS];
    const int n = read_rows(rows);
    for (int r = 0; r < n; r++) {
        if (!rows[r].mapping) {
            cr_expect(cfg_find(rows[r].section, rows[r].key) >= 0, "%s:%d: `%s` is not a key of section %s",
                      DOC, rows[r].line, rows[r].key, rows[r].section);
            continue;
        }
        char prefix[80];
        snprintf(prefix, sizeof prefix, "%s_", rows[r].key);
        int fields = 0;
        for (int i = 0; i < cfg_n_keys; i++)
            fields += !strcmp(cfg_keys[i].section, rows[r].section) && !strncmp(cfg_keys[i].key, prefix, strlen(prefix));
        cr_expect(fields > 0, "%s:%d: mapping `%s` has no keys %s.%s* to stand for", DOC, rows[r].line,
                  rows[r].key, rows[r].section, prefix);
    }
}
