// float8_e4m3fn -> float for the CPU kernels: a table of all 256 bytes (sign, 4 exponent bits of
// bias 7, 3 mantissa bits; exponent 0 subnormal; S.1111.111 NaN, e4m3fn having no infinities).
#pragma once

#include <cmath>
#include <limits>

namespace jaxengine {

struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float v = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
      if (e == 15 && m == 7) v = std::numeric_limits<float>::quiet_NaN();
      value[b] = b & 128 ? -v : v;
    }
  }
};
inline const Fp8Table kFp8Values;

}  // namespace jaxengine
