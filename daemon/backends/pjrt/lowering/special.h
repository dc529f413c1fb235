// Building blocks of the special functions (special.cc, bessel.cc):
// Chebyshev series, CHLO's ops, float64 evaluation.
#ifndef TPUD_DAEMON_BACKENDS_PJRT_LOWERING_SPECIAL_H_
#define TPUD_DAEMON_BACKENDS_PJRT_LOWERING_SPECIAL_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "daemon/backends/pjrt/lowering/helpers.h"
#include "daemon/backends/pjrt/lowering/lowering.h"

namespace tpud::pjrt {

// The Chebyshev series `c` at y (Clenshaw's recurrence, as Cephes' chbevl).
template <size_t N>
std::string Chebyshev(Lowering& l, const std::string& y, const double (&c)[N],
                      const std::vector<int64_t>& d, const HloType& t) {
  std::string b0 = l.Constant(c[0], d, t), b1 = l.Constant(0, d, t), b2 = b1;
  for (size_t i = 1; i < N; ++i) {
    b2 = b1;
    b1 = b0;
    b0 = l.Binary(
        "add",
        l.Binary("subtract", l.Binary("multiply", y, b1, d, t), b2, d, t),
        l.Constant(c[i], d, t), d, t);
  }
  return l.Binary("multiply", l.Constant(0.5, d, t),
                  l.Binary("subtract", b0, b2, d, t), d, t);
}

// exp(-|x|) I0(x), x of type t (float64).
std::string I0e(Lowering& l, const std::string& x,
                const std::vector<int64_t>& d, const HloType& t);

// CHLO's op `op` of operands xs, all (and the result) of dims d and type t.
std::string Chlo(Lowering& l, const char* op,
                 const std::vector<std::string>& xs,
                 const std::vector<int64_t>& d, const HloType& t);

// f(x) computed in float64 and rounded once to the output's type.
using F64Fn =
    std::function<std::string(Lowering&, const std::string&,
                              const std::vector<int64_t>&, const HloType&)>;
Rule InFloat64(F64Fn f);

}  // namespace tpud::pjrt

#endif  // TPUD_DAEMON_BACKENDS_PJRT_LOWERING_SPECIAL_H_
