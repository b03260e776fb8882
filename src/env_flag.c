#include "env_flag.h"

#include "common.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool mt_env_flag(const char *name)
{
    const char *v = getenv(name);
    if (!v || !*v || !strcmp(v, "0")) return false;
    if (!strcmp(v, "1")) return true;
    mt_user_error("environment variable %s=%s: expected 0 or 1", name, v);
}

double mt_env_positive(const char *name, double fallback)
{
    const char *v = getenv(name);
    if (!v || !*v) return fallback;
    char *end = NULL;
    const double x = strtod(v, &end);
    if (*end || !isfinite(x) || x <= 0) mt_user_error("environment variable %s=%s: expected a positive number", name, v);
    return x;
}

int mt_env_choice(const char *name, const char *const *values, int n, int fallback)
{
    const char *v = getenv(name);
    if (!v || !*v) return fallback;
    char list[256] = "";
    size_t used = 0;
    for (int i = 0; i < n; i++) {
        if (!strcmp(v, values[i])) return i;
        used += (size_t)snprintf(list + used, used < sizeof list ? sizeof list - used : 0, "%s%s", i ? ", " : "",
                                 values[i]);
        if (used >= sizeof list) used = sizeof list - 1;
    }
    mt_user_error("environment variable %s=%s: expected one of %s", name, v, list);
}
