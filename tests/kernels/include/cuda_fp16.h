// CPU stand-in for CUDA's fp16 header, on the compiler's _Float16 (IEEE binary16, conversions
// rounded to nearest even).
#pragma once
#include <cstdint>
#include <cstring>

struct __half {
    uint16_t bits;
};

inline float __half2float(__half h) {
    _Float16 v;
    std::memcpy(&v, &h.bits, sizeof v);
    return static_cast<float>(v);
}

inline __half __float2half_rn(float f) {
    const _Float16 v = static_cast<_Float16>(f);
    __half h;
    std::memcpy(&h.bits, &v, sizeof v);
    return h;
}

inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline __half __ushort_as_half(unsigned short bits) { return {bits}; }
