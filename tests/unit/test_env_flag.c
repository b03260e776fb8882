#include <criterion/criterion.h>

#include <stdlib.h>

#include "env_flag.h"

Test(env_flag, unset_empty_zero_are_off_one_is_on)
{
    unsetenv("MT_TEST_FLAG");
    cr_assert(!mt_env_flag("MT_TEST_FLAG"));
    setenv("MT_TEST_FLAG", "", 1);
    cr_assert(!mt_env_flag("MT_TEST_FLAG"));
    setenv("MT_TEST_FLAG", "0", 1);
    cr_assert(!mt_env_flag("MT_TEST_FLAG"));
    setenv("MT_TEST_FLAG", "1", 1);
    cr_assert(mt_env_flag("MT_TEST_FLAG"));
}

/* a typo ("yes", "true", "2") is an error, not silently off */
Test(env_flag, other_values_exit_with_an_error, .exit_code = 1)
{
    setenv("MT_TEST_FLAG", "yes", 1);
    mt_env_flag("MT_TEST_FLAG");
}
