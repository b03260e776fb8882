/* On/off switches read from the environment (MT_FORCE_SM80, ...): unset, empty or "0" is off,
 * "1" is on; any other value is a user error naming the variable, so a typo never silently
 * leaves a switch off. */
#ifndef MT_ENV_FLAG_H
#define MT_ENV_FLAG_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

bool mt_env_flag(const char *name);
/* A positive number from the environment; unset or empty: fallback; anything else a user error. */
double mt_env_positive(const char *name, double fallback);
/* The index of the environment's value among values[0 .. n); unset or empty: fallback; any other
 * value a user error listing the n values. */
int mt_env_choice(const char *name, const char *const *values, int n, int fallback);

#ifdef __cplusplus
}
#endif

#endif
