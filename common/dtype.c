#include "stria_dtype.h"

#include <string.h>

const char *stria_dtype_name(stria_dtype_t dtype)
{
    switch (dtype) {
    case STRIA_DTYPE_F32:
        return "fp32";
    case STRIA_DTYPE_BF16:
        return "bf16";
    case STRIA_DTYPE_F16:
        return "fp16";
    }
    return "unknown";
}

stria_status_t stria_dtype_parse(const char *name, stria_dtype_t *dtype_out)
{
    static const struct {
        const char *name;
        stria_dtype_t dtype;
    } names[] = {
        {"fp32", STRIA_DTYPE_F32},  {"f32", STRIA_DTYPE_F32},       {"float32", STRIA_DTYPE_F32},
        {"bf16", STRIA_DTYPE_BF16}, {"bfloat16", STRIA_DTYPE_BF16}, {"fp16", STRIA_DTYPE_F16},
        {"f16", STRIA_DTYPE_F16},   {"float16", STRIA_DTYPE_F16},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (name != NULL && strcmp(name, names[i].name) == 0) {
            *dtype_out = names[i].dtype;
            return STRIA_OK;
        }
    }
    return stria_error_set(STRIA_ERR_INVALID_ARG,
                           "unknown dtype '%s' (expected fp32, bf16 or fp16)",
                           name ? name : "(null)");
}

size_t stria_dtype_size(stria_dtype_t dtype)
{
    switch (dtype) {
    case STRIA_DTYPE_F32:
        return 4;
    case STRIA_DTYPE_BF16:
    case STRIA_DTYPE_F16:
        return 2;
    }
    return 0;
}

static inline uint32_t stria__f32_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    return u;
}

static inline float stria__bits_f32(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
}

uint16_t stria_f32_to_bf16(float x)
{
    uint32_t u = stria__f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet and a NaN */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float stria_bf16_to_f32(uint16_t x)
{
    return stria__bits_f32((uint32_t)x << 16);
}

uint16_t stria_f32_to_f16(float x)
{
    uint32_t u = stria__f32_bits(x);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t absu = u & 0x7fffffffu;

    if (absu > 0x7f800000u) /* NaN */
        return (uint16_t)(sign | 0x7e00u);
    if (absu >= 0x47800000u) /* >= 65536: inf (65520..65536 rounds up below) */
        return (uint16_t)(sign | 0x7c00u);
    if (absu < 0x38800000u) { /* below 2^-14: subnormal or zero */
        /* Adding 0.5 aligns the mantissa so the FPU does the rounding. */
        float f = stria__bits_f32(absu) + 0.5f;
        return (uint16_t)(sign | (stria__f32_bits(f) - 0x3f000000u));
    }
    uint32_t mant_odd = (absu >> 13) & 1u;
    absu += 0xc8000fffu + mant_odd; /* rebias exponent (-112 << 23) and round */
    return (uint16_t)(sign | (absu >> 13));
}

float stria_f16_to_f32(uint16_t h)
{
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t exp = ((uint32_t)h >> 10) & 0x1fu;
    uint32_t mant = (uint32_t)h & 0x3ffu;

    if (exp == 0x1f)
        return stria__bits_f32(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24 is exact in fp32 */
        float f = (float)mant * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    return stria__bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

float stria_dtype_load(stria_dtype_t dtype, const void *base, size_t i)
{
    switch (dtype) {
    case STRIA_DTYPE_F32:
        return ((const float *)base)[i];
    case STRIA_DTYPE_BF16:
        return stria_bf16_to_f32(((const uint16_t *)base)[i]);
    case STRIA_DTYPE_F16:
        return stria_f16_to_f32(((const uint16_t *)base)[i]);
    }
    return 0.0f;
}

void stria_dtype_store(stria_dtype_t dtype, void *base, size_t i, float x)
{
    switch (dtype) {
    case STRIA_DTYPE_F32:
        ((float *)base)[i] = x;
        break;
    case STRIA_DTYPE_BF16:
        ((uint16_t *)base)[i] = stria_f32_to_bf16(x);
        break;
    case STRIA_DTYPE_F16:
        ((uint16_t *)base)[i] = stria_f32_to_f16(x);
        break;
    }
}

void stria_dtype_convert(stria_dtype_t src_dtype, const void *src, stria_dtype_t dst_dtype,
                         void *dst, size_t n)
{
    if (src_dtype == dst_dtype) {
        memcpy(dst, src, n * stria_dtype_size(src_dtype));
        return;
    }
    for (size_t i = 0; i < n; i++)
        stria_dtype_store(dst_dtype, dst, i, stria_dtype_load(src_dtype, src, i));
}
