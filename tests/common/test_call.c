/* The call record and its rule book (common/call.c): every rule accepts what
 * it should and refuses the rest with the message the doors show (libstria,
 * the coordinator, the worker, the ring engine and, prefixed, the kernels),
 * and the record's copy, comparison, digest and binding. */
#include <criterion/criterion.h>

#include <math.h>
#include <string.h>

#include "stria_call.h"
#include "stria_net.h"

static void expect_refused(stria_status_t st, const char *msg)
{
    cr_expect_eq(st, STRIA_ERR_INVALID_ARG, "expected a refusal: %s", msg);
    cr_expect_str_eq(stria_error_msg(), msg);
}

Test(call, documents_lists)
{
    static const int64_t one[] = {0, 9}, empty_docs[] = {0, 0, 4, 4, 9}, start1[] = {1, 9},
                         dec[] = {0, 300, 17, 1024}, zero[] = {0};
    cr_expect_eq(stria_call_docs_check(NULL, 0), STRIA_OK);
    cr_expect_eq(stria_call_docs_check(one, 2), STRIA_OK);
    cr_expect_eq(stria_call_docs_check(empty_docs, 5), STRIA_OK, "empty documents are allowed");
    cr_expect_eq(stria_call_docs_check(zero, 1), STRIA_OK, "where it ends is the caller's rule");
    expect_refused(stria_call_docs_check(NULL, 3), "cu_seqlens is NULL with 3 entries");
    expect_refused(stria_call_docs_check(start1, 2), "cu_seqlens must start at 0 (got 1)");
    expect_refused(stria_call_docs_check(dec, 4),
                   "cu_seqlens must not decrease (entry 2 is 17 after 300)");
}

Test(call, windows)
{
    cr_expect_eq(stria_call_window_check(false, 0, 0, true), STRIA_OK);
    cr_expect_eq(stria_call_window_check(true, 0, 0, true), STRIA_OK);
    cr_expect_eq(stria_call_window_check(true, 128, -1, true), STRIA_OK);
    cr_expect_eq(stria_call_window_check(true, -1, -1, false), STRIA_OK);
    cr_expect_eq(stria_call_window_check(true, 3, 5, false), STRIA_OK, "non-causal looks ahead");
    expect_refused(stria_call_window_check(false, 3, 0, false),
                   "window_left/window_right are set (3, 0) but has_window is false");
    expect_refused(stria_call_window_check(false, 0, -1, true),
                   "window_left/window_right are set (0, -1) but has_window is false");
    expect_refused(stria_call_window_check(true, -2, 0, false),
                   "window.left must be >= -1 (-1: unbounded) (got -2)");
    expect_refused(stria_call_window_check(true, 4, -7, false),
                   "window.right must be >= -1 (-1: unbounded) (got -7)");
    expect_refused(stria_call_window_check(true, 4, 1, true),
                   "window.right must be 0 or -1 with causal attention (got 1)");
}

Test(call, masks_of_a_call)
{
    static const int64_t cu[] = {0, 500, 1024}, short_cu[] = {0, 1000}, long_cu[] = {0, 2048};
    stria_call_shape_t c = {.batch = 1, .seq_len = 1024, .causal = true};
    cr_expect_eq(stria_call_masks_check(&c), STRIA_OK);
    c.cu_seqlens = cu;
    c.n_cu_seqlens = 3;
    c.has_window = true;
    c.window_left = 64;
    cr_expect_eq(stria_call_masks_check(&c), STRIA_OK, "%s", stria_error_msg());
    c.cu_seqlens = short_cu;
    c.n_cu_seqlens = 2;
    expect_refused(stria_call_masks_check(&c), "cu_seqlens must end at seq_len (1024) (got 1000)");
    c.cu_seqlens = long_cu;
    expect_refused(stria_call_masks_check(&c), "cu_seqlens must end at seq_len (1024) (got 2048)");
    /* the list's own rules come before its end, the window after it */
    static const int64_t dec[] = {0, 300, 17};
    c.cu_seqlens = dec;
    c.n_cu_seqlens = 3;
    expect_refused(stria_call_masks_check(&c),
                   "cu_seqlens must not decrease (entry 2 is 17 after 300)");
    c.cu_seqlens = cu;
    c.window_right = 2;
    expect_refused(stria_call_masks_check(&c),
                   "window.right must be 0 or -1 with causal attention (got 2)");
    /* a list longer than every door allows is refused before it is read */
    c.window_right = 0;
    c.cu_seqlens = NULL;
    c.n_cu_seqlens = STRIA_CALL_MAX_CU_SEQLENS + 1;
    expect_refused(stria_call_masks_check(&c),
                   "cu_seqlens has 65537 entries, more than the limit of 65536");
}

