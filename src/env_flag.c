#include "env_flag.h"

#include "common.h"

#include <math.h>
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
