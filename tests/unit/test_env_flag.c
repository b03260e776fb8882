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

static const char *const rounds[] = {"seq", "1", "2", "3"};

Test(env_flag, a_choice_is_its_index_unset_is_the_fallback)
{
    unsetenv("MT_TEST_CHOICE");
    cr_assert_eq(mt_env_choice("MT_TEST_CHOICE", rounds, 4, 2), 2);
    setenv("MT_TEST_CHOICE", "", 1);
    cr_assert_eq(mt_env_choice("MT_TEST_CHOICE", rounds, 4, 3), 3);
    setenv("MT_TEST_CHOICE", "seq", 1);
    cr_assert_eq(mt_env_choice("MT_TEST_CHOICE", rounds, 4, 2), 0);
    setenv("MT_TEST_CHOICE", "3", 1);
    cr_assert_eq(mt_env_choice("MT_TEST_CHOICE", rounds, 4, 2), 3);
}

/* a value not in the list ("9", "SEQ", "3 ") is an error, not the fallback */
Test(env_flag, a_value_not_among_the_choices_exits_with_an_error, .exit_code = 1)
{
    setenv("MT_TEST_CHOICE", "SEQ", 1);
    mt_env_choice("MT_TEST_CHOICE", rounds, 4, 2);
}