Test(call, against_a_sessions_bounds)
{
    static const int64_t short_cu[] = {0, 100};
    const stria_call_bounds_t b = {.max_batch = 2, .max_seq_len = 512, .n_ranks = 4};
    stria_call_shape_t c = {.batch = 2, .seq_len = 512, .causal = true};
    cr_expect_eq(stria_call_shape_check(&c, &b), STRIA_OK);
    c.batch = 1;
    c.seq_len = 1024; /* batch x seq_len within the bound's product */
    cr_expect_eq(stria_call_shape_check(&c, &b), STRIA_OK);
    c.seq_len = 3; /* shorter than the ring: ranks past the end hold padding */
    cr_expect_eq(stria_call_shape_check(&c, &b), STRIA_OK);
    c.batch = 3;
    expect_refused(stria_call_shape_check(&c, &b),
                   "call batch must be 1..2, the session's max_batch (got 3)");
    c.batch = 1;
    c.seq_len = 0;
    expect_refused(stria_call_shape_check(&c, &b), "call seq_len must be at least 1 (got 0)");
    c.seq_len = 1025;
    expect_refused(stria_call_shape_check(&c, &b),
                   "call batch x seq_len (1 x 1025) exceeds the session's bound max_batch x "
                   "max_seq_len (2 x 512)");
    c.seq_len = 512;
    c.scale = NAN;
    expect_refused(stria_call_shape_check(&c, &b),
                   "call scale must be finite and >= 0 (0: 1/sqrt(head_dim)) (got nan)");
    c.scale = 0.125f;
    c.cu_seqlens = short_cu;
    c.n_cu_seqlens = 2;
    expect_refused(stria_call_shape_check(&c, &b),
                   "call: cu_seqlens must end at seq_len (512) (got 100)");
}

/* A call with every field set; its documents are the caller's to point. */
static stria_call_shape_t full_call(const int64_t *cu)
{
    return (stria_call_shape_t){.batch = 2,
                                .seq_len = 64,
                                .causal = true,
                                .scale = 0.5f,
                                .cu_seqlens = cu,
                                .n_cu_seqlens = 3,
                                .has_window = true,
                                .window_left = 16};
}

Test(call, owning_copies_compare_by_value)
{
    int64_t cu[] = {0, 7, 64};
    const stria_call_shape_t c = full_call(cu);
    stria_call_shape_t copy, plain;
    cr_assert_eq(stria_call_shape_copy(&c, &copy), STRIA_OK);
    cr_expect(copy.cu_seqlens != cu, "the copy owns its documents");
    cr_expect(stria_call_shape_equal(&c, &copy));
    cu[1] = 8; /* the caller's array changes; the copy does not */
    cr_expect_eq(copy.cu_seqlens[1], 7);
    cr_expect_not(stria_call_shape_equal(&c, &copy));
    cu[1] = 7;
    stria_call_shape_t other = copy;
    other.window_left = 15;
    cr_expect_not(stria_call_shape_equal(&copy, &other));
    other = copy;
    other.n_cu_seqlens = 0;
    cr_expect_not(stria_call_shape_equal(&copy, &other));
    stria_call_shape_free(&copy);
    cr_expect(copy.cu_seqlens == NULL && copy.n_cu_seqlens == 0 && copy.batch == 0);

    /* no documents: nothing allocated; freeing a zeroed record is harmless */
    const stria_call_shape_t bare = {.batch = 1, .seq_len = 9};
    cr_assert_eq(stria_call_shape_copy(&bare, &plain), STRIA_OK);
    cr_expect_null(plain.cu_seqlens);
    cr_expect(stria_call_shape_equal(&bare, &plain));
    stria_call_shape_free(&plain);
    stria_call_shape_free(&plain);
}

