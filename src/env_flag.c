#include "env_flag.h"

#include "common.h"

#include <stdlib.h>
#include <string.h>

bool mt_env_flag(const char *name)
{
    const char *v = getenv(name);
    if (!v || !*v || !strcmp(v, "0")) return false;
    if (!strcmp(v, "1")) return true;
    mt_user_error("environment variable %s=%s: expected 0 or 1", name, v);
}
