/* The table of config keys: one row per "section.key" with its type, place in struct config, bounds
 * and enum names. YAML loading, --set overrides, validation and config_to_yaml all walk this one
 * table, so a key cannot exist in one path and be missing from another. Internal to config_*.c. */
#ifndef MT_CONFIG_TABLE_H
#define MT_CONFIG_TABLE_H

#include <stdbool.h>
#include <stddef.h>

#include "config.h"

/* CFG_TRI: a boolean or `auto` in an enum mt_tri field */
enum cfg_type { CFG_INT, CFG_U64, CFG_DOUBLE, CFG_BOOL, CFG_TRI, CFG_STRING, CFG_ENUM, CFG_INT_LIST };

/* bound flags */
#define CFG_LO      1u   /* value >= lo (or > lo with CFG_LO_OPEN) */
#define CFG_LO_OPEN 2u
#define CFG_HI      4u   /* value <= hi (or < hi with CFG_HI_OPEN) */
#define CFG_HI_OPEN 8u
#define INT_MAXD 2147483647.0  /* INT_MAX as a bound (lo/hi are doubles) */

struct cfg_key {
    const char *section;
    const char *key;
    enum cfg_type type;
    size_t offset;              /* of the value in struct config */
    size_t size;                /* bytes at offset (copied when YAML/--set override hf_config JSON) */
    size_t count_offset;        /* CFG_INT_LIST: offset of the element count */
    unsigned bounds;            /* CFG_LO | CFG_HI ...; for CFG_INT_LIST they bound every element */
    double lo, hi;
    const char *const *names;   /* CFG_ENUM: names indexed by the enum's value */
    int n_names;
    bool alias;                 /* another name for the row at the same offset (not printed) */
};

extern const struct cfg_key cfg_keys[];
extern const int cfg_n_keys;
extern const char *const cfg_sections[];
extern const int cfg_n_sections;

/* Index of section.key (aliases resolve to their canonical row), or -1. */
int cfg_find(const char *section, const char *key);
bool cfg_section_known(const char *section);

/* Optimal-string-alignment edit distance (a swap of neighbours costs 1: "stpes" -> "steps"). */
int cfg_edit_distance(const char *a, const char *b);

/* Writes " (did you mean 'X'?)" for the nearest known key of `section` (or "section.key" if the key
 * exists verbatim in another section), or "" when nothing is close. */
void cfg_suggest_key(const char *section, const char *key, char *buf, size_t cap);
void cfg_suggest_section(const char *section, char *buf, size_t cap);

/* Parses the text of one scalar into the field of row k. `is_null` marks a YAML null (plain "",
 * "~", "null"): it empties strings and lists and is a type error elsewhere. Checks the bounds. On
 * failure writes "section.key expects ..., got '...'" or "section.key must be ..." into msg. */
bool cfg_parse_scalar(const struct cfg_key *k, struct config *c, const char *text, bool is_null,
                      char *msg, size_t cap);

/* "an integer", "a boolean (true/false/...)", "one of bf16|fp32", ... for "expects X" messages. */
const char *cfg_type_desc(const struct cfg_key *k, char *buf, size_t cap);

/* CFG_INT_LIST from already-separated elements (a YAML sequence). */
bool cfg_list_clear(const struct cfg_key *k, struct config *c);
bool cfg_list_append(const struct cfg_key *k, struct config *c, const char *text, char *msg,
                     size_t cap);

/* Checks the bounds of the value now in the struct (used after hf_config JSON fills fields). */
bool cfg_check_bounds(const struct cfg_key *k, const struct config *c, char *msg, size_t cap);

/* Formats the value of row k as a YAML scalar or flow sequence that cfg_parse_scalar reads back
 * to the same bits. Returns snprintf's count. */
int cfg_format_value(const struct cfg_key *k, const struct config *c, char *buf, size_t cap);

/* Shortest "%.{15,16,17}g" that reads back to exactly d, always with a '.' or an exponent so YAML
 * readers see a float. */
void cfg_format_double(double d, char *buf, size_t cap);

#endif