Test(call, digest_covers_every_field_and_binding_its_bytes)
{
    static const int64_t cu[] = {0, 7, 64}, cu2[] = {0, 7, 64}, cu3[] = {0, 8, 64};
    const stria_call_shape_t c = full_call(cu);
    const uint64_t d = stria_call_shape_digest(&c, STRIA_LAYOUT_STRIPED, 5, false);
    stria_call_shape_t x = c;
    x.cu_seqlens = cu2;
    cr_expect_eq(stria_call_shape_digest(&x, STRIA_LAYOUT_STRIPED, 5, false), d,
                 "documents by value");
    cr_expect_neq(stria_call_shape_digest(&c, STRIA_LAYOUT_STRIPED, 6, false), d);
    cr_expect_neq(stria_call_shape_digest(&c, STRIA_LAYOUT_STRIPED, 5, true), d);
    cr_expect_neq(stria_call_shape_digest(&c, STRIA_LAYOUT_ZIGZAG, 5, false), d, "the layout");
    cr_expect_neq(stria_call_shape_digest(&c, STRIA_LAYOUT_PACKED, 5, false),
                  stria_call_shape_digest(&c, STRIA_LAYOUT_STRIPED, 5, false),
                  "packed against striped");
    stria_call_shape_t v[8];
    for (int i = 0; i < 8; i++)
        v[i] = c;
    v[0].batch = 1;
    v[1].seq_len = 65;
    v[2].causal = false;
    v[3].scale = 0.25f;
    v[4].cu_seqlens = cu3;
    v[5].n_cu_seqlens = 0;
    v[6].has_window = false;
    v[7].window_right = -1;
    for (int i = 0; i < 8; i++)
        cr_expect_neq(stria_call_shape_digest(&v[i], STRIA_LAYOUT_STRIPED, 5, false), d, "field %d",
                      i);

    uint8_t b[STRIA_CALL_BINDING_BYTES];
    stria_call_place_t p = {.call = 5,
                            .link_epoch = 9,
                            .arena = true,
                            .arena_in = 4096,
                            .arena_out = 8192,
                            .more = true,
                            .piece_offset = 65536,
                            .use_held = true,
                            .held_call = 4};
    stria_call_binding(&c, STRIA_LAYOUT_STRIPED, &p, b);
    cr_expect_eq(stria_get_le64(b), 5);
    cr_expect_eq(stria_get_le64(b + 8), 9);
    cr_expect_eq(stria_get_le64(b + 16), d);
    cr_expect(b[24] == (1 | 2 | 8) && stria_get_le64(b + 25) == 4096 &&
              stria_get_le64(b + 33) == 8192);
    cr_expect(stria_get_le64(b + 41) == 65536 && stria_get_le64(b + 49) == 4);
    p.arena = p.more = p.use_held = false;
    p.hold = true;
    stria_call_binding(&c, STRIA_LAYOUT_STRIPED, &p, b);
    cr_expect(b[24] == 4 && stria_get_le64(b + 25) == 0 && stria_get_le64(b + 33) == 0,
              "without an arena its places are not bound");
    cr_expect_eq(stria_get_le64(b + 49), 0, "nor a held call without use_held");
}

/* A scale of 0 stands for 1/sqrt(head_dim): one rule, so the coordinator's
 * record of a job and a trainer rank that passes 0 make the same call. */
Test(call, scale_zero_is_one_over_sqrt_head_dim)
{
    cr_expect_eq(stria_call_scale(0.0f, 64), 0.125f);
    cr_expect_eq(stria_call_scale(0.0f, 32), (float)(1.0 / sqrt(32.0)));
    cr_expect_eq(stria_call_scale(0.5f, 64), 0.5f, "a scale given is kept");
    stria_call_shape_t a = {.batch = 2, .seq_len = 77, .causal = true, .scale = 0.0f};
    stria_call_shape_t b = a;
    b.scale = stria_call_scale(0.0f, 32);
    a.scale = stria_call_scale(a.scale, 32);
    cr_expect_eq(stria_call_shape_digest(&a, STRIA_LAYOUT_STRIPED, 0, false),
                 stria_call_shape_digest(&b, STRIA_LAYOUT_STRIPED, 0, false));
}
